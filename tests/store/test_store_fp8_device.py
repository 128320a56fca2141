"""fp8 on a GPU: encoding there gives the CPU's bits (so a store's bytes do not depend on where it was
converted), and the trainer's collate decodes on the device what the CPU decodes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from eaglenest.contract import ContractError
from eaglenest.drafter.data import collate
from eaglenest.store import convert, open_store
from eaglenest.store.encoding import decode_fp8, encode_fp8, encode_samples, encode_states
from eaglenest.testing.fake_store import fake_provenance, make_extraction

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_encode_and_decode_on_the_gpu_match_the_cpu_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 4 * 576, generator=g) * torch.logspace(-3, 3, 3000).unsqueeze(1)
    x[::7, :5] *= 3000.0  # massive activations
    x = x.to(torch.bfloat16)
    codes, scale = encode_fp8(x, 4)
    gcodes, gscale = encode_fp8(x.cuda(), 4)
    assert torch.equal(scale, gscale.cpu()), int((scale != gscale.cpu()).sum())
    diff = (codes != gcodes.cpu()).nonzero()
    assert len(diff) == 0, f"{len(diff)} codes differ, e.g. at {diff[:3].tolist()}: x " \
        f"{[float(x[r, c]) for r, c in diff[:3].tolist()]}, cpu {[int(codes[r, c]) for r, c in diff[:3].tolist()]}, " \
        f"gpu {[int(gcodes[r, c]) for r, c in diff[:3].tolist()]}"
    assert torch.equal(decode_fp8(codes, scale), decode_fp8(gcodes, gscale).cpu())


def test_samples_packed_for_the_gpu_get_the_cpu_bits_and_a_non_finite_one_is_named():
    g = torch.Generator().manual_seed(0)
    states = [((torch.randn(t, 3 * 64, generator=g) * 10.0 ** (t % 7 - 3)).to(torch.bfloat16),
               torch.randn(t, 64, generator=g).to(torch.bfloat16)) for t in (1, 17, 300, 2)]
    names = [f"sample 's{i}'" for i in range(len(states))]
    together = encode_samples(states, 3, names=names, device=torch.device("cuda"))
    for (aux, final), name, got in zip(states, names, together, strict=True):
        alone = encode_states(aux, final, 3, what=name)
        for field in ("aux_codes", "aux_scale", "final_codes", "final_scale"):
            assert getattr(got, field).device.type == "cpu" and torch.equal(getattr(got, field), getattr(alone, field))
    assert torch.tensor([448.00003, 463.9], device="cuda").to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [
        0x7E, 0x7E]  # the encoder relies on it instead of clamping
    states[2][1][5, 0] = float("nan")
    with pytest.raises(ContractError, match="sample 's2' final_hidden: non-finite"):
        encode_samples(states, 3, names=names, device=torch.device("cuda"))


def test_store_converted_on_the_gpu_equals_the_cpu_one_and_collates_on_the_gpu(tmp_path):
    prov = fake_provenance(hidden_size=576, aux_layer_ids=(1, 14, 26), num_layers=30)
    make_extraction(tmp_path / "ex", [300, 17, 120, 64], provenance=prov)
    convert(tmp_path / "ex", str(tmp_path / "cpu"), encoding="fp8", device="cpu")
    convert(tmp_path / "ex", str(tmp_path / "gpu"), encoding="fp8", device="cuda")
    cpu, gpu = open_store(str(tmp_path / "cpu")), open_store(str(tmp_path / "gpu"))
    assert [f["sha256"] for f in cpu.manifest["files"]] == [f["sha256"] for f in gpu.manifest["files"]]
    assert hashlib.sha256(Path(cpu._paths[0]).read_bytes()).hexdigest() == cpu.manifest["files"][0]["sha256"]
    samples = [gpu[i] for i in range(len(gpu))]
    batch = collate(samples, list(range(len(samples))), max_seq_len=256, dtype=torch.bfloat16, device="cuda")
    assert batch.aux_hidden.device.type == "cuda" and batch.final_hidden.device.type == "cuda"
    for r, s in enumerate(samples):
        n = min(s.num_tokens, 256)
        assert torch.equal(batch.aux_hidden[r, :n].cpu(), s.aux_hidden[:n])  # s decodes on the CPU
        assert torch.equal(batch.final_hidden[r, :n].cpu(), s.final_hidden[:n])
        assert not batch.aux_hidden[r, n:].any()
