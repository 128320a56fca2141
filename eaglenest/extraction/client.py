"""The engine client: async httpx requests to one or more engine servers (data parallel).

Owns how requests reach servers and which failures are retried:

- :class:`EngineClient` runs jobs (one ``POST /generate`` each) through ``concurrency`` workers per
  server pulling from one queue, so a fast server takes more work and a dead one takes none. A job may
  name a lane (``ClientConfig.lanes``): its own queue and workers, so slow jobs of one kind (captures
  waiting for their shard) never take the slots of another (the generations that fill the decode batch).
  Workers share connection pools of at most ``pool_size``: httpcore scans every connection of a pool
  (a syscall each, and a quadratic count of idle ones) whenever a request starts or ends, so one pool of
  1,280 connections kept the request loop busy (64% of its time on the H200) while the GPU waited.
- Retryable (re-queued with exponential backoff + jitter, possibly to another server, up to
  ``max_attempts``): connection errors/resets, timeouts, 5xx except 507, 408, 429. Terminal (reported
  per job, never retried): other 4xx (400 bad request, 409 a rid whose shard on the server holds other
  tokens, 413 context, 422 capture invalid), 507 (disk full: the server is also taken out of the call,
  no retry storm), and contract violations in an answer (a job's or the call's check).
- A server with ``down_after`` consecutive connection failures whose ``/health`` does not answer either
  (``probe_attempts`` probes, each on a new connection) or a full window of timeouts is taken out of this
  call; when none is left, the rest fails fast as retryable ``server_unavailable`` (the caller relaunches).

Invariants: every job ends exactly once, as an :class:`Answer` or a :class:`Failure`; no request is
sent for a job after its terminal failure; the transport and the sleep function are injectable.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from eaglenest.extraction.client_types import (
    Answer,
    Check,
    ClientConfig,
    ClientStats,
    Failure,
    Job,
    Kind,
    OnOutcome,
)

__all__ = ["Answer", "Check", "ClientConfig", "ClientStats", "EngineClient", "Failure", "Job", "Kind", "OnOutcome"]


class _Attempt(Exception):
    def __init__(self, kind: Kind, reason: str, message: str, status: int | None = None,
                 retry_after: float | None = None, server_down: bool = False, error: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.reason, self.message, self.status = kind, reason, message, status
        self.retry_after, self.server_down = retry_after, server_down
        self.label = f"{reason} {error or (f'HTTP {status}' if status is not None else '')}".strip()
        """What went wrong, short enough to count by: 'connection ReadError', 'server_error HTTP 503'."""


@dataclass(slots=True)
class _Server:
    url: str
    down: bool = False
    failures: int = 0
    """Consecutive connection failures."""
    timeouts: int = 0
    """Consecutive timeouts."""
    probing: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One ``/health`` probe at a time; the workers failing meanwhile wait for its verdict."""


class EngineClient:
    def __init__(self, servers: Sequence[str], *, config: ClientConfig | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep, rng: random.Random | None = None) -> None:
        if not servers:
            raise ValueError("no server URLs given")
        self.config = config or ClientConfig()
        self._servers = [_Server(u.rstrip("/")) for u in servers]
        self._transport, self._sleep = transport, sleep
        self._rng = rng or random.Random()
        self.stats = ClientStats(per_server={s.url: 0 for s in self._servers})
        self._joining = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        """The running call's loop (None before and after it): :meth:`add_server` hands servers to it."""
        self._ended = False

    def add_server(self, url: str) -> bool:
        """Let one more server take work (from any thread): before :meth:`run` it is one of the servers, during
        it its workers start at once (a server that became ready late); False once the call ended."""
        url = url.rstrip("/")
        with self._joining:
            if self._ended:
                return False
            if self._loop is None:
                self._register(url)
                return True
            self._loop.call_soon_threadsafe(self._join, url)
            return True

    async def run(self, jobs: Iterable[Job], *, check: Check | None = None,
                  on_outcome: OnOutcome | None = None) -> list[Answer | Failure]:
        cfg = self.config
        timeout = httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)
        lanes: dict[str | None, int] = {None: cfg.concurrency, **dict(cfg.lanes)}
        self._queues: dict[str | None, asyncio.PriorityQueue[tuple[int, int, Job | None]]] = {
            lane: asyncio.PriorityQueue() for lane in lanes}
        self._seq = 0
        self._open = 0
        self._idle = asyncio.Event()
        self._outcomes: list[Answer | Failure] = []
        self._check, self._on_outcome = check, on_outcome
        self._backoffs: set[asyncio.Task] = set()
        self._crash: BaseException | None = None
        for job in jobs:
            self._add(job)
        if self._open == 0:
            return []
        self._lanes, self._timeout = lanes, timeout
        self._tls = httpx.create_ssl_context()  # one for all pools (building one costs ~20 ms)
        self._workers: list[asyncio.Task] = []
        self._pools: list[httpx.AsyncClient] = []
        with self._joining:
            self._loop = asyncio.get_running_loop()
            for server in self._servers:
                self._start_workers(server)
        finished = False
        try:
            await self._idle.wait()
            finished = self._crash is None
        finally:
            with self._joining:  # no server joins from here on
                self._loop, self._ended = None, True
            # a crash or a cancellation (a termination request) ends the in-flight requests now; only a
            # finished call lets the workers take their end marker, which queues behind any work left
            for task in [*self._backoffs, *(w for w in self._workers if not finished)]:
                task.cancel()
            for lane, n in lanes.items():
                for _ in range(n * len(self._servers)):
                    self._put(None, lane)
            await asyncio.gather(*self._workers, *self._backoffs, return_exceptions=True)
            for pool in self._pools:
                await pool.aclose()
        if self._crash is not None:
            raise self._crash
        return self._outcomes

    def _start_workers(self, server: _Server) -> None:
        """One server's workers (every lane), ``pool_size`` of them per connection pool."""
        cfg = self.config
        server.probing = asyncio.Lock()  # a lock belongs to the loop it is first used in: one per call
        slots = [lane for lane, n in self._lanes.items() for _ in range(n)]
        for i in range(0, len(slots), cfg.pool_size):
            group = slots[i : i + cfg.pool_size]
            limits = httpx.Limits(max_connections=len(group) + 1, keepalive_expiry=cfg.keepalive_expiry_s)
            pool = httpx.AsyncClient(timeout=self._timeout, limits=limits, transport=self._transport, verify=self._tls)
            self._pools.append(pool)
            self._workers += [asyncio.create_task(self._worker(pool, server, lane)) for lane in group]
        self.stats.pools = len(self._pools)

    def _join(self, url: str) -> None:
        """On the loop: a server that became ready during the call starts taking work."""
        server = self._register(url) if self._loop is not None else None
        if server is not None:
            self._start_workers(server)

    def _register(self, url: str) -> _Server | None:
        """A server not among this client's yet becomes one of them (None when it already is)."""
        if any(s.url == url for s in self._servers):
            return None
        server = _Server(url)
        self._servers.append(server)
        self.stats.per_server[url] = 0
        return server

    # ---------------------------------------------------------------- bookkeeping
    def _add(self, job: Job) -> None:
        if job.lane not in self._queues:
            raise ValueError(f"job {job.key!r} asks for lane {job.lane!r}; this client has "
                             f"{sorted(k for k in self._queues if k)} (ClientConfig.lanes) and the default")
        self._open += 1
        self._enqueue(job)

    def _put(self, job: Job | None, lane: str | None = None) -> None:
        self._seq += 1  # FIFO within a priority
        queue = self._queues[lane if job is None else job.lane]
        queue.put_nowait((1 << 30 if job is None else job.priority, self._seq, job))

    def _enqueue(self, job: Job) -> None:
        if all(s.down for s in self._servers):
            self._finish(Failure(job.key, "retryable", "server_unavailable",
                                 "no server left to take the request (all were taken out after failures: "
                                 + "; ".join(job.errors[-2:]) + ")", None, job.attempts, payload=job.payload))
        else:
            self._put(job)

    def _finish(self, outcome: Answer | Failure) -> None:
        self._outcomes.append(outcome)
        if isinstance(outcome, Answer):
            self.stats.answered += 1
        else:
            self.stats.failed += 1
        follow = self._on_outcome(outcome) if self._on_outcome else None
        for job in follow or ():
            self._add(job)
        self._open -= 1
        if self._open == 0:
            self._idle.set()

    def _take_down(self, server: _Server, errors: Sequence[str]) -> None:
        if server.down:
            return
        server.down = True
        self.stats.servers_down.append(server.url)
        self.stats.down_reasons.append(f"{server.url}: " + "; ".join(errors[-2:]))
        if all(s.down for s in self._servers):
            for queue in self._queues.values():
                while not queue.empty():
                    *_, job = queue.get_nowait()
                    if job is not None:
                        self._enqueue(job)

    async def _later(self, job: Job, delay: float) -> None:
        try:
            await self._sleep(delay)
            self._enqueue(job)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            if self._crash is None:
                self._crash = e
            self._idle.set()

    # ---------------------------------------------------------------- requests
    async def _worker(self, client: httpx.AsyncClient, server: _Server, lane: str | None) -> None:
        try:
            await self._work(client, server, lane)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a failing callback (or an interrupt) must end the call, not hang it
            if self._crash is None:
                self._crash = e
            self._idle.set()

    async def _work(self, client: httpx.AsyncClient, server: _Server, lane: str | None) -> None:
        queue = self._queues[lane]
        while True:
            *_, job = await queue.get()
            if job is None:
                return
            if server.down:  # hand the job to a live server and stop taking work
                self._enqueue(job)
                return
            job.attempts += 1
            self.stats.requests += 1
            self.stats.per_server[server.url] += 1
            t0 = time.perf_counter()
            try:
                body = await self._post(client, server, job)
            except _Attempt as e:
                job.errors.append(f"{server.url}: {e.message}")
                if e.server_down or (self._looks_dead(server, e.reason)
                                     and not await self._still_answers(server, e.reason)):
                    self._take_down(server, job.errors)
                if e.kind == "retryable" and job.attempts < self.config.max_attempts:
                    self.stats.retries += 1
                    self.stats.retry_errors[e.label] = self.stats.retry_errors.get(e.label, 0) + 1
                    delay = e.retry_after if e.retry_after is not None else self._backoff(job.attempts)
                    task = asyncio.create_task(self._later(job, delay))
                    self._backoffs.add(task)
                    task.add_done_callback(self._backoffs.discard)
                else:
                    msg = e.message if e.kind == "terminal" else f"gave up after {job.attempts} attempts: {e.message}"
                    self._finish(Failure(job.key, e.kind, e.reason, msg, server.url, job.attempts, e.status,
                                         payload=job.payload))
                continue
            server.failures = server.timeouts = 0
            self._finish(Answer(job.key, server.url, body, job.attempts, time.perf_counter() - t0, job.payload))

    def _looks_dead(self, server: _Server, reason: str) -> bool:
        """Connection failures in a row mean a dead server; timeouts need a full window of them (every
        in-flight request), so a merely slow server is not taken out."""
        if reason == "connection":
            return server.failures >= self.config.down_after
        if reason == "timeout":
            return server.timeouts >= max(self.config.down_after, self.config.concurrency)
        return False

    async def _still_answers(self, server: _Server, reason: str) -> bool:
        """After a streak of connection failures: does ``/health`` answer? Under load a live server can reset
        a burst of connections (keep-alive races, a full accept backlog); taking it out would fail everything
        queued and end the round (on the H200 this cost a round restart and about a minute of idle GPU). Each
        probe opens its own connection (a pooled one may be one the burst reset), up to ``probe_attempts``
        times. A live server stays in with its streak reset; timeouts are judged by their window alone."""
        if reason != "connection":
            return False
        cfg = self.config
        async with server.probing:
            if server.down or not self._looks_dead(server, reason):
                return not server.down  # a probe meanwhile decided
            alive = False
            probe = httpx.AsyncClient(timeout=cfg.connect_timeout_s, transport=self._transport, verify=self._tls,
                                      limits=httpx.Limits(max_keepalive_connections=0))
            try:
                for attempt in range(cfg.probe_attempts):
                    if attempt:
                        await self._sleep(cfg.probe_interval_s)
                    try:
                        alive = (await probe.get(f"{server.url}/health")).status_code == 200
                    except httpx.HTTPError:
                        alive = False
                    if alive:
                        break
            finally:
                if self._transport is None:  # (an injected transport is the workers' too: it stays open)
                    await probe.aclose()
            if alive:
                server.failures = 0
                self.stats.streaks_survived += 1
            return alive

    def _backoff(self, attempt: int) -> float:
        base = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (attempt - 1))
        return base * (0.5 + self._rng.random())

    async def _post(self, client: httpx.AsyncClient, server: _Server, job: Job) -> dict[str, Any]:
        try:
            r = await client.post(f"{server.url}/generate", json=job.body)
        except httpx.TimeoutException as e:
            server.timeouts += 1
            raise _Attempt("retryable", "timeout", f"timed out ({type(e).__name__})", error=type(e).__name__) from None
        except httpx.TransportError as e:
            server.failures += 1
            raise _Attempt("retryable", "connection", f"connection failed ({type(e).__name__}: {e})",
                           error=type(e).__name__) from None
        if r.status_code != 200:
            raise _classify_status(r)
        try:
            body = r.json()
        except ValueError:
            raise _Attempt("terminal", "contract", f"answer is not JSON (HTTP 200, {len(r.content)} bytes)") from None
        if not isinstance(body, dict):
            raise _Attempt("terminal", "contract", f"answer is a {type(body).__name__}, expected one JSON object")
        check = job.check or self._check
        problem = check(job, body) if check else None
        if problem:
            raise _Attempt("terminal", "contract", problem)
        return body


def _classify_status(r: httpx.Response) -> _Attempt:
    try:
        detail = r.json().get("error", {}).get("message") or r.text[:300]
    except (ValueError, AttributeError):
        detail = r.text[:300]
    msg = f"HTTP {r.status_code}: {detail}"
    code = r.status_code
    if code == 507:
        return _Attempt("terminal", "disk_full", msg + " (free disk space on the server, then re-run)", code,
                        server_down=True)
    if code >= 500 or code in (408, 429):
        retry_after = None
        if r.headers.get("retry-after", "").isdigit():
            retry_after = min(float(r.headers["retry-after"]), 60.0)
        return _Attempt("retryable", "server_error", msg, code, retry_after=retry_after)
    if code == 409:  # the rid's shard holds another request's tokens: resending cannot change that file
        return _Attempt("terminal", "conflict", msg, code)
    return _Attempt("terminal", "client_error", msg, code)
