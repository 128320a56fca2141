"""The engine client's vocabulary: its configuration, the jobs it runs, their outcomes and its statistics
(:mod:`eaglenest.extraction.client` runs them; it re-exports these names)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["retryable", "terminal"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientConfig:
    concurrency: int = 8
    """Requests in flight per server."""
    timeout_s: float = 600.0
    """Read/write timeout of one request (a hung server is abandoned after this)."""
    connect_timeout_s: float = 10.0
    max_attempts: int = 4
    """Tries per request for retryable errors (1 = no retry)."""
    backoff_s: float = 0.5
    backoff_max_s: float = 15.0
    down_after: int = 3
    """Consecutive connection failures (when ``/health`` then fails too), or max(down_after, concurrency)
    consecutive timeouts, after which a server takes no more work in this call."""
    probe_attempts: int = 3
    """``/health`` probes, ``probe_interval_s`` apart, each on a new connection, before a server whose requests
    failed to connect ``down_after`` times in a row is taken out: one failed probe is not enough (on the H100 on
    2026-12-05 both live servers were taken out at once after a burst of resets, which ended the round with
    18,233 samples to retry and aborted ~1,000 requests in flight)."""
    probe_interval_s: float = 1.0
    lanes: tuple[tuple[str, int], ...] = ()
    """Named lanes and their requests in flight per server, beside the default lane's ``concurrency``."""
    keepalive_expiry_s: float = 2.0
    """Idle connections are dropped after this, below the server's keep-alive timeout (SGLang's uvicorn: 5 s),
    so a request is not sent on a connection the server is closing (it fails without an answer)."""
    pool_size: int = 4
    """Workers per httpx connection pool (each pool holds one connection per worker, plus one spare: ``/health``
    probes open their own). httpcore's pool does O(connections) work, with syscalls, on every request event, so
    many small pools cost far less than one big one: at 1,024 in flight on 2 CPU cores, 4 per pool answered
    850-1,130 requests/s, one pool for all of them 23 (``scripts/bench_client.py``)."""

    def __post_init__(self) -> None:
        if (self.concurrency < 1 or self.max_attempts < 1 or self.down_after < 1 or self.pool_size < 1
                or self.probe_attempts < 1 or any(n < 1 for _, n in self.lanes)):
            raise ValueError("concurrency, lane sizes, max_attempts, down_after, pool_size and probe_attempts "
                             "must be >= 1")


Check = Callable[["Job", dict[str, Any]], str | None]
"""Answer check: returns a contract-violation message (terminal) or None."""


@dataclass(slots=True)
class Job:
    key: str
    """Sample id (capture) or a ``nocapture:`` rid (generation)."""
    body: dict[str, Any]
    payload: Any = None
    priority: int = 1
    """Lower is sent first: follow-up work (a conversation's next turn, a regenerated sample's capture)
    goes ahead of new conversations, so finished samples flow on while the engine's batch stays full."""
    check: Check | None = None
    """Contract check of this job's answer (overrides the call's ``check``)."""
    lane: str | None = None
    """A lane of ``ClientConfig.lanes`` (None: the default lane)."""
    attempts: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Answer:
    key: str
    server: str
    body: dict[str, Any]
    attempts: int
    latency_s: float
    payload: Any = None


@dataclass(frozen=True, slots=True)
class Failure:
    key: str
    kind: Kind
    reason: str
    """Short class: connection | timeout | server_error | client_error | conflict | disk_full | contract |
    server_unavailable."""
    message: str
    server: str | None
    attempts: int
    status: int | None = None
    payload: Any = None


@dataclass(slots=True)
class ClientStats:
    requests: int = 0
    retries: int = 0
    retry_errors: dict[str, int] = field(default_factory=dict)
    """Retried attempts by what went wrong (``'connection ReadError': 812``, ``'server_error HTTP 503': 3``)."""
    answered: int = 0
    failed: int = 0
    per_server: dict[str, int] = field(default_factory=dict)
    servers_down: list[str] = field(default_factory=list)
    down_reasons: list[str] = field(default_factory=list)
    """Per server taken out: its URL and the errors that took it out."""
    streaks_survived: int = 0
    """Streaks of connection failures after which the server still answered ``/health`` (it stayed in)."""
    pools: int = 0
    """httpx connection pools of the last call (``ClientConfig.pool_size`` workers each)."""


OnOutcome = Callable[[Answer | Failure], Iterable[Job] | None]
"""Called once per finished job; may return follow-up jobs (e.g. the next turn to regenerate)."""
