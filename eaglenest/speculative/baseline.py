"""The live grid's baseline server: whether a saved one (``server_baseline.json``) can stand beside this run's
EAGLE3 servers, and how the baseline beside each speedup was measured (scripts/gpu_bench_grid.py, gpu_session.sh)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from eaglenest.engines.sglang_guards import split_flags
from eaglenest.speculative.live import ServerResult
from eaglenest.speculative.loadgen import requests_for


def baseline_provenance(rounds: int, baseline_json: str | None, *, now: float | None = None,
                        own_flags: Sequence[str] = ()) -> str:
    """How the baseline beside each speedup was measured, for the report and the matrix: on 2026-12-06 (H100) a
    baseline up beside EAGLE3 ran 3.5% faster than one alone, so 1.51x against a reused baseline read 1.44x in
    alternating rounds (results/2026-12-06-h100). ``own_flags``: the baseline server's own (--baseline-sglang-arg),
    named because a speedup (and a cycle cost in baseline steps) is then against another server configuration."""
    own = f"; the baseline's own flags: {' '.join(own_flags)}" if own_flags else ""
    if rounds > 1:
        return f"measured together with EAGLE3, {rounds} alternating rounds{own}"
    if baseline_json:
        age = (time.time() if now is None else now) - Path(baseline_json).stat().st_mtime
        return f"reused: {baseline_json}, written {age / 60:.0f} min before this run (not alternated){own}"
    return f"measured alone in this run, before EAGLE3 (not alternated){own}"


def server_flags(cmd: Sequence[str]) -> list[tuple[str, str | None]]:
    """An SGLang launch command's flags in order, without where it listens (--host, --port): what a reused baseline
    must have run with."""
    args = list(cmd)
    rest = args[args.index("sglang.launch_server") + 1:] if "sglang.launch_server" in args else args
    return [(f, v) for f, v in split_flags(rest) if f not in ("--host", "--port")]


def read_baseline(path: str) -> dict[str, ServerResult]:
    """A server_baseline.json: per prompt set, the baseline server's result."""
    return {n: ServerResult.from_json(d) for n, d in json.loads(Path(path).read_text()).items()}


def baseline_levels(runs: dict[str, ServerResult]) -> dict[tuple[str, int], int]:
    """Each (prompt set, concurrency) a baseline measured, with the requests it sent there."""
    return {(n, lv.concurrency): lv.requests for n, r in runs.items() for lv in r.levels}


def baseline_covers(path: str, other: str) -> bool:
    """Whether the baseline at ``path`` measured every (prompt set, concurrency, requests) the one at ``other``
    did: a narrower one must not replace a wider cached one (gpu_session.sh's bench)."""
    return baseline_levels(read_baseline(other)).items() <= baseline_levels(read_baseline(path)).items()


def _flag_text(flags: list[tuple[str, str | None]]) -> str:
    return " ".join(f if v is None else f"{f} {v}" for f, v in flags)


def reusable_baseline(path: str, prompt_counts: dict[str, int], concurrencies: list[int],
                      requests_per_level: int | None = None, *, cmd: Sequence[str] | None = None
                      ) -> tuple[dict[str, ServerResult] | None, str]:
    """A reused baseline (server_baseline.json) and "", or None and why it does not fit: it must hold every prompt
    set and concurrency of this run, each level with this run's number of requests (the same prompts), must
    have run alone (a baseline of alternating rounds ran beside EAGLE3 on a share of the GPU's memory) and, given
    ``cmd`` (the baseline this run would launch), with the same server flags.
    2026-12-06c: a one-level baseline of a --rounds run was reused for c=1,16, and the run failed after the EAGLE3
    launch on a missing level."""
    try:
        runs = read_baseline(path)
        levels = baseline_levels(runs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"--baseline-json {path} does not read as a baseline ({type(e).__name__}: {e})"
    problems = []
    wants = server_flags(cmd) if cmd is not None else None
    for name, num_prompts in prompt_counts.items():
        if name not in runs:
            problems.append(f"no prompt set {name!r} (it has {sorted(runs)})")
            continue
        have = sorted(c for n, c in levels if n == name)
        missing = sorted(set(concurrencies) - set(have))
        if missing:
            problems.append(f"{name!r} lacks concurrency {missing} (it has {have})")
        for c in sorted(set(concurrencies) & set(have)):
            want = requests_per_level or requests_for(c, num_prompts)
            if levels[name, c] != want:
                problems.append(f"{name!r} at c={c} sent {levels[name, c]} requests, this run sends {want}")
        if runs[name].round_tok_s:
            problems.append(f"{name!r} was measured in alternating rounds beside EAGLE3, not alone")
        if wants is not None and (had := server_flags(runs[name].cmd)) != wants:
            problems.append(f"{name!r} ran other server flags: {_flag_text(had)}; this run's baseline: "
                            f"{_flag_text(wants)}")
    if problems:
        return None, f"--baseline-json {path} does not fit this run: " + "; ".join(problems)
    return runs, ""
