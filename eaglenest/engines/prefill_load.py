"""Prefill-only load for throughput measurements (benchmark scripts and GPU checks).

Owns the two ways the measurements drive a server's ``/generate`` with ``max_new_tokens=0``:

- :func:`send_all`: one request per prompt, ``concurrency`` in flight (async httpx), in the given order;
  returns the wall time.
- :func:`batched_prefill`: prompts in batched requests from a few client threads; returns tok/s and the
  capture bytes/s the answers' receipts report.

Rids are ``<tag>-<i>``: a tag starting with ``nocapture:`` keeps a capturing server from writing shards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time
from collections.abc import Sequence

import httpx


async def send_all(url: str, prompts: Sequence[list[int]], concurrency: int, tag: str, *,
                   timeout_s: float = 3600.0) -> float:
    """Every prompt once, ``concurrency`` requests in flight; the seconds from first send to last answer."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def one(i: int, ids: list[int]) -> None:
            async with sem:
                r = await client.post(f"{url}/generate", json={
                    "input_ids": ids, "rid": f"{tag}-{i}", "sampling_params": {"max_new_tokens": 0}})
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t0


def batched_prefill(url: str, data: Sequence[list[int]], tag: str, batch: int, threads: int = 8) -> dict:
    """``data`` in batched /generate requests from ``threads`` client threads; tok/s and capture bytes/s."""
    chunks = [(list(data[i:i + batch]), [f"{tag}-{i + j}" for j in range(len(data[i:i + batch]))])
              for i in range(0, len(data), batch)]
    nbytes = [0]

    def send(chunk):
        ids, rids = chunk
        body = {"input_ids": ids, "rid": rids, "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
        r = httpx.post(f"{url}/generate", json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{tag}: HTTP {r.status_code}: {r.text[:300]}")
        for ans in r.json():
            nbytes[0] += (ans["meta_info"].get("capture") or {}).get("bytes", 0)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, chunks))
    wall = time.perf_counter() - t0
    tokens = sum(len(p) for p in data)
    return {"tag": tag, "tokens": tokens, "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1),
            "capture_bytes": nbytes[0], "capture_bytes_per_s": round(nbytes[0] / wall, 1)}
