"""Simulate the regenerate -> capture pipeline's request order with the extraction's own client, no GPU.

    python scripts/sim_capture_schedule.py [--samples 10000] [--servers 2] [--concurrency 1024]
        [--gen-tok-s 18300] [--capture-tok-s 35000] [--tokens 574] [--scale 5]

:class:`~eaglenest.extraction.client.EngineClient` runs ``--samples`` generation requests over ``--servers`` x
``--concurrency`` workers against an in-process mock (``httpx.MockTransport``): a generation answers after its
answer length / per-request decode rate (``--gen-tok-s`` shared by every request in flight; 58.66% of answers
cut at 512 tokens, the rest 30-500, as in the H200's 10K ShareGPT regeneration); each finished sample queues
its capture, served by one resource at ``--capture-tok-s`` (``--tokens`` per sample). Time runs ``--scale``
times faster than printed. Three schedules are compared: every job at one priority (FIFO: what the extraction
did before), :mod:`eaglenest.extraction.stream`'s priorities (capture before new conversations) on shared
slots, and the same with the captures in their own lane (``concurrency // 4``, the default). A request's decode
rate is fixed, so a capture holding a slot lowers the generation rate, as on the H200. Printed: when
the last generation and the last capture answered, and how far capture lagged. A model of the queue only: the
GPU time that capture takes from decoding is not modelled (so the generation end moves little).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from eaglenest.extraction.client import Answer, ClientConfig, EngineClient, Failure, Job
from eaglenest.extraction.config import default_capture_concurrency
from eaglenest.extraction.prefill import CAPTURE_LANE
from eaglenest.extraction.stream import CAPTURE, NEW_CONVERSATION


def simulate(a: argparse.Namespace, *, capture_priority: int, new_priority: int,
             capture_lane: int = 0) -> dict[str, float]:
    rng = random.Random(0)
    lengths = [512 if rng.random() < 0.5866 else rng.randint(30, 500) for _ in range(a.samples)]
    per_request = a.gen_tok_s / (a.servers * a.concurrency)  # tok/s of one request with every worker busy
    capture_lock = asyncio.Lock()
    t0 = time.perf_counter()
    regen_done: list[float] = []
    capture_done: list[float] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        rid = json.loads(request.content)["rid"]
        if rid.startswith("nocapture:"):
            await asyncio.sleep(lengths[int(rid.rsplit(":", 1)[1])] / per_request / a.scale)
        else:
            async with capture_lock:
                await asyncio.sleep(a.tokens / a.capture_tok_s / a.scale)
        return httpx.Response(200, json={"text": "", "meta_info": {}})

    def on_outcome(o: Answer | Failure) -> list[Job]:
        now = (time.perf_counter() - t0) * a.scale
        if not o.key.startswith("nocapture:"):
            capture_done.append(now)
            return []
        regen_done.append(now)
        sid = o.key.rsplit(":", 1)[1]
        return [Job(f"s{sid}", {"rid": f"s{sid}"}, priority=capture_priority,
                    lane=CAPTURE_LANE if capture_lane else None)]

    lanes = ((CAPTURE_LANE, capture_lane),) if capture_lane else ()
    client = EngineClient([f"http://sim-{k}" for k in range(a.servers)],
                          config=ClientConfig(concurrency=a.concurrency, lanes=lanes),
                          transport=httpx.MockTransport(answer))
    jobs = [Job(f"nocapture:{i}", {"rid": f"nocapture:{i}"}, priority=new_priority) for i in range(a.samples)]
    asyncio.run(client.run(jobs, on_outcome=on_outcome))
    at = regen_done[int(0.9 * len(regen_done))]
    lags = sorted(c - r for c, r in zip(sorted(capture_done), sorted(regen_done), strict=True))
    return {"last_generation_s": regen_done[-1], "last_capture_s": capture_done[-1], "at_90pct_generated_s": at,
            "captured_then": sum(1 for c in capture_done if c <= at), "median_capture_lag_s": lags[len(lags) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1024)
    ap.add_argument("--gen-tok-s", type=float, default=18_300)
    ap.add_argument("--capture-tok-s", type=float, default=35_000)
    ap.add_argument("--tokens", type=int, default=574)
    ap.add_argument("--scale", type=float, default=5.0)
    a = ap.parse_args()
    lane = default_capture_concurrency(a.concurrency)
    for name, cap, new, own in (("one priority (FIFO)", 0, 0, 0), ("capture first", CAPTURE, NEW_CONVERSATION, 0),
                                (f"capture lane ({lane})", CAPTURE, NEW_CONVERSATION, lane)):
        r = simulate(a, capture_priority=cap, new_priority=new, capture_lane=own)
        print(f"{name:<20} last generation {r['last_generation_s']:6.0f} s, last capture {r['last_capture_s']:6.0f} s; "
              f"at 90% generated ({r['at_90pct_generated_s']:.0f} s) {r['captured_then']} captured; median capture "
              f"lag {r['median_capture_lag_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
