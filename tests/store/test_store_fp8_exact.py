"""fp8 encoding keeps its bits: the encoder against the reference formula and fixed expected bytes, samples
packed together against each alone, and the converter's grouped prefetch against one shard at a time."""

from __future__ import annotations

import hashlib

import pytest
import torch

from eaglenest.contract import ContractError
from eaglenest.extraction.ledger import Ledger
from eaglenest.store import open_store
from eaglenest.store.encoding import _encode_packed, encode_fp8, encode_samples, encode_states
from eaglenest.store.shards import group_entries, prefetch_shards
from eaglenest.testing.fake_store import fake_provenance, make_extraction

EVERY_FINITE_BF16_SHA256 = "b682de45b4ccd3f4a7e2476c8ce793dd75e1d045148f72ca6fc0281cdcd5458f"
"""sha256 of the codes and scales of :func:`every_finite_bf16`, in 1 and 4 blocks, from bf16 and float32 (as the
first fp8 encoder wrote them)."""


def every_finite_bf16() -> torch.Tensor:
    """[255, 256] bf16: each finite bf16 bit pattern once, permuted so that rows mix magnitudes."""
    bits = (torch.arange(65536, dtype=torch.int64) * 40503) % 65536  # an odd multiplier: a permutation
    bits = bits[(bits & 0x7F80) != 0x7F80]  # 65,280 finite patterns: NaN/inf dropped
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).reshape(255, 256)


def reference_encode(x: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoding as the module docstring states it, in the plainest ops (floating-point max and a product
    of mixed dtypes)."""
    t, width = x.shape
    xb = x.reshape(t, blocks, width // blocks)  # [T, B, H]
    amax = xb.abs().amax(dim=-1).float()  # [T, B]
    scale = torch.where(amax >= 2.0**-100, amax * float(torch.tensor(1 / 448, dtype=torch.float32)),
                        torch.zeros_like(amax))
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale)).unsqueeze(-1)  # [T, B, 1]
    codes = (xb * inv).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).reshape(t, width)
    return codes, scale


def test_every_finite_bf16_encodes_to_the_reference_bits_and_the_fixed_bytes():
    x = every_finite_bf16()
    h = hashlib.sha256()
    for blocks in (1, 4):
        for xx in (x, x.float()):
            codes, scale = encode_fp8(xx, blocks)
            ref_codes, ref_scale = reference_encode(xx, blocks)
            assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale), (blocks, xx.dtype)
            h.update(codes.numpy().tobytes())
            h.update(scale.numpy().tobytes())
    assert h.hexdigest() == EVERY_FINITE_BF16_SHA256


def test_values_that_round_above_448_get_the_code_of_448():
    """The encoder does not clamp: float32 rounding can put a row's largest value just above 448, and e4m3 rounds
    all of (448, 464) to 448, the code a clamp gives."""
    assert torch.tensor([448.00003, 463.9, -448.00003]).to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [
        0x7E, 0x7E, 0xFE]
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4096, 8, generator=g, dtype=torch.float64) * 200 - 100).exp2().float()  # [R, 8] float32
    x[:, 1::2] *= -1
    ref_codes, ref_scale = reference_encode(x, 2)
    inv = torch.where(ref_scale > 0, 1 / ref_scale, torch.zeros_like(ref_scale)).unsqueeze(-1)
    assert float((x.view(-1, 2, 4) * inv).abs().max()) > 448  # the case is met
    codes, scale = encode_fp8(x, 2)
    assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)


def states_of(lengths: list[int], h: int = 64, k: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """bf16 (aux [T, k*h], final [T, h]) per length: Gaussian rows at many scales, massive activations, zero rows."""
    g = torch.Generator().manual_seed(len(lengths))
    out = []
    for t in lengths:
        aux = torch.randn(t, k * h, generator=g) * torch.logspace(-8, 8, t).unsqueeze(1)
        aux[::5, :3] *= 3000.0
        final = torch.randn(t, h, generator=g)
        final[::4] = 0.0
        out.append((aux.to(torch.bfloat16), final.to(torch.bfloat16)))
    return out


@pytest.mark.parametrize("pack", [False, True])
def test_samples_encoded_together_get_the_bits_of_each_alone(pack):
    states = states_of([1, 17, 300, 2, 64])
    names = [f"sample 's{i}'" for i in range(len(states))]
    encode = _encode_packed if pack else encode_samples  # the packed path is what a GPU runs
    together = encode(states, 3, names=names, device=torch.device("cpu"))
    assert len(together) == len(states)
    for (aux, final), name, got in zip(states, names, together, strict=True):
        alone = encode_states(aux, final, 3, what=name)
        for field in ("aux_codes", "aux_scale", "final_codes", "final_scale"):
            a, b = getattr(got, field), getattr(alone, field)
            assert a.is_contiguous() and torch.equal(a, b), (name, field)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("part", ["aux_hidden", "final_hidden"])
def test_a_non_finite_value_in_a_group_names_its_sample(pack, part):
    states = states_of([5, 9, 4])
    states[1][part == "final_hidden"][7, 3] = float("inf")
    encode = _encode_packed if pack else encode_samples
    with pytest.raises(ContractError, match=rf"sample 's1' {part}: non-finite"):
        encode(states, 3, names=["sample 's0'", "sample 's1'", "sample 's2'"], device=torch.device("cpu"))


def test_grouped_prefetch_yields_every_shard_in_order(tmp_path):
    lengths = [30, 5, 60, 12, 12, 40, 7]
    make_extraction(tmp_path / "ex", lengths, provenance=fake_provenance(hidden_size=32))
    ledger = Ledger(tmp_path / "ex")
    entries = list(ledger.entries().values())
    group_bytes = 2 * entries[0].bytes
    groups = []

    def transform(loaded):
        groups.append([e.sample_id for e, _ in loaded])
        return [(e.sample_id, s.num_tokens) for e, s in loaded]

    got = list(prefetch_shards(ledger.capture_dir, entries, fake_provenance(hidden_size=32), transform=transform,
                               workers=3, group_bytes=group_bytes))
    assert [(e.sample_id, r) for e, r in got] == [(e.sample_id, (e.sample_id, e.num_tokens)) for e in entries]
    expect = [[e.sample_id for e in g] for g in group_entries(entries, group_bytes)]
    assert sorted(groups) == sorted(expect) and 1 < len(expect) < len(entries)
    alone = list(prefetch_shards(ledger.capture_dir, entries, fake_provenance(hidden_size=32)))
    assert [e.sample_id for e, _ in alone] == [s.sample_id for _, s in alone] == [e.sample_id for e in entries]


def test_a_store_converted_in_packed_groups_equals_the_one_converted_sample_by_sample(tmp_path, monkeypatch):
    """What a GPU conversion runs (groups across file boundaries, packed encoding), here on the CPU."""
    from eaglenest.store import converter

    make_extraction(tmp_path / "ex", [30, 5, 60, 12, 12, 40, 7, 25], provenance=fake_provenance(hidden_size=32))
    plain = converter.convert(tmp_path / "ex", str(tmp_path / "plain"), target_file_bytes=20_000, encoding="fp8",
                              device="cpu")
    group_sizes = []

    def packed_on_cpu(states, num_aux, *, names, device):
        group_sizes.append(len(states))
        return _encode_packed(states, num_aux, names=names, device=torch.device("cpu"))

    monkeypatch.setattr(converter, "encode_device", lambda device: torch.device("meta"))  # "not the CPU"
    monkeypatch.setattr(converter, "encode_samples", packed_on_cpu)
    monkeypatch.setattr(converter, "DEVICE_GROUP_BYTES", 25_000)
    grouped = converter.convert(tmp_path / "ex", str(tmp_path / "grouped"), target_file_bytes=20_000,
                                encoding="fp8", device="cuda")
    assert plain.files_total == grouped.files_total > 2 and plain.version == grouped.version
    assert sum(group_sizes) == 8 and max(group_sizes) > 1
    a, b = open_store(str(tmp_path / "plain")), open_store(str(tmp_path / "grouped"))
    assert [f["sha256"] for f in a.manifest["files"]] == [f["sha256"] for f in b.manifest["files"]]
