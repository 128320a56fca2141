"""Embedded EAGLE-3 chain speculation on a transformers target (CPU), lossless under greedy decoding.

Owns the decode loop (batch 1) and its bookkeeping. One cycle, as SGLang's EAGLE worker does it with
``--speculative-eagle-topk 1``:

1. the proposer drafts up to ``k`` tokens after the current root token (``k = num_steps``; fewer where a
   confidence-stopped chain stops; SGLang's ``--speculative-num-draft-tokens`` is ``k + 1`` because it
   counts the root),
2. ONE target forward over ``[root, d1..dk]`` (on the KV cache of the decode-time target) gives the
   target's greedy token after each of them,
3. the longest prefix of drafts equal to the target's tokens is accepted (``a`` of ``k``), plus the
   target's own next token (the bonus): ``a + 1`` new tokens per target forward,
4. the target cache is cropped to the accepted tokens, and the proposer is advanced with the
   accepted tokens and the target's aux hidden states at ``[root, d1..da]``.

Invariant: the emitted tokens are, by construction, the target's greedy choices; with fp32 numerics
the output equals plain KV-cached greedy decoding token for token (in bf16 a batched verify forward
may round differently from a 1-token forward, see FACTS.md). ``accept length`` everywhere in
eaglenest counts the bonus token (``a + 1``), as SGLang's ``spec_accept_length`` does.

oneDNN: :class:`~eaglenest.speculative.onednn.OneDNN` chooses per phase (prefill, 1-row steps, multi-row
verify/draft) whether oneDNN runs, with the target's and drafter's weights prepacked for it (bf16 forwards
of at most 16 rows run the skinny kernel of :mod:`~eaglenest.speculative.kernels` instead); plain and
speculative decoding run the same decode-time target (:func:`~eaglenest.speculative.target.decode_target`:
a lean Llama forward with a preallocated KV cache, or transformers' prepared forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.engines.runtime import TargetRunner
from eaglenest.speculative.kernels import amx, row_argmax
from eaglenest.speculative.onednn import OneDNN, phase
from eaglenest.speculative.target import HFTarget, LeanTarget, decode_target
from eaglenest.speculative.tree import DraftTree, SpecShape, accept, verify_inputs


class Proposer(Protocol):
    """Per-request drafting state (one object per generation)."""

    def begin(self, prompt_ids: Sequence[int], aux_hidden: torch.Tensor, root: int) -> None:
        """After the target prefill: prompt ids [T], aux_hidden [T, k*H], the target's first token."""

    def propose(self, max_depth: int) -> DraftTree:
        """Draft tokens following the current root, no path longer than ``max_depth``."""

    def advance(self, tokens: Sequence[int], aux_hidden: torch.Tensor) -> None:
        """Accepted drafts + bonus (a + 1 tokens; the last is the new root) and aux [a+1, k*H] of
        the tokens verified before them (old root, d1..da)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecGeneration:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    accepted: tuple[int, ...]
    """Per verify forward: how many draft tokens were accepted (0..drafted)."""
    drafted: tuple[int, ...]
    """Per verify forward: how many draft tokens were proposed (k, fewer near the token budget)."""
    prefill_s: float
    decode_s: float
    draft_s: float
    verify_s: float

    @property
    def verify_ct(self) -> int:
        return len(self.accepted)

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify forward, bonus token counted (1.0 = no draft token ever accepted)."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PlainGeneration:
    output_ids: list[int]
    finish_reason: str
    prefill_s: float
    decode_s: float


def _stops(runner: TargetRunner, ignore_eos: bool, stop_token_ids: Sequence[int]) -> set[int]:
    return set() if ignore_eos else runner.stop_ids | {int(x) for x in stop_token_ids}


@torch.inference_mode()
def plain_greedy(
    runner: TargetRunner, input_ids: Sequence[int], *, max_new_tokens: int, ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (), onednn: OneDNN = OneDNN(), lean: bool = True,
) -> PlainGeneration:
    """Target-only greedy decoding with a KV cache (the baseline every speedup is measured against),
    on the same decode-time target as speculation (:func:`~eaglenest.speculative.target.decode_target`)."""
    stops = _stops(runner, ignore_eos, stop_token_ids)
    dev = runner.device
    target = decode_target(runner.model, runner.aux_layer_ids, lean=lean)
    t0 = time.perf_counter()
    output: list[int] = []
    if max_new_tokens <= 0:
        return PlainGeneration(output_ids=output, finish_reason="length", prefill_s=0.0, decode_s=0.0)
    cache = target.new_cache(len(input_ids) + max_new_tokens)
    with phase(onednn.prefill):
        logits, _ = target.forward(cache, torch.tensor([list(input_ids)], device=dev), last_only=True)
    t1 = time.perf_counter()
    token, finish = int(row_argmax(logits[-1:])[0]), "length"
    with phase(onednn.decode):
        while True:
            output.append(token)
            if token in stops:
                finish = "stop"
                break
            if len(output) >= max_new_tokens:
                break
            logits, _ = target.forward(cache, torch.tensor([[token]], device=dev))
            token = int(row_argmax(logits[-1:])[0])
    return PlainGeneration(output_ids=output, finish_reason=finish, prefill_s=t1 - t0,
                           decode_s=time.perf_counter() - t1)


@dataclass
class SpecDecoder:
    """Greedy speculation (chain or tree, ``shape``) over ``runner``'s model with proposers made by
    ``make_proposer``.

    Not thread-safe: one generation at a time per runner (the embedded engine's scheduler thread).
    """

    runner: TargetRunner
    make_proposer: Callable[[], Proposer]
    shape: SpecShape = field(default_factory=SpecShape)
    onednn: OneDNN = field(default_factory=OneDNN)
    lean: bool = True
    """Run a Llama-style target as :class:`~eaglenest.speculative.target.LeanTarget` (else transformers')."""

    @property
    def num_steps(self) -> int:
        """Draft depth: the most draft tokens one cycle can accept."""
        return self.shape.depth

    @classmethod
    def eagle3(cls, runner: TargetRunner, draft: Eagle3Drafter, *, shape: SpecShape = SpecShape(),
               onednn: OneDNN = OneDNN(), lean: bool = True) -> SpecDecoder:
        if tuple(runner.aux_layer_ids) != draft.config.aux_layer_ids:
            from eaglenest.speculative.draft import DraftLoadError

            raise DraftLoadError(f"drafter reads aux layers {list(draft.config.aux_layer_ids)}, target captures "
                                 f"{list(runner.aux_layer_ids)}")
        from eaglenest.speculative.drafting import Eagle3Proposer, FastDrafter

        decode_target(runner.model, runner.aux_layer_ids, lean=lean)
        fast = FastDrafter(draft, quant=shape.quant)
        return cls(runner, lambda: Eagle3Proposer(fast, shape, onednn), shape, onednn, lean)

    @torch.inference_mode()
    def generate(
        self, input_ids: Sequence[int], *, max_new_tokens: int, ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> SpecGeneration:
        stops = _stops(self.runner, ignore_eos, stop_token_ids)
        target = decode_target(self.runner.model, self.runner.aux_layer_ids, lean=self.lean)
        prompt = list(input_ids)
        t0 = time.perf_counter()
        if max_new_tokens <= 0:
            return SpecGeneration(output_ids=[], finish_reason="length", accepted=(), drafted=(), prefill_s=0.0,
                                  decode_s=0.0, draft_s=0.0, verify_s=0.0)
        cache = target.new_cache(len(prompt) + max_new_tokens + self.shape.nodes + 1)
        with amx():  # where the CPU has it: a verify's rows cost what one row does (kernels.amx)
            return self._generate(target, cache, prompt, stops, max_new_tokens, t0)

    def _generate(self, target: LeanTarget | HFTarget, cache: Any, prompt: list[int], stops: set[int],
                  max_new_tokens: int, t0: float) -> SpecGeneration:
        dev, ctx = self.runner.device, self.runner.context_length
        output: list[int] = []
        accepted: list[int] = []
        drafted: list[int] = []
        draft_s = verify_s = 0.0
        with phase(self.onednn.prefill):  # the target's prompt and the drafter's extend over it
            logits, aux = target.forward(cache, torch.tensor([prompt], device=dev), aux=True, last_only=True)
            root = int(row_argmax(logits[-1:])[0])
            proposer = self.make_proposer()
            proposer.begin(prompt, aux, root)
        prefill_s = time.perf_counter() - t0
        t_dec = time.perf_counter()
        output.append(root)
        finish = "stop" if root in stops else "length"
        n = len(prompt)  # the root's position = tokens in the target cache
        while finish != "stop" and len(output) < max_new_tokens:
            k = min(self.shape.depth, max_new_tokens - len(output) - 1, (ctx - n - 1) if ctx else self.shape.depth)
            t = time.perf_counter()
            tree = proposer.propose(k) if k > 0 else DraftTree([], [])  # the proposer picks its oneDNN phases
            draft_s += time.perf_counter() - t
            t = time.perf_counter()
            ids, pos, mask = verify_inputs(root, tree, n, device=dev)
            with phase(self.onednn.rows(len(tree) + 1)):
                logits, aux = target.forward(cache, ids, pos=pos, mask=mask, aux=True)
            path, bonus = accept(tree, row_argmax(logits).tolist())
            a = len(path)
            rows = [0, *(i + 1 for i in path)]  # verify rows of the root and the accepted nodes
            target.keep_rows(cache, n, rows)
            verify_s += time.perf_counter() - t
            new = [*(tree.tokens[i] for i in path), bonus]
            accepted.append(a)
            drafted.append(max(tree.depths(), default=0))
            for tok in new:
                output.append(tok)
                if tok in stops:
                    finish = "stop"
                    break
                if len(output) >= max_new_tokens:
                    break
            if finish == "stop" or len(output) >= max_new_tokens:
                break
            t = time.perf_counter()
            proposer.advance(new, aux[: len(rows)] if rows == list(range(len(rows))) else aux[rows])
            draft_s += time.perf_counter() - t
            root, n = new[-1], n + a + 1
        return SpecGeneration(output_ids=output, finish_reason=finish, accepted=tuple(accepted), drafted=tuple(drafted),
                              prefill_s=prefill_s, decode_s=time.perf_counter() - t_dec, draft_s=draft_s,
                              verify_s=verify_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class AcceptStats:
    """Acceptance over many verify cycles; accept length counts the bonus token."""

    cycles: int
    accept_length: float
    acceptance_at: tuple[float, ...]
    """acceptance_at[i]: share of cycles that drafted position i+1 and accepted it (P(a >= i+1))."""
    conditional_at: tuple[float, ...]
    """conditional_at[i]: P(position i+1 accepted | positions 1..i accepted and i+1 drafted)."""
    histogram: tuple[int, ...]
    """histogram[a]: cycles that accepted exactly a draft tokens."""

    @classmethod
    def from_cycles(cls, accepted: Sequence[int], drafted: Sequence[int], num_steps: int) -> AcceptStats:
        n = len(accepted)
        hist = [0] * (num_steps + 1)
        for a in accepted:
            hist[a] += 1
        at, cond = [], []
        for i in range(1, num_steps + 1):
            offered = [a for a, d in zip(accepted, drafted, strict=True) if d >= i]
            reached = [a for a in offered if a >= i - 1]
            at.append(sum(a >= i for a in offered) / len(offered) if offered else 0.0)
            cond.append(sum(a >= i for a in reached) / len(reached) if reached else 0.0)
        return cls(cycles=n, accept_length=(sum(accepted) + n) / n if n else 0.0, acceptance_at=tuple(at),
                   conditional_at=tuple(cond), histogram=tuple(hist))
