"""In-process target model: batched capture prefill and KV-cached generation on the CPU (or a GPU).

Owns the numerics of the embedded engine:

- :meth:`TargetRunner.capture` prefills a batch of token sequences (right-padded, masked) and returns,
  per sequence, ``aux_hidden`` [T, k*H] (outputs of the aux decoder layers, taken by forward hooks)
  and ``final_hidden`` [T, H] (final-norm output). Right padding keeps every real token's causal
  context free of padding, so a sequence captures the same values alone or in a batch (up to the
  matmul blocking of the batch shape; fp32 agrees to ~1e-6). The LM head is skipped in capture-only
  prefill.
- :meth:`TargetRunner.generate` prefills one request (optionally capturing it) and decodes with a KV
  cache, greedily or by sampling.

Invariant: hidden states are cast to bf16 only at the very end (the shard dtype); nothing here does
I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglenest import contract
from eaglenest import models as model_lib


@dataclass(frozen=True, slots=True)
class Captured:
    aux_hidden: torch.Tensor  # [T, k*H] bf16
    final_hidden: torch.Tensor  # [T, H] bf16


@dataclass(frozen=True, slots=True)
class Generation:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    captured: Captured | None
    prefill_s: float
    decode_s: float
    spec_verify_ct: int = 0
    """Speculative decoding only: target verify forwards (0 = plain decoding)."""
    spec_correct_drafts: int = 0
    """Speculative decoding only: draft tokens the target accepted (bonus tokens not counted)."""
    spec_proposed_drafts: int = 0


class TargetRunner:
    """A transformers causal LM with aux-layer capture hooks."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        aux_layer_ids: Sequence[int] | None = None,
        attn_implementation: str = "sdpa",
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype_name = model_lib.auto_dtype(device) if dtype == "auto" else dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), dtype=getattr(torch, self.dtype_name), attn_implementation=attn_implementation
        ).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.attn_implementation = attn_implementation
        cfg = self.model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        ids = aux_layer_ids if aux_layer_ids is not None else contract.default_aux_layer_ids(self.num_layers)
        self.aux_layer_ids = contract.check_aux_layer_ids(ids, self.num_layers)
        self.base = self.model.get_decoder()
        layers = getattr(self.base, "layers", None)
        if layers is None or getattr(self.base, "norm", None) is None:
            raise contract.ContractError(
                f"{type(self.model).__name__}: capture needs a decoder with .layers and .norm"
            )
        self._grabbed: dict[int, torch.Tensor] = {}
        self._capturing = False
        self._lock = threading.Lock()
        for i in self.aux_layer_ids:
            layers[i].register_forward_hook(self._make_hook(i))
        eos = cfg.eos_token_id
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.stop_ids = {int(x) for x in ([eos] if isinstance(eos, int) else eos or [])}
        self.stop_ids |= {int(x) for x in ([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])}

    def _make_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if self._capturing:
                hidden = output[0] if isinstance(output, tuple) else output
                self._grabbed[layer_id] = hidden.detach()

        return hook

    def provenance(self, *, engine: str = "embedded", engine_version: str | None = None) -> contract.Provenance:
        from eaglenest import __version__

        fp = model_lib.model_fingerprint(self.model_dir)
        return contract.Provenance(
            engine=engine,
            engine_version=engine_version or __version__,
            model_path=str(self.model_dir),
            dtype=self.dtype_name,
            tp_size=1,
            attention_backend=self.attn_implementation,
            aux_layer_ids=self.aux_layer_ids,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            **fp,
        )

    def _split(self, lengths: Sequence[int], final: torch.Tensor) -> list[Captured]:
        aux = torch.cat([self._grabbed[i] for i in self.aux_layer_ids], dim=-1)  # [B, T, k*H]
        out = []
        for b, t in enumerate(lengths):
            out.append(
                Captured(
                    aux_hidden=aux[b, :t].to(torch.bfloat16).cpu().contiguous(),  # [T, k*H]
                    final_hidden=final[b, :t].to(torch.bfloat16).cpu().contiguous(),  # [T, H]
                )
            )
        return out

    @torch.inference_mode()
    def capture(self, sequences: Sequence[Sequence[int]], *, pad_token_id: int = 0) -> list[Captured]:
        """Prefill a batch (right-padded with ``pad_token_id``, masked) and return each sequence's states."""
        lengths = [len(s) for s in sequences]
        if not lengths or min(lengths) == 0:
            raise ValueError("capture needs non-empty token sequences")
        width = max(lengths)
        ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(sequences), width), dtype=torch.long)  # [B, T]
        for b, s in enumerate(sequences):
            ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[b, : len(s)] = 1
        with self._lock:
            self._capturing, self._grabbed = True, {}
            try:
                out = self.base(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
                )
                return self._split(lengths, out.last_hidden_state)  # last_hidden_state: [B, T, H]
            finally:
                self._capturing = False

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        ignore_eos: bool = False,
        capture: bool = False,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> Generation:
        """Prefill one request (capturing it if asked) and decode with a KV cache."""
        from transformers import DynamicCache

        stops = set() if ignore_eos else self.stop_ids | {int(x) for x in stop_token_ids}
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        ids = torch.as_tensor([list(input_ids)], dtype=torch.long, device=self.device)  # [1, T]
        with self._lock:
            t0 = time.perf_counter()
            cache = DynamicCache()
            self._capturing, self._grabbed = capture, {}
            try:
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                                 output_hidden_states=capture, logits_to_keep=1)
            finally:
                self._capturing = False
            captured = self._split([ids.shape[1]], out.hidden_states[-1])[0] if capture else None
            t1 = time.perf_counter()
            output: list[int] = []
            finish = "length"
            logits = out.logits[0, -1]  # [V]
            while len(output) < max_new_tokens:
                token = _sample(logits, temperature, top_p, gen)
                output.append(token)
                if token in stops:
                    finish = "stop"
                    break
                if len(output) == max_new_tokens:
                    break
                step = torch.tensor([[token]], device=self.device)
                out = self.model(input_ids=step, past_key_values=cache, use_cache=True)
                logits = out.logits[0, -1]
            return Generation(output, finish, captured, t1 - t0, time.perf_counter() - t1)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [V]
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
