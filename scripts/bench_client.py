"""Benchmark the engine client's own cost: requests per second against a server that answers at once.

    python scripts/bench_client.py [--concurrency 1024] [--requests 20000] [--delay 0.2] [--pool-size 16 100000]
                                   [--rounds 3]

A minimal HTTP/1.1 server (asyncio streams, keep-alive, one small JSON answer per ``POST /generate`` after
``--delay`` seconds, so ``--concurrency`` requests are in flight like long generations) runs in a subprocess
of its own process group; :class:`eaglenest.extraction.client.EngineClient` sends ``--requests`` jobs to it
with each ``--pool-size`` in turn, alternating over ``--rounds`` (best and median of each). A pool size at
least the concurrency is one pool for all workers (the client before pools were split). Prints requests/s,
the client's CPU seconds per 1,000 requests, and the ratio of the first pool size to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

SERVER = r"""
import asyncio, sys
DELAY = float(sys.argv[2])
BODY = b'{"text": "ok", "meta_info": {"id": "x", "completion_tokens": 1}}'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY)

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            size = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    size = int(line.split(b":", 1)[1])
            await reader.readexactly(size)
            if DELAY:
                await asyncio.sleep(DELAY)
            writer.write(HEAD + BODY)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(url: str, concurrency: int, requests: int, pool_size: int) -> dict:
    from eaglenest.extraction.client import ClientConfig, EngineClient, Failure, Job

    client = EngineClient([url], config=ClientConfig(concurrency=concurrency, pool_size=pool_size,
                                                     keepalive_expiry_s=30.0))
    jobs = [Job(f"nocapture:{i}", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
            for i in range(requests)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    outcomes = asyncio.run(client.run(jobs))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    failed = sum(isinstance(o, Failure) for o in outcomes)
    return {"pool_size": pool_size, "pools": client.stats.pools, "requests_per_s": round(requests / wall, 1),
            "client_cpu_s_per_1k": round(1000 * cpu / requests, 3), "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--delay", type=float, default=0.2, help="seconds the server holds each request")
    ap.add_argument("--pool-size", type=int, nargs="+", default=[16, 100000])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(a.delay)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("the benchmark server did not start")
        url = f"http://127.0.0.1:{port}"
        runs: dict[int, list[dict]] = {p: [] for p in a.pool_size}
        for r in range(a.rounds):
            for p in a.pool_size:  # alternate the sides within each round
                res = one_round(url, a.concurrency, a.requests, p)
                runs[p].append(res)
                print(json.dumps({"round": r, **res}), flush=True)
        summary = {}
        for p, rs in runs.items():
            rates = [x["requests_per_s"] for x in rs]
            summary[p] = {"best": max(rates), "median": statistics.median(rates),
                          "client_cpu_s_per_1k_best": min(x["client_cpu_s_per_1k"] for x in rs),
                          "pools": rs[0]["pools"], "failed": sum(x["failed"] for x in rs)}
        first, last = a.pool_size[0], a.pool_size[-1]
        print(json.dumps({"concurrency": a.concurrency, "requests": a.requests, "delay_s": a.delay,
                          "rounds": a.rounds, "by_pool_size": summary,
                          f"ratio_{first}_vs_{last}_median": round(summary[first]["median"] / summary[last]["median"],
                                                                   2)}, indent=1))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
