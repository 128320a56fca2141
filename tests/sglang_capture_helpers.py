"""Fake SGLang capture rows and scheduler objects shared by the capture, plugin and staging tests, and the skip of
the device tests that need a real GPU and sglang (not a test module).

Rows carry their identity (request index, prompt position, layer) so every split, chunk join and shard row can be
checked exactly against ``check_shard``; ``forward`` drives the plugin glue through one scheduler step as sglang's
eager runner would, minus the GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from eaglenest import contract
from eaglenest.engines import sglang_plugin as plugin
from eaglenest.engines.sglang_receipts import receipt_path

H, IDS = 8, (0, 1, 2)
NEEDS_GPU_AND_SGLANG = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
                                          reason="needs a CUDA GPU and sglang")
EXTEND = "EXTEND"


def provenance() -> contract.Provenance:
    return contract.Provenance(engine="sglang", engine_version="0.5.17", model_path="/m", model_hash="h",
                               tokenizer_hash="t", chat_template_hash="c", dtype="bfloat16", tp_size=1,
                               attention_backend="triton", aux_layer_ids=IDS, hidden_size=H, num_layers=4)


def rows_for(req: int, positions: range) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer aux rows [n, H] and final rows [n, H] tagged (req, position, layer)."""
    pos = torch.tensor(list(positions), dtype=torch.float32)
    n = len(pos)

    def tagged(layer: int) -> torch.Tensor:
        t = torch.zeros(n, H)
        t[:, 0], t[:, 1], t[:, 2] = req, pos, layer
        return t

    return [tagged(i) for i in IDS], tagged(9)


def flatten(parts: list[tuple[int, range]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The flattened prefill batch as SGLang hands it to the logits processor."""
    auxs, finals = zip(*(rows_for(r, p) for r, p in parts), strict=True)
    aux = [torch.cat([a[i] for a in auxs]) for i in range(len(IDS))]
    return torch.cat(finals), aux


def check_shard(path, req: int, prompt: int) -> contract.Shard:
    shard = contract.read_shard(path)
    assert shard.num_tokens == prompt
    assert shard.input_ids.tolist() == list(range(100, 100 + prompt))
    assert shard.final_hidden[:, 0].eq(req).all() and shard.final_hidden[:, 2].eq(9).all()
    assert shard.final_hidden[:, 1].tolist() == list(range(prompt))
    for k in range(len(IDS)):  # aux = [layer 0 | layer 1 | layer 2], every row in prompt order
        block = shard.aux_hidden[:, k * H:(k + 1) * H]
        assert block[:, 0].eq(req).all() and block[:, 2].eq(IDS[k]).all()
        assert block[:, 1].tolist() == list(range(prompt))
    return shard


def read_receipt(tmp_path, rid):
    return json.loads(receipt_path(tmp_path / "receipts", rid).read_text())


def fake_req(rid, prompt, **kw):
    return SimpleNamespace(rid=rid, origin_input_ids=list(range(100, 100 + prompt)), output_ids=kw.get("out", []),
                           to_finish=kw.get("to_finish"), input_embeds=None, multimodal_inputs=None)


@dataclasses.dataclass
class FakeForwardBatch:
    forward_mode: str
    extend_prefix_lens_cpu: list
    extend_seq_lens_cpu: list
    rids: list


def forward(runtime, lp, runner, reqs, prefix, extend, parts, mode=EXTEND):
    """One scheduler step: ForwardBatch.init_new (hooked) then the model's logits processor call, which
    gets a dataclasses.replace copy of the ForwardBatch, as sglang's eager runner hands it over."""
    batch = SimpleNamespace(reqs=reqs, prefix_lens=prefix, extend_lens=extend)
    fb = FakeForwardBatch(mode, prefix, extend, [r.rid for r in reqs])
    plugin._after_init_new(fb, "cls", batch, runner)
    final, aux = flatten(parts)
    return lp(torch.zeros(final.shape[0]), final, "lm_head", dataclasses.replace(fb), aux)


def logits_processor(runtime):
    """A stand-in for sglang's LogitsProcessor, wrapped by the plugin like the target's."""

    class LogitsProcessor(torch.nn.Module):
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
            return hidden_states.shape[0]

    lp = LogitsProcessor()
    plugin.wrap_logits_processor(lp, runtime)
    return lp
