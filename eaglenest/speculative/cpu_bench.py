"""Side-by-side CPU benchmark: EAGLE-3 speculation vs plain KV-cached greedy decoding, same process.

Owns the measurement protocol behind ``scripts/bench_spec_cpu.py`` and ``eaglenest bench cpu``:

- every prompt is decoded by plain greedy under each plain oneDNN policy (where the skinny kernel can run bf16
  weights on AMX, as speculation does, also there: the policy's name + ``/amx``) and by every speculative
  variant (oneDNN policy x speculation shape), one after another per prompt, the order reversed every
  other prompt and round (load from other processes hits all alike), after one warm-up prompt each;
- tok/s = generated tokens / (prefill + decode) wall time; the speedup compares the BEST speculative
  variant with the BEST plain policy (FACTS.md: never against the default setting);
- cycle cost: one speculation cycle's decode time in plain decode steps of the best plain policy,
  split into drafting, the verify forward and the rest (bookkeeping) -- the break-even accept length;
- losslessness: each speculative output is compared with the best plain policy's output for the
  same prompt; fp32 must match exactly, bf16 may differ where a batched verify rounds differently or where
  the best plain run took the other path of the skinny kernel (AVX512 against speculation's AMX);
- acceptance: :class:`~eaglenest.speculative.decoder.AcceptStats` per variant (bonus token counted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.engines.runtime import TargetRunner
from eaglenest.speculative.decoder import AcceptStats, SpecDecoder, plain_greedy
from eaglenest.speculative.kernels import amx, amx_available, cpu_flags, cpu_model
from eaglenest.speculative.onednn import OneDNN
from eaglenest.speculative.tree import SpecShape

PLAIN_POLICIES = ("onednn", "prefill-only")
"""For plain greedy decoding ``prefill+verify`` is ``prefill-only`` and ``no-onednn`` prefills ~7x
slower (FACTS.md); so these two are the candidates for the best plain setting."""
SPEC_POLICIES = ("prefill+verify",)
"""1-row forwards (chain draft steps, 1-token extends) without oneDNN, multi-row ones with prepacked
oneDNN: on a 2-core Xeon (bf16, random drafter, chain3) a cycle cost 1.51 plain steps so, 1.61 with
oneDNN everywhere and 2.88 with oneDNN for the prompt only (the 4-token verify alone 2.5 steps)."""


@dataclass(kw_only=True, slots=True)
class MethodTotals:
    method: str  # "plain" | "eagle3"
    policy: str
    shape: str = ""
    tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    cycles: int = 0
    """eagle3: verify forwards; plain: decode steps (tokens - 1 per prompt: the prefill gives the first)."""
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.method} {self.policy}" + (f" {self.shape}" if self.shape else "")

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def ms_per_cycle(self) -> float:
        return 1e3 * self.decode_s / self.cycles if self.cycles else float("nan")

    def accept(self) -> AcceptStats:
        return AcceptStats.from_cycles(self.accepted, self.drafted, max(self.drafted, default=0))

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("method", "policy", "shape", "tokens", "prefill_s", "decode_s",
                                             "draft_s", "verify_s", "cycles", "wall_s", "tok_s", "decode_tok_s",
                                             "ms_per_cycle")}
        if self.method == "eagle3":
            out["accept_length"] = self.accept().accept_length
        return out


@dataclass(kw_only=True)
class SideBySide:
    model: str
    draft: str
    dtype: str
    prompts: int
    rounds: int
    max_new_tokens: int
    totals: list[MethodTotals]
    notes: list[str] = field(default_factory=list)

    def best(self, method: str) -> MethodTotals:
        return max((t for t in self.totals if t.method == method), key=lambda t: t.tok_s)

    @property
    def speedup(self) -> float:
        base = self.best("plain").tok_s
        return self.best("eagle3").tok_s / base if base else 0.0

    @property
    def plain_step_ms(self) -> float:
        return self.best("plain").ms_per_cycle

    def cycle_cost(self, t: MethodTotals) -> dict[str, float]:
        """One cycle of ``t`` in plain decode steps (best plain): total = the break-even accept length."""
        step = self.plain_step_ms
        if not t.cycles or step != step:  # nan: no plain steps
            return dict.fromkeys(("total", "draft", "verify", "other", "draft_forward"), float("nan"))
        ms = {"draft": 1e3 * t.draft_s / t.cycles, "verify": 1e3 * t.verify_s / t.cycles}
        ms["other"] = t.ms_per_cycle - ms["draft"] - ms["verify"]
        # a cycle that drafted depth d ran d draft forwards: d - 1 while drafting, 1 extending the accepted tokens
        forwards = sum(t.drafted) / len(t.drafted) if t.drafted else float("nan")
        return {"total": t.ms_per_cycle / step, **{k: v / step for k, v in ms.items()},
                "draft_forward": ms["draft"] / forwards / step if forwards else float("nan")}

    def mismatch_rates(self, t: MethodTotals) -> dict[str, float]:
        """Share of prompts whose output differs from each plain variant's (keyed by its policy)."""
        return {p.policy: sum(a != b for a, b in zip(t.outputs, p.outputs, strict=True)) / len(p.outputs)
                if p.outputs else 0.0 for p in self.totals if p.method == "plain"}

    def closest_plain(self, t: MethodTotals) -> str:
        """The plain variant whose outputs ``t`` matches best: the one on the same kernels. Plain variants differ
        among themselves in bf16 (AMX and AVX-512 round differently, and greedy decoding drifts from the first
        differing argmax), so a lossless decoder is judged against the plain greedy of its own numerics; the
        fastest plain may not be that one."""
        rates, fastest = self.mismatch_rates(t), self.best("plain").policy
        return min(rates, key=lambda k: (rates[k], k != fastest))

    def mismatch_rate(self, t: MethodTotals) -> float:
        """Share of prompts whose output differs from the closest plain variant's (:meth:`closest_plain`)."""
        return min(self.mismatch_rates(t).values(), default=0.0)

    def to_json(self) -> dict[str, Any]:
        variants = [{**t.to_json(), "cycle_cost_plain_steps": self.cycle_cost(t),
                     "mismatch_rate": self.mismatch_rate(t), "mismatch_by_plain": self.mismatch_rates(t),
                     "accept": _accept_json(t.accept())}
                    if t.method == "eagle3" else t.to_json() for t in self.totals]
        best = self.best("eagle3")
        return {"model": self.model, "draft": self.draft, "dtype": self.dtype, "prompts": self.prompts,
                "rounds": self.rounds, "max_new_tokens": self.max_new_tokens, "variants": variants,
                "best_plain": self.best("plain").policy, "best_eagle3": {"policy": best.policy, "shape": best.shape},
                "speedup": self.speedup, "accept_length": best.accept().accept_length,
                "cycle_cost_plain_steps": self.cycle_cost(best)["total"], "mismatch_rate": self.mismatch_rate(best),
                "mismatch_against": self.closest_plain(best),
                "plain_step_ms": self.plain_step_ms, "notes": self.notes}

    def lines(self) -> list[str]:
        out = [f"target {self.model} ({self.dtype}), drafter {self.draft}, {self.prompts} prompts x "
               f"{self.max_new_tokens} new tokens x {self.rounds} round(s), greedy"]
        for t in sorted(self.totals, key=lambda t: (t.method != "plain", -t.tok_s)):
            line = (f"  {t.label:34s} {t.tok_s:7.2f} tok/s (decode {t.decode_tok_s:7.2f}, prefill {t.prefill_s:6.2f}s, "
                    f"{t.ms_per_cycle:6.2f} ms/{'cycle' if t.method == 'eagle3' else 'step'})")
            if t.method == "eagle3":
                c, a = self.cycle_cost(t), t.accept()
                line += (f" accept {a.accept_length:.3f}  cycle {c['total']:.2f} steps (draft {c['draft']:.2f} = "
                         f"{c['draft_forward']:.3f}/forward, verify {c['verify']:.2f}, other {c['other']:.2f})  "
                         f"mismatch {self.mismatch_rate(t):.1%} (plain {self.closest_plain(t)})")
            out.append(line)
        best = self.best("eagle3")
        out.append(f"SPEEDUP {self.speedup:.3f}x: EAGLE3 {best.label} {best.tok_s:.2f} tok/s / best plain "
                   f"{self.best('plain').label} {self.best('plain').tok_s:.2f} tok/s; accept length "
                   f"{best.accept().accept_length:.3f} (bonus counted); one cycle = "
                   f"{self.cycle_cost(best)['total']:.2f} plain steps (the break-even accept length); "
                   f"outputs differing from plain greedy on its kernels ({self.closest_plain(best)}) "
                   f"{self.mismatch_rate(best):.1%} of prompts")
        return out + self.notes


def _accept_json(a: AcceptStats) -> dict[str, Any]:
    return {"cycles": a.cycles, "accept_length": a.accept_length, "acceptance_at": list(a.acceptance_at),
            "conditional_at": list(a.conditional_at), "histogram": list(a.histogram)}


AMX = "/amx"
"""Suffix of a plain policy run with the skinny kernel on AMX (:func:`~eaglenest.speculative.kernels.amx`), as the
speculative decoder's forwards run."""


def _on_amx(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    with amx():
        return fn(*args, **kw)


def side_by_side(
    runner: TargetRunner, make_decoder: Callable[[OneDNN, SpecShape], SpecDecoder], prompts: Sequence[list[int]], *,
    max_new_tokens: int, shapes: Sequence[SpecShape], plain_policies: Sequence[str] = PLAIN_POLICIES,
    spec_policies: Sequence[str] = SPEC_POLICIES, rounds: int = 1, ignore_eos: bool = False, model_name: str = "",
    draft_name: str = "", progress: Callable[[str], None] | None = None,
) -> SideBySide:
    """Decode every prompt with plain greedy (each policy) and each EAGLE-3 variant, interleaved."""
    pols = OneDNN.candidates()
    unknown = sorted((set(plain_policies) | set(spec_policies)) - set(pols))
    if unknown or not plain_policies or not spec_policies or not shapes or not prompts or rounds < 1:
        raise ValueError(f"side_by_side needs prompts, shapes, rounds >= 1 and known policies (unknown: {unknown}; "
                         f"choose from {sorted(pols)})")
    runs: list[tuple[MethodTotals, Callable[[list[int], int], Any]]] = []
    for p in plain_policies:
        runs.append((MethodTotals(method="plain", policy=p), lambda ids, n, pol=pols[p]: plain_greedy(
            runner, ids, max_new_tokens=n, ignore_eos=ignore_eos, onednn=pol)))
        if amx_available():  # plain greedy on either path of the skinny kernel, whichever is faster is the baseline
            runs.append((MethodTotals(method="plain", policy=f"{p}{AMX}"), lambda ids, n, pol=pols[p]: _on_amx(
                plain_greedy, runner, ids, max_new_tokens=n, ignore_eos=ignore_eos, onednn=pol)))
    for p in spec_policies:
        for shape in shapes:
            dec = make_decoder(pols[p], shape)
            runs.append((MethodTotals(method="eagle3", policy=p, shape=shape.name),
                         lambda ids, n, dec=dec: dec.generate(ids, max_new_tokens=n, ignore_eos=ignore_eos)))
    for _, run in runs:  # warm-up (first calls allocate and pick kernels)
        run(prompts[0], min(16, max_new_tokens))
    order = 0
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            seq = runs if order % 2 == 0 else runs[::-1]
            order += 1
            for t, run in seq:
                g = run(ids, max_new_tokens)
                t.tokens += len(g.output_ids)
                t.prefill_s += g.prefill_s
                t.decode_s += g.decode_s
                if r == 0:
                    t.outputs.append(g.output_ids)
                if t.method == "plain":
                    t.cycles += max(len(g.output_ids) - 1, 0)
                else:
                    t.draft_s += g.draft_s
                    t.verify_s += g.verify_s
                    t.cycles += g.verify_ct
                    t.accepted += g.accepted
                    t.drafted += g.drafted
            if progress:
                progress(f"round {r + 1}/{rounds} prompt {i + 1}/{len(prompts)} done")
    return SideBySide(model=model_name or str(runner.model_dir), draft=draft_name, dtype=runner.dtype_name,
                      prompts=len(prompts), rounds=rounds, max_new_tokens=max_new_tokens,
                      totals=[t for t, _ in runs])


def run_cpu_bench(
    *, model: str = "default", draft: str, prompt_set: str = "mt-bench", num_prompts: int = 8,
    max_new_tokens: int = 64, shapes: Sequence[SpecShape | str] | None = None, dtype: str = "auto",
    plain_policies: Sequence[str] | None = None, spec_policies: Sequence[str] | None = None, rounds: int = 1,
    prompt_ids: Sequence[list[int]] | None = None, progress: Callable[[str], None] | None = None,
) -> SideBySide:
    """Load target + drafter (``draft='random'``: an untrained one, smoke test only) and run
    :func:`side_by_side`; ``shapes`` None: the measured best shape only; policies None:
    :data:`PLAIN_POLICIES` and :data:`SPEC_POLICIES`."""
    import tempfile

    from eaglenest.models import resolve_model
    from eaglenest.speculative import prompts as P
    from eaglenest.speculative.draft import draft_aux_layer_ids, write_random_draft
    from eaglenest.speculative.serve import load_spec_decoder
    from eaglenest.speculative.tree import measured_best_shape

    model_dir = resolve_model(model)
    notes = []
    if draft == "random":
        draft = str(write_random_draft(model_dir, Path(tempfile.mkdtemp(prefix="random-draft-")),
                                       draft_vocab=32000))
        notes.append("drafter: UNTRAINED random weights (smoke test; accept length ~1 expected)")
    runner = TargetRunner(model_dir, dtype=dtype, aux_layer_ids=draft_aux_layer_ids(draft))
    if prompt_ids is None:
        ps = P.load_prompt_set(prompt_set, limit=num_prompts)
        prompt_ids = P.tokenize(ps, runner.tokenizer)
        notes.append(f"prompts: {ps.name} ({ps.source})")
    chosen = [SpecShape.parse(s) if isinstance(s, str) else s for s in (shapes or [measured_best_shape()])]
    result = side_by_side(runner, lambda pol, shape: load_spec_decoder(runner, draft, shape=shape, onednn=pol),
                          list(prompt_ids), max_new_tokens=max_new_tokens, shapes=chosen,
                          plain_policies=plain_policies or PLAIN_POLICIES, spec_policies=spec_policies or SPEC_POLICIES,
                          rounds=rounds, model_name=str(model_dir), draft_name=str(draft),
                          progress=progress)
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


def run_record(result: SideBySide, *, argv: Sequence[str], load_before: tuple[float, ...]) -> dict[str, Any]:
    """The benchmark's JSON: its command line, commit, machine and date beside the result."""
    import datetime
    import os
    import platform
    import subprocess

    import torch

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    flags = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in cpu_flags()]  # (those that matter)
    return {"command": list(argv), "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"host": platform.node(), "cpu": cpu_model(), "cpu_flags": flags, "cpus": os.cpu_count(),
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg())},
            "result": result.to_json()}


def default_json_path() -> Path:
    import datetime

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path("results") / f"cpu_spec_{stamp}.json"


def save_measured_shape(result: SideBySide, record_path: Path, record: dict[str, Any],
                        path: Path | None = None) -> Path:
    """Make the fastest measured variant the embedded decoder's default shape, with its evidence."""
    from eaglenest.speculative.tree import BEST_SHAPE_FILE, save_best_shape

    best = result.best("eagle3")
    return save_best_shape(SpecShape.parse(best.shape), path=path or BEST_SHAPE_FILE, evidence={
        "result_file": str(record_path), "command": record["command"], "commit": record["commit"],
        "date": record["date"], "cpu": record["machine"]["cpu"], "drafter": result.draft, "onednn": best.policy,
        "shapes_compared": sorted({t.shape for t in result.totals if t.method == "eagle3"}),
        "speedup": round(result.speedup, 4), "accept_length": round(best.accept().accept_length, 4),
        "cycle_cost_plain_steps": round(result.cycle_cost(best)["total"], 4),
        "prompts": result.prompts, "max_new_tokens": result.max_new_tokens})
