"""A pool of engine servers: given URLs, or N launched servers (:mod:`eaglenest.engines.pool` starts and stops
each process).

Owns the launch order, relaunches and late joins:

- Servers start in parallel, except those of one launch group (servers sharing a GPU, each sizing its memory
  from what is free when it starts): one after another, each once the previous is ready.
- By default :meth:`ServerPool.start` returns when every server is ready, and a failed launch stops every
  server started, starts no more and raises :class:`LaunchError`.
- ``join_late``: :meth:`ServerPool.start` returns as soon as one server is ready; the rest keep launching in
  the background and each is announced to the :meth:`ServerPool.on_join` callbacks when ready, so work starts
  on the first server while the next ones load (on one H200 the second SGLang server of a GPU came up 77 s after
  the first). A launch failing once a server is ready is recorded in ``late_failures`` and starts no more of its
  group; the servers that are up keep serving.
- :meth:`ServerPool.revive` relaunches dead servers (bounded), never one still in its first launch.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eaglenest.engines.pool import LaunchError, ServerProcess, ServerRecords, free_port, probe_ready

State = Literal["pending", "launching", "ready", "failed", "retired"]


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """How to start one server: ``make(port)`` returns a not-yet-started ServerProcess (or any object with
    its ``start / wait_ready / alive / stop / url / pid`` interface, e.g. an in-thread server in tests)."""

    name: str
    make: Callable[[int], ServerProcess]
    launch_group: str | None = None
    """Servers of one group start one after another in spec order, each only once the previous is ready (SGLang
    servers sharing a GPU: each sizes its memory from what is free when it starts); groups, and servers
    without one, start in parallel."""


@dataclass(slots=True)
class _Owned:
    spec: LaunchSpec
    process: ServerProcess | None = None
    relaunches: int = 0
    state: State = "pending"


@dataclass
class ServerPool:
    """Given URLs (never launched, never killed) or launched servers, each its own process group (see the
    module's docstring for the launch order, ``join_late`` and relaunches)."""

    urls_given: Sequence[str] = ()
    specs: Sequence[LaunchSpec] = ()
    launch_timeout_s: float = 600.0
    max_relaunches: int = 3
    record_path: Path | None = None
    """Where the launched servers are recorded (``servers.json``), for crash teardown and the next run."""
    ready: Callable[[str], bool] = probe_ready
    port: Callable[[], int] = free_port
    join_late: bool = False
    """:meth:`start` returns once one server is ready; the others join later (:meth:`on_join`)."""
    late_failures: list[str] = field(default_factory=list, init=False)
    """``name: why`` of each server that failed to launch, or was retired, after the pool started serving."""
    ready_after_s: dict[str, float] = field(default_factory=dict, init=False)
    """Seconds from :meth:`start` until each server (by spec name) was first ready."""
    _owned: list[_Owned] = field(default_factory=list, init=False)
    launched: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _closing: bool = field(default=False, init=False)
    _records: ServerRecords | None = field(default=None, init=False)
    _serving: threading.Event = field(default_factory=threading.Event, init=False)
    _joins: list[Callable[[str], None]] = field(default_factory=list, init=False)
    _unannounced: list[_Owned] = field(default_factory=list, init=False)
    _t0: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if bool(self.urls_given) == bool(self.specs):
            raise ValueError("a ServerPool needs server URLs or launch specs (exactly one of them)")
        self._owned = [_Owned(s) for s in self.specs]
        self._records = ServerRecords(self.record_path) if self.record_path is not None else None
        if self.ready is probe_ready:  # a probe never waits longer than the launch bound
            self.ready = functools.partial(probe_ready, timeout_s=min(30.0, self.launch_timeout_s))

    def __enter__(self) -> ServerPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def urls(self) -> list[str]:
        """The given URLs, or those of the launched servers that are ready."""
        if self.urls_given:
            return [u.rstrip("/") for u in self.urls_given]
        with self._lock:
            return [o.process.url for o in self._owned if o.process is not None and o.state == "ready"]

    def live_urls(self) -> list[str]:
        """The given URLs, or those of the launched servers starting or ready (not failed, retired or replaced)."""
        if self.urls_given:
            return self.urls
        with self._lock:
            return [o.process.url for o in self._owned
                    if o.process is not None and o.state in ("launching", "ready") and o.process.alive()]

    def pids(self) -> list[int]:
        return [o.process.pid for o in self._owned
                if o.process is not None and o.process.pid is not None and o.process.alive()]

    def on_join(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(url)`` (on a launch thread) for each server that becomes ready after :meth:`start`
        returned (``join_late``); an exception in it retires that server. A server that became ready before
        the first callback was registered waits (not among :attr:`urls`) and is announced now, on this thread."""
        with self._lock:
            self._joins.append(callback)
            waiting, self._unannounced = self._unannounced, []
        for owned in waiting:
            self._announce(owned)

    def start(self) -> list[str]:
        if self.urls_given:
            down = [u for u in self.urls if not self.ready(u)]
            if down:
                raise LaunchError(f"given servers are not answering: {', '.join(down)} (start them, or let the "
                                  "extraction launch servers by leaving server_urls empty)")
            return self.urls
        if self._records is not None:  # servers a killed earlier run of the same extraction left behind
            self._records.end_all()
        self._closing = False
        self._serving.clear()
        self._t0 = time.monotonic()
        queues = self._launch_queues()
        ex = cf.ThreadPoolExecutor(len(queues), thread_name_prefix="launch")
        try:
            futures = [ex.submit(self._launch_in_order, q) for q in queues]
            if self.join_late:
                self._wait_serving(futures)
            else:
                done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)  # a failure stops all, whoever fails
                for f in [*done, *futures]:
                    f.result()
        except BaseException:  # a failed launch or a signal: end every group now (their waits then fail fast)
            self.stop()
            raise
        finally:
            ex.shutdown(wait=False)  # late joins go on in their threads
        return self.urls

    def _wait_serving(self, futures: Sequence[cf.Future]) -> None:
        """Until one server is ready; a launch failing before that fails the start."""
        while not self._serving.wait(0.05):
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            if all(f.done() for f in futures) and not self._serving.is_set():
                raise LaunchError("no server became ready")

    def _launch_queues(self) -> list[list[_Owned]]:
        """The servers of each launch group in spec order; a server without a group is a queue of its own."""
        queues: dict[tuple[str, object], list[_Owned]] = {}
        for i, o in enumerate(self._owned):
            key = ("group", o.spec.launch_group) if o.spec.launch_group is not None else ("alone", i)
            queues.setdefault(key, []).append(o)
        return list(queues.values())

    def _launch_in_order(self, queue: Sequence[_Owned]) -> None:
        for owned in queue:  # the next starts only once the previous is ready; a failure starts no more
            try:
                self._launch(owned, join=self.join_late)
            except Exception as e:
                with self._lock:
                    owned.state = "failed"
                    if not (self.join_late and self._serving.is_set()):
                        raise
                    if self._closing:  # the pool is stopping: a launch cut short is no failure
                        return
                    self.late_failures.append(f"{owned.spec.name}: {e}")
                if owned.process is not None:
                    self._stop_one(owned.process)
                return

    def _launch(self, owned: _Owned, *, join: bool = False) -> None:
        """Start one server and wait until it is ready. ``join``: one ready once the pool serves is announced to
        the :meth:`on_join` callbacks first, and counts among :attr:`urls` only once they took it."""
        proc = owned.spec.make(self.port())
        with self._lock:
            if self._closing:
                raise LaunchError("the pool is stopping; not launching")
            owned.process, owned.state = proc, "launching"
            proc.start()
            self.launched += 1
            if self._records is not None:
                self._records.add(proc)
        try:
            proc.wait_ready(timeout_s=self.launch_timeout_s, ready=self.ready)
        except BaseException:
            owned.state = "failed"
            raise
        with self._lock:
            self.ready_after_s.setdefault(owned.spec.name, round(time.monotonic() - self._t0, 1))
            late = join and self._serving.is_set()
            if not late:
                owned.state = "ready"
                self._serving.set()
                return
            if not self._joins:  # nobody to take it yet: on_join announces it
                self._unannounced.append(owned)
                return
        self._announce(owned)

    def _announce(self, owned: _Owned) -> None:
        """Hand a late server to every join callback; ready once all took it, retired when one refused."""
        with self._lock:
            callbacks = list(self._joins)
        url = owned.process.url if owned.process is not None else ""
        for cb in callbacks:
            try:
                cb(url)
            except Exception as e:  # the joiner refused it: it serves nobody, so it goes
                self.retire(url, f"refused when joining: {e}")
                return
        with self._lock:
            owned.state = "ready"

    def retire(self, url: str, why: str) -> None:
        """Stop a launched server that must not take work (e.g. it serves other numerics than the pool)."""
        for o in self._owned:
            if o.process is not None and o.process.url == url:
                with self._lock:
                    o.state = "retired"  # never relaunched
                    self.late_failures.append(f"{o.spec.name}: {why}")
                self._stop_one(o.process)

    def _stop_one(self, proc: ServerProcess) -> None:
        proc.stop()
        if self._records is not None:
            self._records.remove(proc)

    def stop(self) -> None:
        """Stop every launched server at once: each gets its grace period side by side, not one after another
        (two SGLang servers stopped in turn could keep a stopping run for twice the grace)."""
        with self._lock:
            self._closing = True
        procs = [o.process for o in self._owned if o.process is not None]
        if not procs:
            return
        with cf.ThreadPoolExecutor(len(procs), thread_name_prefix="stop") as ex:
            for f in [ex.submit(self._stop_one, proc) for proc in procs]:
                f.result()

    def revive(self) -> int:
        """Relaunch owned servers that died or stopped answering, one after another in spec order (so servers
        of one launch group restart in their first order); returns how many answer now. A server still in its
        first launch (``join_late``), never started after its group failed, or retired, is left alone; one whose launch
        group has a server still starting waits for it; with ``join_late`` a relaunched one joins like a late one.

        A relaunch runs the spec's command again, so a server sharing a GPU keeps the memory fraction it was
        first given (:func:`sglang_placements`). That is safe whichever of them died: SGLang holds that fraction
        of the memory free when IT starts and leaves the rest, and the last one started on a GPU finds what it
        found at first, while an earlier one now finds less (the later ones hold theirs), so it takes less than
        its share; either way the GPU keeps at least the headroom the first launch left. The cost: such a
        server's KV cache is smaller than at first, and when its weights leave no room SGLang refuses to start
        (a failed relaunch, counted in ``relaunches`` like any other)."""
        if self.urls_given:
            return sum(1 for u in self.urls if self.ready(u))
        healthy = 0
        for o in self._owned:
            p = o.process
            if o.state in ("pending", "launching", "retired"):
                continue
            if p is not None and p.alive() and self.ready(p.url):
                healthy += 1
                continue
            if o.relaunches >= self.max_relaunches:
                continue
            self._wait_for_group(o)  # never two servers of one GPU sizing their memory at once
            if p is not None:
                self._stop_one(p)
            o.relaunches += 1
            try:
                self._launch(o, join=self.join_late)  # a late joiner is vetted like the first time
                healthy += o.state == "ready"
            except LaunchError:
                if o.process is not None:
                    self._stop_one(o.process)
        return healthy

    def _wait_for_group(self, owned: _Owned, poll_s: float = 0.2) -> None:
        """Until no other server of its launch group is starting (at most the launch bound): a relaunch beside
        one would size its memory at the same time."""
        g = owned.spec.launch_group
        deadline = time.monotonic() + self.launch_timeout_s

        def starting() -> bool:
            with self._lock:
                return g is not None and any(o is not owned and o.spec.launch_group == g and o.state == "launching"
                                             and o not in self._unannounced for o in self._owned)

        while starting() and time.monotonic() < deadline:
            time.sleep(poll_s)

    @property
    def relaunches(self) -> int:
        return sum(o.relaunches for o in self._owned)
