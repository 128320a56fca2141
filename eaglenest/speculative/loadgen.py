"""Load generator: drive a server's ``/generate`` at fixed concurrency and summarize what users feel.

Owns the requests of the live benchmark and their arithmetic; :mod:`eaglenest.speculative.live` owns the servers
they are sent to:

- :func:`drive_level` keeps exactly ``concurrency`` requests in flight (closed loop, httpx, async) over
  a prompt set of token ids, greedy, and records per request the latency, completion tokens and
  SGLang's ``meta_info`` spec fields. A level's output tok/s is all completion tokens over the
  level's wall time (first send to last answer).
- Accept length comes from ``meta_info``: ``(spec_num_correct_drafts + spec_verify_ct) /
  spec_verify_ct`` summed over requests (bonus token counted; SGLang's own per-request
  ``spec_accept_length`` = completion_tokens / spec_verify_ct also counts the prefill's first token).
- :func:`run_levels` runs every concurrency level on one server; :func:`run_rounds` runs them on several
  servers in alternating rounds, so the machine's drift during a run falls on both sides alike.

Invariant: requests carry ``nocapture:`` rids, so a capturing server never writes shards for them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from eaglenest.contract import NO_CAPTURE_RID_PREFIX
from eaglenest.extraction.aio import run_sync


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
    prompt: int = -1
    """The prompt's index in the whole prompt set (a round drives a slice of it)."""
    digest: str | None = None
    """A short hash of the answer's tokens (its text where the server returns no ids): equal answers, equal digests."""


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
    answers: list[list[Any]] | None = None
    """Per answered request: [prompt, completion_tokens, spec_verify_ct, spec_correct_drafts, digest]."""

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


def _accept(rows: Sequence[list[Any]]) -> float | None:
    """Accept length over answers' rows (LevelResult.answers): (correct drafts + verifies) / verifies, or completion
    tokens / verifies where the server reports no correct drafts (older servers: counts the prefill's token too)."""
    verify = sum(r[2] for r in rows)
    if not verify:
        return None
    if all(r[3] is not None for r in rows if r[2]):
        return (sum(r[3] or 0 for r in rows) + verify) / verify
    return sum(r[1] for r in rows if r[2]) / verify


def summarize_level(concurrency: int, records: Sequence[RequestRecord], duration_s: float) -> LevelResult:
    ok = [r for r in records if r.ok]
    lat = [r.latency_s for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    answers = [[r.prompt, r.completion_tokens, r.spec_verify_ct, r.spec_correct_drafts, r.digest] for r in ok]
    errs = [r.error for r in records if not r.ok]
    return LevelResult(
        concurrency=concurrency, requests=len(records), errors=len(errs), duration_s=duration_s,
        output_tokens=tokens, output_tok_s=tokens / duration_s if duration_s > 0 else 0.0,
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        latency_mean_s=sum(lat) / len(lat) if lat else float("nan"), latency_p50_s=percentile(lat, 50),
        latency_p90_s=percentile(lat, 90), latency_p99_s=percentile(lat, 99), accept_length=_accept(answers),
        first_error=errs[0] if errs else None, answers=answers,
    )


def compare_answers(a: LevelResult, b: LevelResult) -> dict[str, Any] | None:
    """Two levels over the same prompts, paired: how many prompts each answered token for token alike, and each
    side's accept length over those prompts alone (None where a side does not speculate). Greedy answers diverge
    between servers where a near-tie flips under other kernels or batch shapes, so two drafters' live accept lengths
    are measured on partly different answers; over the identical ones they are paired. None without answers."""
    if not a.answers or not b.answers:
        return None
    first_a: dict[int, list[Any]] = {}
    first_b: dict[int, list[Any]] = {}
    for rows, first in ((a.answers, first_a), (b.answers, first_b)):
        for row in rows:
            first.setdefault(row[0], row)
    common = sorted(set(first_a) & set(first_b))
    same = [p for p in common if first_a[p][4] is not None and first_a[p][4] == first_b[p][4]]
    return {"prompts": len(common), "identical": len(same),
            "accept_a": _accept([first_a[p] for p in same]), "accept_b": _accept([first_b[p] for p in same])}


def answer_digest(body: dict[str, Any]) -> str | None:
    """A /generate answer's digest: of its output ids where the server returns them, else of its text."""
    out = body.get("output_ids")
    key = ",".join(map(str, out)) if isinstance(out, list) else body.get("text")
    return None if key is None else hashlib.sha1(str(key).encode()).hexdigest()[:16]


async def _one(client: httpx.AsyncClient, url: str, index: int, ids: list[int], params: dict[str, Any],
               rid: str, clock: Callable[[], float], prompt: int) -> RequestRecord:
    t0 = clock()
    try:
        r = await client.post(f"{url}/generate", json={"input_ids": ids, "rid": rid, "sampling_params": params})
    except httpx.HTTPError as e:
        return RequestRecord(index=index, ok=False, latency_s=clock() - t0, prompt_tokens=len(ids),
                             error=f"{type(e).__name__}: {e}", prompt=prompt)
    latency = clock() - t0
    if r.status_code != 200:
        return RequestRecord(index=index, ok=False, latency_s=latency, prompt_tokens=len(ids),
                             error=f"HTTP {r.status_code}: {r.text[:300]}", prompt=prompt)
    body = r.json() or {}
    meta = body.get("meta_info") or {}
    return RequestRecord(index=index, ok=True, latency_s=latency, prompt_tokens=len(ids), prompt=prompt,
                         digest=answer_digest(body),
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
    tag: str, prompt_index: Sequence[int] | None = None,
) -> tuple[list[RequestRecord], float]:
    """The records (by index) and wall time of one closed-loop level (``prompt_index``: each prompt's index in the
    whole set, where ``prompts`` is a slice of it)."""
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
                k = i % len(prompts)
                records.append(await _one(client, url, i, list(prompts[k]), params, rid, clock,
                                          prompt_index[k] if prompt_index is not None else k))

        t0 = clock()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
        duration = clock() - t0
    return sorted(records, key=lambda r: r.index), duration


def requests_for(concurrency: int, num_prompts: int, *, min_waves: int = 2) -> int:
    """Enough requests that the level spends most of its time at full concurrency."""
    return max(num_prompts, min_waves * concurrency)


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
                    clock=time.perf_counter, tag=f"{name}-r{r}", prompt_index=range(r, len(prompts), rounds)))
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
