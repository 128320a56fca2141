"""Benchmark report and deployment gate: baseline vs EAGLE3 per concurrency, as JSON, Markdown and PNGs.

Owns the :class:`BenchReport` record (what was measured, on what, with which prompts), its files
(``report.json`` written last, ``report.md``, ``tok_s.png``, ``accept_length.png``; every write
atomic) and :func:`gate`: the speedup at the user's concurrency must reach the user's threshold, or
:class:`GateFailed` says by how much it missed and what to do. A gate never passes on a level that
had failed requests or was not measured.
"""

from __future__ import annotations

import io
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.atomic import atomic_write_bytes
from eaglenest.speculative.live import ServerResult
from eaglenest.speculative.loadgen import LevelResult, compare_answers


class GateFailed(RuntimeError):
    """EAGLE3 is not fast enough at the target concurrency. Terminal: re-running will not change it."""


@dataclass(frozen=True, kw_only=True)
class BenchReport:
    engine: str
    """'sglang' or 'embedded'."""
    model: str
    draft: str
    spec: dict[str, Any]
    """num_steps, topk, num_draft_tokens (SGLang's count, root included)."""
    prompt_set: str
    prompt_source: str
    num_prompts: int
    max_new_tokens: int
    baseline: ServerResult
    eagle3: ServerResult
    offline: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def level(self, which: str, concurrency: int) -> LevelResult | None:
        return (self.baseline if which == "baseline" else self.eagle3).level(concurrency)

    def speedups(self) -> dict[int, float]:
        out = {}
        for b in self.baseline.levels:
            e = self.level("eagle3", b.concurrency)
            if e is not None and b.output_tok_s > 0:
                out[b.concurrency] = e.output_tok_s / b.output_tok_s
        return out

    def round_speedups(self) -> dict[int, list[float]]:
        """EAGLE3 / baseline tok/s of each alternating round (the same prompts, back to back), in the order they
        ran, by concurrency; empty when the two servers were not measured in rounds."""
        return self.eagle3.round_ratios(self.baseline)

    def live_accept_length(self) -> float | None:
        """Accept length over every EAGLE3 request of the grid (token-weighted across levels)."""
        vals = [(lv.accept_length, lv.output_tokens) for lv in self.eagle3.levels if lv.accept_length is not None]
        total = sum(w for _, w in vals)
        return sum(a * w for a, w in vals) / total if total else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["baseline"], d["eagle3"] = self.baseline.to_json(), self.eagle3.to_json()
        d["speedups"] = {str(k): v for k, v in self.speedups().items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BenchReport:
        d = {k: v for k, v in d.items() if k != "speedups"}
        return cls(**{**d, "baseline": ServerResult.from_json(d["baseline"]),
                      "eagle3": ServerResult.from_json(d["eagle3"])})


def offline_estimate(offline: dict[str, Any] | None) -> float | None:
    """The offline number comparable with live: per verify cycle when the simulation has it."""
    if not offline:
        return None
    v = offline.get("accept_length_cycles")
    if v is not None and v == v:  # not NaN
        return float(v)
    return offline.get("accept_length")


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown_table(r: BenchReport) -> str:
    lines = [
        f"### Speculative decoding benchmark ({r.engine})",
        f"target `{r.model}`, drafter `{r.draft}`; EAGLE3 steps={r.spec.get('num_steps')} "
        f"topk={r.spec.get('topk')} num_draft_tokens={r.spec.get('num_draft_tokens')} (root counted); "
        f"prompts: {r.prompt_set} ({r.num_prompts}, {r.prompt_source}); max_new_tokens={r.max_new_tokens}, greedy.",
        "",
        "| concurrency | baseline tok/s | EAGLE3 tok/s | speedup | accept length | baseline p50 / p99 s "
        "| EAGLE3 p50 / p99 s | errors (base/eagle) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    sp = r.speedups()
    for b in r.baseline.levels:
        e = r.level("eagle3", b.concurrency)
        lines.append(
            f"| {b.concurrency} | {b.output_tok_s:.1f} | {_f(e.output_tok_s if e else None)} | "
            f"{_f(sp.get(b.concurrency), '.2f')}x | {_f(e.accept_length if e else None, '.2f')} | "
            f"{b.latency_p50_s:.2f} / {b.latency_p99_s:.2f} | "
            f"{_f(e.latency_p50_s if e else None, '.2f')} / {_f(e.latency_p99_s if e else None, '.2f')} | "
            f"{b.errors}/{e.errors if e else '-'} |"
        )
    lines += ["", f"Accept length counts the bonus token (tokens per target verify forward). Server-reported "
                  f"avg_spec_accept_length: {_f(r.eagle3.server_accept_length, '.2f')}."]
    if r.offline:
        where = ("the target's greedy answers to these prompts" if r.offline.get("source") == "prompts"
                 else "store simulation, held-out samples")
        how = (f"{r.offline['shape']} replayed cycle by cycle; the chain of its depth "
               f"{_f((r.offline.get('chain') or {}).get('accept_length_cycles'), '.2f')}" if r.offline.get("shape")
               else f"per start {_f(r.offline.get('accept_length'), '.2f')}")
        lines.append(f"Offline ({where}, {r.offline.get('samples')} samples): accept length per verify cycle "
                     f"{_f(offline_estimate(r.offline), '.2f')} ({how}).")
    if r.calibration:
        lines.append(f"Calibration: offline / live = {_f(r.calibration.get('ratio'), '.2f')} "
                     f"(offline {_f(r.calibration.get('offline_accept_length'), '.2f')}, live "
                     f"{_f(r.calibration.get('live_accept_length'), '.2f')}).")
    lines += [f"- {n}" for n in r.notes]
    for b in r.baseline.levels:
        e = r.level("eagle3", b.concurrency)
        if e is not None and (same := compare_answers(e, b)) is not None:
            lines.append(f"- concurrency {b.concurrency}: on {same['identical']} of {same['prompts']} prompts EAGLE3 "
                         "answered as the baseline, token for token (greedy speculation matches plain decoding up to "
                         "the kernels' numerics: an answer diverges where a near-tie flips)")
    for c, ratios in sorted(r.round_speedups().items()):
        lines.append(f"- concurrency {c}, each alternating round (EAGLE3 / baseline on the same prompts, in the order "
                     f"they ran): {', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x")
        lo, hi = min(ratios), max(ratios)
        if hi > 0 and (lo <= 0 or hi / lo > ROUNDS_DISAGREE):  # (a round of 0 tok/s disagrees with any other)
            lines.append(f"- WARNING: at concurrency {c} the rounds disagree ({lo:.2f}x to {hi:.2f}x): "
                         "the machine's speed moved during the run or a server was still warming up, so the pooled "
                         "speedup above is not a reliable reading; measure again.")
    odd = [c for c, v in sp.items() if (e := r.level("eagle3", c)) is not None and e.accept_length
           and v is not None and v > e.accept_length * IMPLAUSIBLE_MARGIN]
    if odd:
        lines.append(f"- WARNING: at concurrency {odd} the speedup exceeds the accept length, which bounds it: the "
                     "baseline and EAGLE3 servers ran under different machine load; re-measure when quiet.")
    return "\n".join(lines) + "\n"


def plot_report(r: BenchReport) -> dict[str, bytes]:
    """PNG bytes: tok/s vs concurrency (both servers) and accept length vs concurrency (EAGLE3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for res, style in ((r.baseline, "o-"), (r.eagle3, "s-")):
        ax.plot([lv.concurrency for lv in res.levels], [lv.output_tok_s for lv in res.levels], style, label=res.name)
    _concurrency_axis(ax, r.baseline.levels + r.eagle3.levels)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{Path(r.model).name}: baseline vs EAGLE3 ({r.engine})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    pngs["tok_s.png"] = _png(fig, plt)
    fig, ax = plt.subplots(figsize=(6, 4))
    draw_accept_length(ax, r)
    pngs["accept_length.png"] = _png(fig, plt)
    return pngs


def draw_accept_length(ax, r: BenchReport) -> None:
    """Live accept length per concurrency and the offline estimate as a line, all inside the frame."""
    pts = [(lv.concurrency, lv.accept_length) for lv in r.eagle3.levels if lv.accept_length is not None]
    ax.plot([c for c, _ in pts], [a for _, a in pts], "s-", color="C1", label="EAGLE3 (live)")
    est = offline_estimate(r.offline)
    if est is not None:
        ax.axhline(est, ls="--", color="gray", label="offline (simulated, per verify cycle)")
    ax.axhline(1.0, ls=":", color="black", lw=0.8)
    _concurrency_axis(ax, r.eagle3.levels)
    # an axhline does not widen the y range: set it from every value drawn, with headroom for the legend
    top = max([a for _, a in pts] + [est or 0.0, 1.0])
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("accept length (tokens / verify, bonus counted)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")


def _concurrency_axis(ax, levels) -> None:
    cs = sorted({lv.concurrency for lv in levels})
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (requests in flight)")


def _png(fig, plt) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_report(r: BenchReport, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """report.md, PNGs (when matplotlib is importable), then report.json last; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": atomic_write_bytes(out / "report.md", markdown_table(r).encode())}
    if plots:
        try:
            pngs = plot_report(r)
        except ImportError:  # the GPU image has no matplotlib: render later with `eaglenest bench plot`
            pngs = {}
        for name, data in pngs.items():
            paths[name.removesuffix(".png")] = atomic_write_bytes(out / name, data)
    paths["json"] = atomic_write_bytes(out / "report.json", json.dumps(r.to_json(), indent=1).encode())
    return paths


def read_report(path: str | Path) -> BenchReport:
    return BenchReport.from_json(json.loads(Path(path).read_text()))


@dataclass(frozen=True, kw_only=True, slots=True)
class GateResult:
    passed: bool
    concurrency: int
    min_speedup: float
    speedup: float | None
    message: str
    cycle_cost_steps: float | None = None
    """Baseline decode steps one speculation cycle costs (= the break-even accept length)."""


def cycle_cost_steps(baseline_tok_s: float, eagle3_tok_s: float, accept_length: float | None) -> float | None:
    """Time of one cycle in baseline steps: a cycle yields ``accept_length`` tokens in accept/eagle3 seconds."""
    if accept_length is None or eagle3_tok_s <= 0 or baseline_tok_s <= 0:
        return None
    return accept_length * baseline_tok_s / eagle3_tok_s


ROUNDS_DISAGREE = 1.2  # the fastest round's speedup / the slowest's above this: the run is too noisy to read
# (2026-12-06d, H100: 7x8x48 rounds of 0.87x, 0.76x and 1.39x pooled to 0.95x; alone minutes later 1.51x;
# 2026-12-06c's rounds of the same tree agreed within 4%)
IMPLAUSIBLE_MARGIN = 1.15  # measured speedup / accept length above this: the load changed between the servers


def gate(r: BenchReport, *, target_concurrency: int, min_speedup: float = 1.0) -> GateResult:
    """Does EAGLE3 reach ``min_speedup`` x the baseline's output tok/s at ``target_concurrency``?"""
    b, e = r.level("baseline", target_concurrency), r.level("eagle3", target_concurrency)
    if b is None or e is None:
        measured = sorted(lv.concurrency for lv in r.baseline.levels)
        return GateResult(passed=False, concurrency=target_concurrency, min_speedup=min_speedup, speedup=None,
                          message=f"concurrency {target_concurrency} was not measured (measured: {measured}); add "
                                  f"it to the benchmark's concurrency levels")
    if b.errors or e.errors:
        return GateResult(passed=False, concurrency=target_concurrency, min_speedup=min_speedup, speedup=None,
                          message=f"requests failed at concurrency {target_concurrency} (baseline {b.errors}, "
                                  f"EAGLE3 {e.errors}; first: {b.first_error or e.first_error}): fix the servers "
                                  "and re-run before deciding")
    s = e.output_tok_s / b.output_tok_s if b.output_tok_s > 0 else 0.0
    acc = f"accept length {e.accept_length:.2f}" if e.accept_length is not None else "no accept length reported"
    cost = cycle_cost_steps(b.output_tok_s, e.output_tok_s, e.accept_length)
    # wall times beside the ratio: the same drafter's speedup moves with the machine (on two H200 machines a
    # cycle took 3.1 and 3.3-4.8 ms, a baseline step 1.5 and 1.3 ms), and the times say which side moved
    cyc = ""
    if cost is not None:  # both tok/s > 0
        step_ms = 1000.0 * target_concurrency / b.output_tok_s
        cyc = (f"; one cycle costs {cost:.2f} baseline steps ({cost * step_ms:.2f} ms against {step_ms:.2f} ms), so "
               f"the break-even accept length is {cost:.2f}")
    head = (f"EAGLE3 runs at {s:.2f}x the baseline at concurrency {target_concurrency} "
            f"({e.output_tok_s:.1f} vs {b.output_tok_s:.1f} output tok/s, {acc}{cyc}; threshold {min_speedup:.2f}x)")

    def result(passed: bool, message: str) -> GateResult:
        return GateResult(passed=passed, concurrency=target_concurrency, min_speedup=min_speedup, speedup=s,
                          cycle_cost_steps=cost, message=message)

    if e.accept_length is not None and s > e.accept_length * IMPLAUSIBLE_MARGIN:
        note = (f"{head}: implausible — a speedup above the accept length cannot come from speculation (each "
                f"verify forward costs at least a plain decode step), so the two servers ran under different "
                f"load; re-measure on a quiet machine")
        if min_speedup > 0:
            return result(False, note)
        return result(True, note + " (threshold 0: reported, not gated)")
    if s >= min_speedup:
        return result(True, head + ": passes")
    return result(False, head + ": do NOT deploy this drafter at this concurrency. A higher accept length "
                               "(more or engine-native training data) or fewer draft steps "
                               "(--speculative-num-steps) may help; speculation pays least at high concurrency.")


def require_gate(r: BenchReport, *, target_concurrency: int, min_speedup: float = 1.0) -> GateResult:
    """:func:`gate`, raising :class:`GateFailed` with its message when it does not pass."""
    g = gate(r, target_concurrency=target_concurrency, min_speedup=min_speedup)
    if not g.passed:
        raise GateFailed(g.message)
    return g


def depth_sweep(matrices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of several grid matrices (``matrix.json`` of scripts/gpu_bench_grid.py, one per draft depth
    or several depths each) as one table sorted by prompt set, concurrency and steps; a (set, steps,
    concurrency) measured twice keeps the later matrix's row. A matrix that served several drafters or verify kernels
    side by side is refused (its rows are not one drafter's depths)."""
    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    for i, m in enumerate(matrices):
        if not isinstance(m.get("rows"), list):
            raise ValueError(f"matrix {i + 1} has no rows: not a matrix.json of scripts/gpu_bench_grid.py")
        served = {(r.get("draft"), r.get("verify_kernel")) for r in m["rows"]}
        if len(served) > 1:
            raise ValueError(f"matrix {i + 1} served {len(served)} EAGLE3 variants side by side (drafter, verify "
                             f"kernel: {sorted(served, key=str)}): a depth sweep takes one drafter's grids")
        for r in m["rows"]:
            rows[(str(r["prompt_set"]), int(r["concurrency"]), int(r["steps"]))] = r
    return [rows[k] for k in sorted(rows)]


def best_depths(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """(prompt set, concurrency) -> the :func:`depth_sweep` row of the highest measured speedup."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        key = (str(r["prompt_set"]), int(r["concurrency"]))
        if r.get("speedup") is not None and (key not in best or r["speedup"] > best[key]["speedup"]):
            best[key] = r
    return best


def plot_depth_sweep(rows: list[dict[str, Any]]) -> bytes:
    """PNG: speedup over the baseline and accept length against draft steps, one line per prompt set and
    concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    lines: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        lines.setdefault((str(r["prompt_set"]), int(r["concurrency"])), []).append(r)
    names = sorted({name for name, _ in lines})
    for (name, conc), pts in sorted(lines.items()):  # a colour per prompt set, solid at c=1
        style = dict(color=f"C{names.index(name)}", ls="-" if conc == 1 else "--", marker="o",
                     label=f"{name} c={conc}")
        steps = [int(p["steps"]) for p in pts]
        ax_s.plot(steps, [p.get("speedup") for p in pts], **style)
        ax_a.plot(steps, [p.get("accept_length") for p in pts], **style)
    ax_s.axhline(1.0, ls=":", color="black", lw=0.8)
    ax_s.set_ylabel("EAGLE3 tok/s / baseline tok/s")
    ax_a.set_ylabel("accept length (tokens / verify, bonus counted)")
    for ax in (ax_s, ax_a):
        ax.set_xlabel("draft steps (--speculative-num-steps, topk 1)")
        ax.set_xticks(sorted({int(r["steps"]) for r in rows}))
        ax.grid(True, alpha=0.3)
    ax_a.legend(fontsize=8, loc="lower right")
    return _png(fig, plt)
