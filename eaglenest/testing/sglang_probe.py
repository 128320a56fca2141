"""Test instrument: record the aux hidden states SGLang's own EAGLE3 path feeds the draft model.

Enabled only by ``EAGLENEST_PROBE_DRAFT_DIR`` (GPU parity proofs, never in production). A BEFORE
hook on the EAGLE3 draft model's ``LlamaModel.forward`` saves, for every prefill (EXTEND) forward,
``forward_batch.spec_info.hidden_states`` (the target's aux concatenation, [rows, k*H]) split per
request into ``<probe dir>/shard_filename(f"{rid}@{prefix_len}")`` as safetensors (bf16; metadata
``rid`` and ``prefix_len``), so a test can compare them with the plugin's shards for the same tokens.
:func:`read_probe` joins a request's chunks in prompt order.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from eaglenest import contract
from eaglenest.atomic import atomic_write_bytes

log = logging.getLogger("eaglenest.sglang")
T_DRAFT_FORWARD = "sglang.srt.models.llama_eagle3.LlamaModel.forward"
_probe_dir: Path | None = None


def register(registry: Any, hook_type: Any, probe_dir: str) -> None:
    global _probe_dir
    _probe_dir = Path(probe_dir)
    _probe_dir.mkdir(parents=True, exist_ok=True)
    registry.register(T_DRAFT_FORWARD, _before_draft_forward, hook_type.BEFORE)


def probe_name(rid: str, prefix_len: int) -> str:
    return contract.shard_filename(f"{rid}@{prefix_len}")


def _before_draft_forward(model: Any, input_ids: Any, positions: Any, forward_batch: Any, *args: Any, **kw: Any):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    try:
        if _probe_dir is None or forward_batch.forward_mode != ForwardMode.EXTEND:
            return None
        hidden = getattr(forward_batch.spec_info, "hidden_states", None)
        if hidden is None or not forward_batch.rids:
            return None
        rows = hidden.detach().to(torch.bfloat16).cpu()  # [N, k*H]
        start = 0
        prefixes = forward_batch.extend_prefix_lens_cpu or [0] * len(forward_batch.rids)
        for rid, n, prefix in zip(forward_batch.rids, forward_batch.extend_seq_lens_cpu, prefixes, strict=True):
            data = st_save({"aux_hidden": rows[start:start + n].contiguous()},
                           metadata={"rid": str(rid), "prefix_len": str(int(prefix))})
            atomic_write_bytes(_probe_dir / probe_name(str(rid), int(prefix)), data)
            start += n
    except Exception:
        log.exception("eaglenest draft probe failed")
    return None


def read_probe(probe_dir: str | Path) -> dict[str, tuple[list[int], torch.Tensor]]:
    """{rid: (chunk prefix lengths, aux rows [T, k*H] joined in prompt order)} from a probe folder."""
    from safetensors import safe_open

    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for path in sorted(Path(probe_dir).glob("*" + contract.SHARD_SUFFIX)):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            parts.setdefault(meta["rid"], []).append((int(meta["prefix_len"]), f.get_tensor("aux_hidden")))
    return {rid: ([p for p, _ in sorted(chunks, key=lambda c: c[0])],
                  torch.cat([t for _, t in sorted(chunks, key=lambda c: c[0])]))
            for rid, chunks in parts.items()}
