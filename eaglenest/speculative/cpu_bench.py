"""Side-by-side CPU benchmark: EAGLE-3 speculation vs plain KV-cached greedy decoding, same process.

Owns the measurement protocol behind ``scripts/bench_spec_cpu.py`` and ``eaglenest bench cpu``:

- every prompt is decoded by both methods under every oneDNN policy, interleaved prompt by prompt
  (so load from other processes hits both alike), after one warm-up prompt per policy;
- tok/s = generated tokens / (prefill + decode) wall time; the speedup compares the BEST speculative
  policy with the BEST plain policy (FACTS.md: never against the default setting);
- losslessness: each speculative output is compared with the plain output under the same policy;
  fp32 must match exactly, bf16 may differ where a batched verify rounds differently (reported);
- acceptance: :class:`~eaglenest.speculative.decoder.AcceptStats` over all verify cycles (bonus counted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.engines.runtime import TargetRunner
from eaglenest.speculative.decoder import AcceptStats, OneDNN, SpecDecoder, plain_greedy


@dataclass(kw_only=True, slots=True)
class MethodTotals:
    method: str
    policy: str
    tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    cycles: int = 0
    """eagle3: verify forwards (plain: 0)."""

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "wall_s": self.wall_s, "tok_s": self.tok_s, "decode_tok_s": self.decode_tok_s}


@dataclass(kw_only=True)
class SideBySide:
    model: str
    draft: str
    dtype: str
    num_steps: int
    prompts: int
    max_new_tokens: int
    totals: list[MethodTotals]
    accept: AcceptStats
    mismatched_prompts: dict[str, int]
    """policy -> prompts whose speculative output differed from plain greedy under that policy."""
    notes: list[str] = field(default_factory=list)

    def best(self, method: str) -> MethodTotals:
        return max((t for t in self.totals if t.method == method), key=lambda t: t.tok_s)

    @property
    def speedup(self) -> float:
        base = self.best("plain").tok_s
        return self.best("eagle3").tok_s / base if base else 0.0

    @property
    def break_even_accept_length(self) -> float:
        """Accept length at which speculation would match plain decoding: the measured cost of one
        cycle (k draft steps + one verify, best speculative policy) in plain decode steps (best plain)."""
        s, p = self.best("eagle3"), self.best("plain")
        if not s.cycles or not p.decode_s:
            return float("nan")
        steps = p.tokens - self.prompts  # plain decoding makes n - 1 decode steps for n tokens (prefill gives 1)
        return (s.decode_s / s.cycles) / (p.decode_s / steps) if steps > 0 else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "draft": self.draft, "dtype": self.dtype, "num_steps": self.num_steps,
                "prompts": self.prompts, "max_new_tokens": self.max_new_tokens,
                "totals": [t.to_json() for t in self.totals], "accept": asdict(self.accept),
                "mismatched_prompts": self.mismatched_prompts, "best_plain": self.best("plain").policy,
                "best_eagle3": self.best("eagle3").policy, "speedup": self.speedup,
                "break_even_accept_length": self.break_even_accept_length, "notes": self.notes}

    def lines(self) -> list[str]:
        out = [f"target {self.model} ({self.dtype}), drafter {self.draft}, k={self.num_steps} draft steps "
               f"(SGLang num_draft_tokens {self.num_steps + 1}), {self.prompts} prompts x {self.max_new_tokens} "
               "new tokens, greedy"]
        for t in sorted(self.totals, key=lambda t: (t.method, -t.tok_s)):
            extra = f"  draft {t.draft_s:.2f}s verify {t.verify_s:.2f}s" if t.method == "eagle3" else ""
            out.append(f"  {t.method:6s} {t.policy:14s} {t.tok_s:7.2f} tok/s  (decode {t.decode_tok_s:7.2f} tok/s, "
                       f"{t.tokens} tokens, prefill {t.prefill_s:.2f}s decode {t.decode_s:.2f}s){extra}")
        a = self.accept
        out.append(f"accept length {a.accept_length:.3f} (bonus token counted) over {a.cycles} verify cycles; "
                   f"per-position acceptance {[round(x, 3) for x in a.acceptance_at]}, conditional "
                   f"{[round(x, 3) for x in a.conditional_at]}, histogram {list(a.histogram)}")
        out.append(f"speedup (best eagle3 {self.best('eagle3').policy} / best plain {self.best('plain').policy}): "
                   f"{self.speedup:.3f}x; one speculation cycle costs {self.break_even_accept_length:.2f} plain "
                   "decode steps (= the break-even accept length)")
        out.append(f"outputs differing from plain greedy (per policy): {self.mismatched_prompts}")
        out += self.notes
        return out


def side_by_side(
    runner: TargetRunner, make_decoder: Callable[[OneDNN], SpecDecoder], prompts: Sequence[list[int]], *,
    max_new_tokens: int, policies: dict[str, OneDNN] | None = None, ignore_eos: bool = False,
    model_name: str = "", draft_name: str = "", progress: Callable[[str], None] | None = None,
) -> SideBySide:
    """Decode every prompt with plain greedy and with EAGLE-3 under each oneDNN policy, interleaved."""
    policies = policies or OneDNN.candidates()
    decoders = {name: make_decoder(p) for name, p in policies.items()}
    totals = {(m, name): MethodTotals(method=m, policy=name) for name in policies for m in ("plain", "eagle3")}
    mismatched = dict.fromkeys(policies, 0)
    accepted: list[int] = []
    drafted: list[int] = []
    num_steps = next(iter(decoders.values())).num_steps
    for name, pol in policies.items():  # warm-up (first calls allocate and pick kernels)
        plain_greedy(runner, prompts[0], max_new_tokens=min(8, max_new_tokens), onednn=pol)
        decoders[name].generate(prompts[0], max_new_tokens=min(8, max_new_tokens))
    for i, ids in enumerate(prompts):
        for name, pol in policies.items():
            p = plain_greedy(runner, ids, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, onednn=pol)
            s = decoders[name].generate(ids, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
            tp, ts = totals["plain", name], totals["eagle3", name]
            tp.tokens += len(p.output_ids)
            tp.prefill_s += p.prefill_s
            tp.decode_s += p.decode_s
            ts.tokens += len(s.output_ids)
            ts.prefill_s += s.prefill_s
            ts.decode_s += s.decode_s
            ts.draft_s += s.draft_s
            ts.verify_s += s.verify_s
            ts.cycles += s.verify_ct
            mismatched[name] += p.output_ids != s.output_ids
            accepted += s.accepted
            drafted += s.drafted
        if progress:
            progress(f"prompt {i + 1}/{len(prompts)} done")
    return SideBySide(model=model_name or str(runner.model_dir), draft=draft_name, dtype=runner.dtype_name,
                      num_steps=num_steps, prompts=len(prompts), max_new_tokens=max_new_tokens,
                      totals=list(totals.values()), accept=AcceptStats.from_cycles(accepted, drafted, num_steps),
                      mismatched_prompts=mismatched)


def run_cpu_bench(
    *, model: str = "default", draft: str, prompt_set: str = "mt-bench", num_prompts: int = 8,
    max_new_tokens: int = 64, num_steps: int = 3, dtype: str = "auto", policies: Sequence[str] | None = None,
    prompt_ids: Sequence[list[int]] | None = None, progress: Callable[[str], None] | None = None,
) -> SideBySide:
    """Load target + drafter (``draft='random'``: an untrained one, smoke test only) and run :func:`side_by_side`."""
    import tempfile

    from eaglenest.models import resolve_model
    from eaglenest.speculative import prompts as P
    from eaglenest.speculative.draft import draft_aux_layer_ids, write_random_draft
    from eaglenest.speculative.serve import load_spec_decoder

    model_dir = resolve_model(model)
    notes = []
    if draft == "random":
        draft = str(write_random_draft(model_dir, Path(tempfile.mkdtemp(prefix="random-draft-")),
                                       draft_vocab=16384))
        notes.append("drafter: UNTRAINED random weights (smoke test; accept length ~1 expected)")
    runner = TargetRunner(model_dir, dtype=dtype, aux_layer_ids=draft_aux_layer_ids(draft))
    if prompt_ids is None:
        ps = P.load_prompt_set(prompt_set, limit=num_prompts)
        prompt_ids = P.tokenize(ps, runner.tokenizer)
        notes.append(f"prompts: {ps.name} ({ps.source})")
    all_policies = OneDNN.candidates()
    chosen = {p: all_policies[p] for p in (policies or all_policies)}
    result = side_by_side(runner, lambda pol: load_spec_decoder(runner, draft, num_steps=num_steps, onednn=pol),
                          list(prompt_ids), max_new_tokens=max_new_tokens, policies=chosen,
                          model_name=str(model_dir), draft_name=str(draft), progress=progress)
    result.notes += notes
    return result


def live_accept_on_samples(decoder: SpecDecoder, samples: Sequence[Any], *, max_new_tokens: int = 64) -> AcceptStats:
    """Live accept length of ``decoder`` on the prompts of store samples (tokens before the first loss
    token): the number :func:`eaglenest.speculative.offline.offline_accept_length` predicts for the same samples."""
    accepted: list[int] = []
    drafted: list[int] = []
    for s in samples:
        mask = s.loss_mask.bool()
        start = int(mask.nonzero()[0]) if bool(mask.any()) else int(mask.numel())
        if start == 0:
            continue
        out = decoder.generate(s.input_ids[:start].tolist(), max_new_tokens=max_new_tokens)
        accepted += out.accepted
        drafted += out.drafted
    return AcceptStats.from_cycles(accepted, drafted, decoder.num_steps)
