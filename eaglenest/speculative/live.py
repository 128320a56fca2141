"""Live benchmark: the servers a benchmark measures, from launch to stop, and the SGLang command line.

Owns the servers' side of the grid; :mod:`eaglenest.speculative.loadgen` sends the requests and summarizes
them. The same code drives SGLang and the embedded server:

- :func:`bench_server` launches one server (:class:`~eaglenest.engines.pool.ServerProcess`, its own
  process group, ready after a real request), warms it up, runs every level, and always stops it;
  the group is recorded (:class:`~eaglenest.engines.pool.ServerRecords`) so a crashed flow's hook can end it.
- :func:`bench_servers_together` keeps both servers up and runs each level in alternating rounds
  (:func:`~eaglenest.speculative.loadgen.run_rounds`), so the machine's drift during a run falls on both
  sides alike.
- A level's accept length comes from its own requests' ``meta_info`` (see the load generator); as a
  cross-check, :class:`ServerResult` keeps ``/get_server_info`` ``internal_states[0].avg_spec_accept_length``.
- :func:`sglang_command` builds a plain ``python -m sglang.launch_server`` command (CUDA graphs on
  unless disabled; EAGLE3 flags from :class:`~eaglenest.speculative.serve.SpecConfig`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eaglenest.engines.pool import ServerProcess, ServerRecords, launched, probe_ready
from eaglenest.engines.sglang_flags import sglang_flags
from eaglenest.speculative.loadgen import LevelResult, run_levels, run_rounds
from eaglenest.speculative.serve import SGLANG_BEST, SpecConfig


def server_info(url: str, *, transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    try:
        with httpx.Client(timeout=30, transport=transport) as c:
            r = c.get(f"{url}/get_server_info")
            return r.json() if r.status_code == 200 else {"error": f"HTTP {r.status_code}"}
    except (httpx.HTTPError, ValueError) as e:
        return {"error": repr(e)}


def server_accept_length(info: dict[str, Any]) -> float | None:
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        v = states[0].get("avg_spec_accept_length")
        return float(v) if v is not None else None
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerResult:
    name: str
    """'baseline' or 'eagle3'."""
    cmd: list[str]
    levels: list[LevelResult]
    server_accept_length: float | None
    startup_s: float
    info: dict[str, Any] = field(default_factory=dict)
    round_tok_s: dict[str, list[float]] = field(default_factory=dict)
    """Per concurrency (as a string): the output tok/s of each round, when the levels ran in alternating rounds."""

    def level(self, concurrency: int) -> LevelResult | None:
        """The level measured at ``concurrency``, if any."""
        return next((lv for lv in self.levels if lv.concurrency == concurrency), None)

    def round_ratios(self, other: ServerResult) -> dict[int, list[float]]:
        """This server's tok/s over ``other``'s in each alternating round they shared (the same prompts, back to
        back), in the order they ran, by concurrency; empty where they were not measured in the same rounds."""
        out = {}
        for c, theirs in other.round_tok_s.items():
            ours = self.round_tok_s.get(c)
            if ours and len(ours) == len(theirs) and all(t > 0 for t in theirs):
                out[int(c)] = [a / b for a, b in zip(ours, theirs, strict=True)]
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["levels"] = [lv.to_json() for lv in self.levels]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ServerResult:
        return cls(**{**d, "levels": [LevelResult.from_json(x) for x in d["levels"]]})


def bench_server(
    name: str, server: ServerProcess, prompts: Sequence[list[int]], concurrencies: Sequence[int], **kwargs: Any,
) -> ServerResult:
    """:func:`bench_server_sets` for one prompt set."""
    return bench_server_sets(name, server, {"": prompts}, concurrencies, **kwargs)[""]


def bench_server_sets(
    name: str, server: ServerProcess, prompt_sets: Mapping[str, Sequence[list[int]]], concurrencies: Sequence[int],
    *, max_new_tokens: int, ignore_eos: bool = False, requests_per_level: int | None = None, warmup_requests: int = 4,
    ready_timeout_s: float = 900.0, timeout_s: float = 600.0, ready: Callable[[str], bool] = probe_ready,
    progress: Callable[[str, LevelResult], None] | None = None, pidfile: Path | None = None,
) -> dict[str, ServerResult]:
    """Launch ``server`` once, warm it up, run every concurrency level on each prompt set, stop it.

    One launch serves several prompt sets (a server start costs about a minute on the GPU machine).
    ``pidfile`` records the server's process group so a crashed caller can end it later
    (:func:`~eaglenest.engines.pool.end_recorded_servers`). Results are keyed like ``prompt_sets``. Each
    level's accept length comes from its own requests; the server's ``avg_spec_accept_length`` cross-check
    is cumulative, so after the first set it averages over every set run so far.
    """
    t0 = time.monotonic()
    results: dict[str, ServerResult] = {}
    records = ServerRecords(pidfile) if pidfile is not None else None
    with launched(server, timeout_s=ready_timeout_s, ready=ready, records=records):
        startup = time.monotonic() - t0
        for set_name, prompts in prompt_sets.items():
            if warmup_requests and not results:  # the first set warms the server for all
                warm(server, prompts, warmup_requests, concurrencies, max_new_tokens=max_new_tokens,
                      ignore_eos=ignore_eos, timeout_s=timeout_s)
            levels = run_levels(server.url, prompts, concurrencies, max_new_tokens=max_new_tokens,
                                ignore_eos=ignore_eos, requests_per_level=requests_per_level, timeout_s=timeout_s,
                                tag=name, progress=(lambda lv: progress(name, lv)) if progress else None)
            results[set_name] = _result(name, server, levels, startup)
    return results


def warm(server: ServerProcess, prompts: Sequence[list[int]], requests: int, concurrencies: Sequence[int], *,
         max_new_tokens: int, ignore_eos: bool, timeout_s: float) -> None:
    """Every concurrency level once before anything is measured: ``max(c, requests)`` requests at concurrency c.

    A server's first batches of a new size pay one-time costs that a measured level must not: on the H200
    (results/2026-12-03f-h200) the first 40 decode steps of 16 running EAGLE3 tree requests ran at 1,702 tok/s
    against 6,146-7,784 for the next ones, and with a warmup of 4 requests at concurrency 4 the grid's first
    concurrency-16 round ran at 0.25x the baseline, its next two at 1.19x and 1.51x."""
    for c in sorted(set(concurrencies)):
        run_levels(server.url, prompts, [c], max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                   requests_per_level=max(c, requests), timeout_s=timeout_s, tag="warmup")


def _result(name: str, server: ServerProcess, levels: list[LevelResult], startup_s: float,
            round_tok_s: dict[str, list[float]] | None = None) -> ServerResult:
    """A server's result on one prompt set, with its ``/get_server_info`` scalars and internal states."""
    info = server_info(server.url)
    kept = {k: v for k, v in info.items() if not isinstance(v, dict | list) or k == "internal_states"}
    return ServerResult(name=name, cmd=list(server.cmd), levels=levels, server_accept_length=server_accept_length(info),
                        startup_s=startup_s, round_tok_s=round_tok_s or {}, info=kept)


def bench_servers_together(
    servers: Mapping[str, ServerProcess], prompt_sets: Mapping[str, Sequence[list[int]]],
    concurrencies: Sequence[int], *, rounds: int, max_new_tokens: int, ignore_eos: bool = False,
    warmup_requests: int = 4, ready_timeout_s: float = 900.0, timeout_s: float = 600.0,
    ready: Callable[[str], bool] = probe_ready, progress: Callable[[str, str, LevelResult], None] | None = None,
    pidfile: Path | None = None,
) -> dict[str, dict[str, ServerResult]]:
    """Launch every server (one after another: servers sharing a GPU size their memory from what is free, so each
    needs its ``--mem-fraction-static`` share), warm each, run :func:`run_rounds` on each prompt set, stop them
    all. Returns name -> prompt set -> ServerResult (its levels pooled over the rounds, ``round_tok_s`` beside).
    ``progress(server, prompt set, level)`` is called as each level finishes."""
    records = ServerRecords(pidfile) if pidfile is not None else None
    results: dict[str, dict[str, ServerResult]] = {n: {} for n in servers}
    with contextlib.ExitStack() as stack:
        startup: dict[str, float] = {}
        for name, server in servers.items():
            t0 = time.monotonic()
            stack.enter_context(launched(server, timeout_s=ready_timeout_s, ready=ready, records=records))
            startup[name] = time.monotonic() - t0
            if warmup_requests:
                warm(server, next(iter(prompt_sets.values())), warmup_requests, concurrencies,
                      max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, timeout_s=timeout_s)
        for set_name, prompts in prompt_sets.items():
            got = run_rounds({n: s.url for n, s in servers.items()}, prompts, concurrencies, rounds=rounds,
                             max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, timeout_s=timeout_s,
                             progress=(lambda n, lv, s=set_name: progress(n, s, lv)) if progress else None)
            for name, server in servers.items():
                levels, per_round = got[name]
                results[name][set_name] = _result(name, server, levels, startup[name], per_round)
    return results


def sglang_command(
    model: str | Path, *, port: int, host: str = "127.0.0.1", draft: str | Path | None = None,
    spec: SpecConfig = SGLANG_BEST, cuda_graph: bool = True, attention_backend: str | None = "triton",
    sampling_backend: str | None = "pytorch", mem_fraction_static: float | None = None,
    extra: Sequence[str] = (), python: str = sys.executable,
) -> list[str]:
    """``python -m sglang.launch_server`` for the baseline (``draft=None``) or EAGLE3 with ``draft``.

    Defaults follow the GPU kit's verified flags (triton attention, pytorch sampling); CUDA graphs
    stay on for benchmarks. ``spec.num_draft_tokens`` counts the root (SGLang 4 = vLLM k 3).
    """
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host, "--port", str(port),
           *sglang_flags(attention_backend=attention_backend, sampling_backend=sampling_backend, cuda_graph=cuda_graph,
                         mem_fraction_static=mem_fraction_static)]
    if draft is not None:
        cmd += spec.sglang_args(draft)
    return cmd + list(extra)


def live_grid(baseline: ServerProcess, eagle3: ServerProcess, prompts: Sequence[list[int]],
              concurrencies: Sequence[int], *, rounds: int = 1, **kwargs: Any) -> tuple[ServerResult, ServerResult]:
    """Baseline, then EAGLE3, one after the other (they share the accelerator and usually the port); with
    ``rounds`` > 1 both up together, every level in alternating rounds (:func:`bench_servers_together`)."""
    if rounds == 1:
        return (bench_server("baseline", baseline, prompts, concurrencies, **kwargs),
                bench_server("eagle3", eagle3, prompts, concurrencies, **kwargs))
    kwargs.pop("requests_per_level", None)  # a round sends its slice (BenchConfig refuses both)
    res = bench_servers_together({"baseline": baseline, "eagle3": eagle3}, {"": prompts}, concurrencies,
                                 rounds=rounds, **kwargs)
    return res["baseline"][""], res["eagle3"][""]
