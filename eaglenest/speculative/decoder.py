"""Embedded EAGLE-3 chain speculation on a transformers target (CPU), lossless under greedy decoding.

Owns the decode loop (batch 1) and its bookkeeping. One cycle, as SGLang's EAGLE worker does it with
``--speculative-eagle-topk 1``:

1. the proposer drafts ``k`` tokens after the current root token (``k = num_steps``; SGLang's
   ``--speculative-num-draft-tokens`` is ``k + 1`` because it counts the root),
2. ONE target forward over ``[root, d1..dk]`` (KV cache: ``transformers.DynamicCache``) gives the
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
verify/draft) whether oneDNN runs, with the target's and drafter's weights prepacked for it; plain and
speculative decoding run the same prepared target (:func:`~eaglenest.speculative.fastpath.prepare_target`:
fused projections, grouped-query attention without K/V copies).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.engines.runtime import TargetRunner
from eaglenest.speculative.fastpath import prepare_target
from eaglenest.speculative.onednn import OneDNN, phase
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
    stop_token_ids: Sequence[int] = (), onednn: OneDNN = OneDNN(),
) -> PlainGeneration:
    """Target-only greedy decoding with a KV cache (the baseline every speedup is measured against)."""
    from transformers import DynamicCache

    stops = _stops(runner, ignore_eos, stop_token_ids)
    model, dev = runner.model, runner.device
    prepare_target(model)
    t0 = time.perf_counter()
    cache = DynamicCache()
    output: list[int] = []
    if max_new_tokens <= 0:
        return PlainGeneration(output_ids=output, finish_reason="length", prefill_s=0.0, decode_s=0.0)
    with phase(onednn.prefill):
        out = model(input_ids=torch.tensor([list(input_ids)], device=dev), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
    t1 = time.perf_counter()
    token, finish = int(torch.argmax(out.logits[0, -1])), "length"
    with phase(onednn.decode):
        while True:
            output.append(token)
            if token in stops:
                finish = "stop"
                break
            if len(output) >= max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]], device=dev), past_key_values=cache, use_cache=True)
            token = int(torch.argmax(out.logits[0, -1]))
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

    @property
    def num_steps(self) -> int:
        """Draft depth: the most draft tokens one cycle can accept."""
        return self.shape.depth

    @classmethod
    def eagle3(cls, runner: TargetRunner, draft: Eagle3Drafter, *, shape: SpecShape = SpecShape(),
               onednn: OneDNN = OneDNN()) -> SpecDecoder:
        if tuple(runner.aux_layer_ids) != draft.config.aux_layer_ids:
            from eaglenest.speculative.draft import DraftLoadError

            raise DraftLoadError(f"drafter reads aux layers {list(draft.config.aux_layer_ids)}, target captures "
                                 f"{list(runner.aux_layer_ids)}")
        from eaglenest.speculative.drafting import Eagle3Proposer, FastDrafter

        prepare_target(runner.model)
        fast = FastDrafter(draft)
        return cls(runner, lambda: Eagle3Proposer(fast, shape, onednn), shape, onednn)

    def _aux(self, hidden_states: tuple[torch.Tensor, ...], rows: list[int] | None = None) -> torch.Tensor:
        """[N, k*H] aux states of the target's verify ``rows`` (all rows when None)."""
        parts = [hidden_states[i + 1][0] for i in self.runner.aux_layer_ids]
        if rows is not None:
            index = slice(0, len(rows)) if rows == list(range(len(rows))) else torch.tensor(rows)
            parts = [p[index] for p in parts]
        return torch.cat(parts, dim=-1)

    @torch.inference_mode()
    def generate(
        self, input_ids: Sequence[int], *, max_new_tokens: int, ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> SpecGeneration:
        from transformers import DynamicCache

        stops = _stops(self.runner, ignore_eos, stop_token_ids)
        model, dev, ctx = self.runner.model, self.runner.device, self.runner.context_length
        prepare_target(model)
        prompt = list(input_ids)
        t0 = time.perf_counter()
        output: list[int] = []
        accepted: list[int] = []
        drafted: list[int] = []
        draft_s = verify_s = 0.0
        if max_new_tokens <= 0:
            return SpecGeneration(output_ids=output, finish_reason="length", accepted=(), drafted=(), prefill_s=0.0,
                                  decode_s=0.0, draft_s=0.0, verify_s=0.0)
        cache = DynamicCache()
        with phase(self.onednn.prefill):  # the target's prompt and the drafter's extend over it
            out = model(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True,
                        output_hidden_states=True, logits_to_keep=1)
            root = int(torch.argmax(out.logits[0, -1]))
            proposer = self.make_proposer()
            proposer.begin(prompt, self._aux(out.hidden_states), root)
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
                out = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                            use_cache=True, output_hidden_states=True)
            path, bonus = accept(tree, out.logits[0].argmax(dim=-1).tolist())
            a = len(path)
            rows = [0, *(i + 1 for i in path)]  # verify rows of the root and the accepted nodes
            _keep_rows(cache, n, rows)
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
            proposer.advance(new, self._aux(out.hidden_states, rows))
            draft_s += time.perf_counter() - t
            root, n = new[-1], n + a + 1
        return SpecGeneration(output_ids=output, finish_reason=finish, accepted=tuple(accepted), drafted=tuple(drafted),
                              prefill_s=prefill_s, decode_s=time.perf_counter() - t_dec, draft_s=draft_s,
                              verify_s=verify_s)


def _keep_rows(cache, past: int, rows: list[int]) -> None:
    """Keep the target's keys/values of the cached prefix and of the verify ``rows`` (in order), drop
    the rest: a chain's accepted rows are a prefix (a crop); a tree path is gathered first."""
    total = cache.get_seq_length()
    if rows != list(range(len(rows))):
        src = torch.tensor([past + r for r in rows], device=cache.layers[0].keys.device)
        for layer in cache.layers:
            layer.keys[:, :, past: past + len(rows)] = layer.keys[:, :, src]
            layer.values[:, :, past: past + len(rows)] = layer.values[:, :, src]
    drop = total - past - len(rows)
    if drop > 0:
        cache.crop(-drop)  # a negative crop removes that many tokens on every transformers 5.x


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
