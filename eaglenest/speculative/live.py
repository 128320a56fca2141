"""Live benchmark: drive a server's ``/generate`` at fixed concurrency and measure what users feel.

Owns the load generator and the two-server grid; the same code drives SGLang and the embedded server:

- :func:`drive_level` keeps exactly ``concurrency`` requests in flight (closed loop, httpx, async) over
  a prompt set of token ids, greedy, and records per request the latency, completion tokens and
  SGLang's ``meta_info`` spec fields. A level's output tok/s is all completion tokens over the
  level's wall time (first send to last answer).
- Accept length comes from ``meta_info``: ``(spec_num_correct_drafts + spec_verify_ct) /
  spec_verify_ct`` summed over requests (bonus token counted; SGLang's own per-request
  ``spec_accept_length`` = completion_tokens / spec_verify_ct also counts the prefill's first token)
  and, as a cross-check, ``/get_server_info`` ``internal_states[0].avg_spec_accept_length``.
- :func:`bench_server` launches one server (:class:`~eaglenest.engines.pool.ServerProcess`, its own
  process group, ready after a real request), warms it up, runs every level, and always stops it;
  the group is recorded (:class:`~eaglenest.engines.pool.ServerRecords`) so a crashed flow's hook can end it.
- :func:`bench_servers_together` keeps both servers up and runs each level in alternating rounds
  (:func:`run_rounds`), so the machine's drift during a run falls on both sides alike.
- :func:`sglang_command` builds a plain ``python -m sglang.launch_server`` command (CUDA graphs on
  unless disabled; EAGLE3 flags from :class:`~eaglenest.speculative.serve.SpecConfig`).

Invariant: requests carry ``nocapture:`` rids, so a capturing server never writes shards for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eaglenest.contract import NO_CAPTURE_RID_PREFIX
from eaglenest.engines.pool import ServerProcess, ServerRecords, launched, probe_ready
from eaglenest.engines.sglang_flags import sglang_flags
from eaglenest.extraction.aio import run_sync
from eaglenest.speculative.serve import SGLANG_BEST, SpecConfig


class BenchError(RuntimeError):
    """The benchmark could not measure (server down, every request failed). Retryable by relaunching."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestRecord:
    index: int
    ok: bool
    latency_s: float
    prompt_tokens: int
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    spec_correct_drafts: int | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    requests_per_s: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    accept_length: float | None
    """Tokens per verify forward, bonus counted; None when the server does not speculate."""
    first_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LevelResult:
        return cls(**d)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_level(concurrency: int, records: Sequence[RequestRecord], duration_s: float) -> LevelResult:
    ok = [r for r in records if r.ok]
    lat = [r.latency_s for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    verify = sum(r.spec_verify_ct for r in ok)
    accept = None
    if verify:
        if all(r.spec_correct_drafts is not None for r in ok if r.spec_verify_ct):
            accept = (sum(r.spec_correct_drafts or 0 for r in ok) + verify) / verify
        else:  # older servers: completion / verify (counts the prefill's token too)
            accept = sum(r.completion_tokens for r in ok if r.spec_verify_ct) / verify
    errs = [r.error for r in records if not r.ok]
    return LevelResult(
        concurrency=concurrency, requests=len(records), errors=len(errs), duration_s=duration_s,
        output_tokens=tokens, output_tok_s=tokens / duration_s if duration_s > 0 else 0.0,
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        latency_mean_s=sum(lat) / len(lat) if lat else float("nan"), latency_p50_s=percentile(lat, 50),
        latency_p90_s=percentile(lat, 90), latency_p99_s=percentile(lat, 99), accept_length=accept,
        first_error=errs[0] if errs else None,
    )


async def _one(client: httpx.AsyncClient, url: str, index: int, ids: list[int], params: dict[str, Any],
               rid: str, clock: Callable[[], float]) -> RequestRecord:
    t0 = clock()
    try:
        r = await client.post(f"{url}/generate", json={"input_ids": ids, "rid": rid, "sampling_params": params})
    except httpx.HTTPError as e:
        return RequestRecord(index=index, ok=False, latency_s=clock() - t0, prompt_tokens=len(ids),
                             error=f"{type(e).__name__}: {e}")
    latency = clock() - t0
    if r.status_code != 200:
        return RequestRecord(index=index, ok=False, latency_s=latency, prompt_tokens=len(ids),
                             error=f"HTTP {r.status_code}: {r.text[:300]}")
    meta = (r.json() or {}).get("meta_info") or {}
    return RequestRecord(index=index, ok=True, latency_s=latency, prompt_tokens=len(ids),
                         completion_tokens=int(meta.get("completion_tokens", 0)),
                         spec_verify_ct=int(meta.get("spec_verify_ct", 0) or 0),
                         spec_correct_drafts=meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts")))


async def drive_level(
    url: str, prompts: Sequence[list[int]], *, concurrency: int, num_requests: int, max_new_tokens: int,
    ignore_eos: bool = False, timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.perf_counter, tag: str = "bench",
) -> LevelResult:
    """``num_requests`` greedy requests (prompts reused round-robin), ``concurrency`` in flight at all times."""
    records, duration = await _drive(url, prompts, concurrency=concurrency, num_requests=num_requests,
                                     max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, timeout_s=timeout_s,
                                     transport=transport, clock=clock, tag=tag)
    return summarize_level(concurrency, records, duration)


async def _drive(
    url: str, prompts: Sequence[list[int]], *, concurrency: int, num_requests: int, max_new_tokens: int,
    ignore_eos: bool, timeout_s: float, transport: httpx.AsyncBaseTransport | None, clock: Callable[[], float],
    tag: str,
) -> tuple[list[RequestRecord], float]:
    """The records (by index) and wall time of one closed-loop level."""
    if concurrency < 1 or num_requests < 1 or not prompts:
        raise ValueError(f"need concurrency >= 1, num_requests >= 1 and prompts (got {concurrency}, "
                         f"{num_requests}, {len(prompts)})")
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, transport=transport, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                rid = f"{NO_CAPTURE_RID_PREFIX}{tag}-c{concurrency}-{i}-{time.time_ns()}"
                records.append(await _one(client, url, i, list(prompts[i % len(prompts)]), params, rid, clock))

        t0 = clock()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
        duration = clock() - t0
    return sorted(records, key=lambda r: r.index), duration


def requests_for(concurrency: int, num_prompts: int, *, min_waves: int = 2) -> int:
    """Enough requests that the level spends most of its time at full concurrency."""
    return max(num_prompts, min_waves * concurrency)


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

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["levels"] = [lv.to_json() for lv in self.levels]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ServerResult:
        return cls(**{**d, "levels": [LevelResult.from_json(x) for x in d["levels"]]})


def run_levels(url: str, prompts: Sequence[list[int]], concurrencies: Sequence[int], *, max_new_tokens: int,
               ignore_eos: bool = False, requests_per_level: int | None = None, timeout_s: float = 600.0,
               tag: str = "bench", transport: httpx.AsyncBaseTransport | None = None,
               progress: Callable[[LevelResult], None] | None = None) -> list[LevelResult]:
    levels = []
    for c in concurrencies:
        n = requests_per_level or requests_for(c, len(prompts))
        # on a thread of its own (extraction/aio.py says why): a SIGTERM must end the bench, not one request
        lv = run_sync(lambda c=c, n=n: drive_level(
            url, prompts, concurrency=c, num_requests=n, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
            timeout_s=timeout_s, transport=transport, tag=tag))
        if lv.errors == lv.requests:
            raise BenchError(f"every request failed at concurrency {c} on {url}: {lv.first_error}")
        levels.append(lv)
        if progress:
            progress(lv)
    return levels


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
                _warm(server, prompts, warmup_requests, concurrencies, max_new_tokens=max_new_tokens,
                      ignore_eos=ignore_eos, timeout_s=timeout_s)
            levels = run_levels(server.url, prompts, concurrencies, max_new_tokens=max_new_tokens,
                                ignore_eos=ignore_eos, requests_per_level=requests_per_level, timeout_s=timeout_s,
                                tag=name, progress=(lambda lv: progress(name, lv)) if progress else None)
            results[set_name] = _result(name, server, levels, startup)
    return results


def _warm(server: ServerProcess, prompts: Sequence[list[int]], requests: int, concurrencies: Sequence[int], *,
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


def run_rounds(
    urls: Mapping[str, str], prompts: Sequence[list[int]], concurrencies: Sequence[int], *, rounds: int,
    max_new_tokens: int, ignore_eos: bool = False, timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None, progress: Callable[[str, LevelResult], None] | None = None,
) -> dict[str, tuple[list[LevelResult], dict[str, list[float]]]]:
    """Every concurrency level on every server (``urls``: name -> URL), in ``rounds`` alternating rounds.

    Round r sends the r-th of ``rounds`` interleaved slices of the prompts to every server, the same requests to
    each, in reversed order every other round (an even ``rounds`` lets each server lead as often): a machine that
    speeds up or slows down during the run then weighs on both sides alike (on the H200 the baseline of the same
    grid, one session apart, ran 12-68% faster). A round sends ``requests_for(c, slice)`` requests, at least 2c
    (the slice's prompts reused round-robin), so that it runs mostly at full concurrency: at high concurrency the
    rounds send more requests in all than one plain level does. Each server's level pools the records and wall
    times of its rounds; the rounds' own tok/s are returned beside them (name -> (levels, {concurrency: [tok/s
    per round]}))."""
    if rounds < 1 or rounds > len(prompts):
        raise ValueError(f"rounds must be between 1 and the number of prompts ({len(prompts)}), got {rounds}")
    names = list(urls)
    out: dict[str, tuple[list[LevelResult], dict[str, list[float]]]] = {n: ([], {}) for n in names}
    for c in concurrencies:
        records: dict[str, list[RequestRecord]] = {n: [] for n in names}
        wall = dict.fromkeys(names, 0.0)
        for r in range(rounds):
            chunk = prompts[r::rounds]
            for name in names if r % 2 == 0 else names[::-1]:
                recs, dur = run_sync(lambda name=name, chunk=chunk, c=c, r=r: _drive(
                    urls[name], chunk, concurrency=c, num_requests=requests_for(c, len(chunk)),
                    max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, timeout_s=timeout_s, transport=transport,
                    clock=time.perf_counter, tag=f"{name}-r{r}"))
                if not any(x.ok for x in recs):
                    raise BenchError(f"every request failed at concurrency {c} on {urls[name]}: {recs[0].error}")
                records[name] += recs
                wall[name] += dur
                out[name][1].setdefault(str(c), []).append(sum(x.completion_tokens for x in recs if x.ok) / dur)
        for name in names:
            lv = summarize_level(c, records[name], wall[name])
            out[name][0].append(lv)
            if progress:
                progress(name, lv)
    return out


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
                _warm(server, next(iter(prompt_sets.values())), warmup_requests, concurrencies,
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
