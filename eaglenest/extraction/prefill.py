"""Prefill with capture over the engine client: one request per sample, its answer checked.

- :func:`prefill` sends ``{input_ids, rid=sample_id, sampling_params.max_new_tokens=0}`` per sample
  (:func:`capture_request`) through :class:`~eaglenest.extraction.client.EngineClient`, longest first. The
  answer need not carry ``meta_info.capture`` (SGLang's does not); when it does, it is checked
  (:func:`check_capture_answer`: shard name, token count, no prefix-cache reuse).
- :data:`CAPTURE_LANE`: the client lane of captures while the target regenerates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from eaglenest import contract
from eaglenest.data.samples import Sample
from eaglenest.extraction.aio import run_sync
from eaglenest.extraction.client import Answer, ClientConfig, ClientStats, EngineClient, Failure, Job

CAPTURE_LANE = "capture"
"""The lane of capture requests while the target regenerates (their own workers beside the generations')."""


@dataclass(slots=True)
class PrefillResult:
    answers: dict[str, Answer] = field(default_factory=dict)
    failures: dict[str, Failure] = field(default_factory=dict)
    stats: ClientStats = field(default_factory=ClientStats)
    tokens: int = 0
    """Prompt tokens of the answered samples."""
    elapsed_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    done: int
    failed: int
    total: int
    tokens: int
    requests: int
    retries: int


def capture_request(sample: Sample) -> dict[str, Any]:
    return {"input_ids": sample.input_ids.tolist(), "rid": sample.sample_id,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}


def check_capture_answer(job: Job, body: dict[str, Any]) -> str | None:
    """Contract checks on a capture answer (meta_info.capture is optional; checked when present)."""
    sample: Sample = job.payload
    meta = body.get("meta_info") or {}
    if not isinstance(meta, dict):
        return "meta_info is not an object"
    t = sample.num_tokens
    if isinstance(meta.get("prompt_tokens"), int) and meta["prompt_tokens"] != t:
        return f"server computed {meta['prompt_tokens']} prompt tokens for {sample.sample_id!r}, {t} were sent"
    if isinstance(meta.get("cached_tokens"), int) and meta["cached_tokens"] > 0:
        return (f"server reused {meta['cached_tokens']} cached prompt tokens for {sample.sample_id!r}: capture needs "
                "every token computed in the request's prefill (launch SGLang with --disable-radix-cache)")
    cap = meta.get("capture")
    if cap is None:
        return None
    if not isinstance(cap, dict):
        return "meta_info.capture is not an object"
    want = contract.shard_filename(sample.sample_id)
    if cap.get("shard") not in (None, want):
        return f"server wrote shard {cap.get('shard')!r} for {sample.sample_id!r}, expected {want!r}"
    if cap.get("num_tokens") not in (None, t):
        return f"server captured {cap.get('num_tokens')} tokens for {sample.sample_id!r}, {t} were sent"
    return None


async def prefill_async(
    samples: Sequence[Sample], servers: Sequence[str], *, config: ClientConfig | None = None,
    transport: httpx.AsyncBaseTransport | None = None, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    on_progress: Callable[[PrefillProgress], None] | None = None,
) -> PrefillResult:
    """Prefill every sample once (rid = sample id) across ``servers``; longest first."""
    client = EngineClient(servers, config=config, transport=transport, sleep=sleep)
    result = PrefillResult(stats=client.stats)
    ordered = sorted(samples, key=lambda s: -s.num_tokens)  # long ones first: less tail latency

    def on_outcome(o: Answer | Failure) -> None:
        if isinstance(o, Answer):
            result.answers[o.key] = o
            result.tokens += o.payload.num_tokens
        else:
            result.failures[o.key] = o
        if on_progress is not None:
            s = client.stats
            on_progress(PrefillProgress(len(result.answers), len(result.failures), len(ordered), result.tokens,
                                        s.requests, s.retries))

    t0 = time.perf_counter()
    await client.run((Job(s.sample_id, capture_request(s), payload=s) for s in ordered),
                     check=check_capture_answer, on_outcome=on_outcome)
    result.elapsed_s = time.perf_counter() - t0
    return result


def prefill(samples: Sequence[Sample], servers: Sequence[str], **kwargs: Any) -> PrefillResult:
    """Blocking :func:`prefill_async`."""
    return run_sync(lambda: prefill_async(samples, servers, **kwargs))
