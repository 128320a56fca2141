"""SGLang servers sharing a GPU: the flags each gets, the pool's launch order (one after another per GPU, GPUs in
parallel), a failed launch, and relaunch; all on CPU with fake servers."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from eaglenest.engines.pool import LaunchError, ServerProcess
from eaglenest.engines.server_pool import LaunchSpec, ServerPool
from eaglenest.engines.sglang_flags import DEFAULT_SHARED_MEM_FRACTION, SglangPlacement, sglang_placements
from eaglenest.engines.sglang_guards import split_flags

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def flags_of(args: list[str], *, num_servers: int, gpus: int) -> list[list[str]]:
    return [p.flags(args) for p in sglang_placements(args, num_servers=num_servers, gpus=gpus)]


def gpu_and_fraction(flags: list[str]) -> tuple[str | None, str | None]:
    given = dict(split_flags(flags))
    return given.get("--base-gpu-id"), given.get("--mem-fraction-static")


@pytest.mark.parametrize(("num_servers", "gpus", "args", "expected"), [
    (2, 1, [], [("0", "0.4"), ("0", "0.666")]),
    (3, 2, [], [("0", "0.4"), ("1", None), ("0", "0.666")]),  # GPU 1 alone: SGLang's own default
    (4, 2, [], [("0", "0.4"), ("1", "0.4"), ("0", "0.666"), ("1", "0.666")]),
    (2, 1, ["--mem-fraction-static", "0.6"], [("0", "0.3"), ("0", "0.428")]),  # the user's value is the total
    (3, 2, ["--mem-fraction-static=0.6"], [("0", "0.3"), ("1", "0.6"), ("0", "0.428")]),
    (4, 1, [], [("0", "0.2"), ("0", "0.25"), ("0", "0.333"), ("0", "0.5")]),
    (2, 2, [], [("0", None), ("1", None)]),  # one GPU each: nothing shared, nothing changed
    (2, 4, ["--base-gpu-id", "3"], [("3", "0.4"), ("3", "0.666")]),  # the user's GPU holds them all
])
def test_flags_each_server_gets(num_servers, gpus, args, expected):
    flags = flags_of(args, num_servers=num_servers, gpus=gpus)
    assert [gpu_and_fraction(f) for f in flags] == expected
    for f in flags:  # exactly one of each: the user's value is replaced, never doubled
        named = [flag for flag, _ in split_flags(f)]
        assert named.count("--base-gpu-id") == 1 and named.count("--mem-fraction-static") <= 1


def test_servers_sharing_a_gpu_form_one_launch_group_and_the_rest_none():
    groups = [p.launch_group for p in sglang_placements([], num_servers=3, gpus=2)]
    assert groups == ["gpu-0", None, "gpu-0"]
    assert sglang_placements(["--tp-size", "2"], num_servers=1, gpus=1) == [SglangPlacement()]
    tp2 = flags_of(["--tp-size", "2"], num_servers=2, gpus=4)  # tensor parallel without sharing: as before
    assert tp2 == [["--tp-size", "2", "--base-gpu-id", "0"], ["--tp-size", "2", "--base-gpu-id", "2"]]


def sglang_memory(placements: list[SglangPlacement], order: list[int], *, gpu_gb: float = 100.0,
                  held: dict[int, float] | None = None) -> tuple[dict[int, float], dict[str, float]]:
    """SGLang 0.5.17's sizing: a server starting with ``free`` memory on its GPU holds ``fraction * free``
    (weights + KV cache) and leaves the rest. Returns what each server holds and what each GPU has left."""
    held = dict(held or {})
    free: dict[str, float] = {}
    for p in placements:
        free.setdefault(str(p.base_gpu_id), gpu_gb)
    for i, p in enumerate(placements):
        if i in held:
            free[str(p.base_gpu_id)] -= held[i]
    for i in order:
        p = placements[i]
        held[i] = (p.mem_fraction_static or DEFAULT_SHARED_MEM_FRACTION) * free[str(p.base_gpu_id)]
        free[str(p.base_gpu_id)] -= held[i]
    return held, free


@pytest.mark.parametrize(("num_servers", "total"), [(2, 0.8), (3, 0.8), (4, 0.8), (5, 0.9), (8, 0.6)])
def test_in_launch_order_each_server_holds_its_share_and_the_headroom_stays(num_servers, total):
    places = sglang_placements(["--mem-fraction-static", str(total)], num_servers=num_servers, gpus=1)
    held, free = sglang_memory(places, list(range(num_servers)))
    share = 100.0 * total / num_servers
    assert all(abs(h - share) <= 0.01 * share for h in held.values())  # fractions rounded to 3 decimals
    assert free["0"] >= 100.0 * (1 - total)  # rounded down: the headroom is never eaten


@pytest.mark.parametrize("dead", [[0], [1], [2], [0, 2], [0, 1, 2, 3]])
def test_a_relaunch_with_the_first_fraction_never_takes_the_headroom(dead):
    """revive's contract: relaunching any dead sharing servers (in spec order) with their first fraction leaves
    the GPU at least the headroom of the first launch; only the relaunched ones may hold less than before."""
    places = sglang_placements([], num_servers=4, gpus=1)
    first, _ = sglang_memory(places, [0, 1, 2, 3])
    alive = {i: h for i, h in first.items() if i not in dead}
    held, free = sglang_memory(places, dead, held=alive)
    assert free["0"] >= 100.0 * (1 - DEFAULT_SHARED_MEM_FRACTION) - 1e-9
    assert all(held[i] <= first[i] + 1e-9 or i == max(dead) for i in dead)


@pytest.mark.parametrize(("args", "num_servers", "gpus", "match"), [
    (["--tp-size", "2"], 2, 2, "share GPUs only at tensor parallel 1"),
    (["--tp-size", "2", "--base-gpu-id", "0"], 2, 4, "share GPUs only at tensor parallel 1"),
    (["--tp-size", "4"], 2, 2, "tensor parallel 4 needs 4 GPUs; this host shows 2"),
    (["--mem-fraction-static", "1.2"], 2, 1, "between 0 and 1"),
    (["--mem-fraction-static", "lots"], 2, 1, "between 0 and 1"),
])
def test_placements_that_cannot_work_are_refused(args, num_servers, gpus, match):
    with pytest.raises(LaunchError, match=match):
        sglang_placements(args, num_servers=num_servers, gpus=gpus)


# ------------------------------------------------------------------------------ the pool's order
class FakeServer:
    """ServerProcess's interface; logs start and ready, becomes ready after ``ready_s`` (or ``gate``)."""

    def __init__(self, name: str, log: list[tuple[str, str]], lock: threading.Lock, *, ready_s: float = 0.05,
                 gate: Callable[[], None] | None = None) -> None:
        self.name, self.log, self.lock, self.ready_s, self.gate = name, log, lock, ready_s, gate
        self.url, self.pid, self.running = f"http://fake/{name}", None, False

    def _event(self, what: str) -> None:
        with self.lock:
            self.log.append((what, self.name))

    def start(self) -> FakeServer:
        self.running = True
        self._event("start")
        return self

    def wait_ready(self, *, timeout_s: float, ready: Callable[[str], bool], poll_s: float = 0.01) -> None:
        if self.gate is not None:
            self.gate()
        time.sleep(self.ready_s)
        self._event("ready")

    def alive(self) -> bool:
        return self.running

    def stop(self) -> None:
        self.running = False


def fake_pool(groups: list[str | None], *, gates: dict[str, Callable[[], None]] | None = None
              ) -> tuple[ServerPool, list[tuple[str, str]], list[str]]:
    log: list[tuple[str, str]] = []
    made: list[str] = []
    lock = threading.Lock()

    def spec(i: int, group: str | None) -> LaunchSpec:
        def make(port: int) -> FakeServer:
            made.append(f"s{i}")
            return FakeServer(f"s{i}", log, lock, gate=(gates or {}).get(f"s{i}"))
        return LaunchSpec(f"s{i}", make, launch_group=group)

    pool = ServerPool(specs=[spec(i, g) for i, g in enumerate(groups)], ready=lambda url: True,
                      port=lambda: 0, launch_timeout_s=10)
    return pool, log, made


def test_servers_on_one_gpu_start_one_after_another_and_gpus_in_parallel():
    both_waiting = threading.Barrier(2, timeout=5)  # s0 and s1 are starting at the same time, or this breaks
    groups = [p.launch_group for p in sglang_placements([], num_servers=4, gpus=2)]
    pool, log, _ = fake_pool(groups, gates={"s0": both_waiting.wait, "s1": both_waiting.wait})
    with pool:
        assert len(pool.urls) == 4
    at = {event: i for i, event in enumerate(log)}
    assert at["start", "s2"] > at["ready", "s0"]  # GPU 0: the next starts only once the previous is ready
    assert at["start", "s3"] > at["ready", "s1"]  # GPU 1 likewise
    assert at["start", "s1"] < at["ready", "s0"]  # the two GPUs in parallel


def test_a_failed_first_launch_on_a_gpu_starts_no_more_stops_the_rest_and_shows_its_log(tmp_path: Path):
    oom = ("import sys; print('ValueError: Loaded weights leave no GPU memory for the KV cache', flush=True); "
           "sys.exit(1)")
    made: list[str] = []

    def spec(name: str, cmd: list[str], group: str | None) -> LaunchSpec:
        def make(port: int) -> ServerProcess:
            made.append(name)
            return ServerProcess(cmd=cmd, url=f"http://127.0.0.1:{port}", log_path=tmp_path / f"{name}.log")
        return LaunchSpec(name, make, launch_group=group)

    # another GPU's server that is still loading is listed first: the failure must not wait for it
    pool = ServerPool(specs=[spec("other-gpu", SLEEPER, None), spec("first", [sys.executable, "-c", oom], "gpu-0"),
                             spec("second", SLEEPER, "gpu-0")],
                      ready=lambda url: False, launch_timeout_s=120, record_path=tmp_path / "servers.json")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="exited with code 1") as err:
        pool.start()
    assert time.monotonic() - t0 < 30  # not the other server's 120 s launch bound
    assert "no GPU memory for the KV cache" in str(err.value)  # the log tail says why
    assert "second" not in made  # never started after the first on its GPU failed
    other = pool._owned[0].process
    assert other is not None and not other.alive()  # the other GPU's server was stopped
    assert not (tmp_path / "servers.json").exists()


def test_revive_relaunches_dead_sharing_servers_in_order_with_their_first_flags(tmp_path: Path):
    places = sglang_placements([], num_servers=2, gpus=1)
    log: list[tuple[str, str]] = []
    lock = threading.Lock()
    launched: list[tuple[str, list[str]]] = []

    def spec(i: int) -> LaunchSpec:
        def make(port: int) -> FakeServer:
            launched.append((f"s{i}", places[i].flags([])))
            return FakeServer(f"s{i}", log, lock)
        return LaunchSpec(f"s{i}", make, launch_group=places[i].launch_group)

    pool = ServerPool(specs=[spec(0), spec(1)], ready=lambda url: True, port=lambda: 0, max_relaunches=2)
    with pool:
        first = list(launched)
        for o in pool._owned:  # the GPU went away under both
            o.process.stop()
        log.clear()
        assert pool.revive() == 2
        assert launched[2:] == first  # same order, same --base-gpu-id and --mem-fraction-static
        assert log == [("start", "s0"), ("ready", "s0"), ("start", "s1"), ("ready", "s1")]
        pool._owned[0].process.stop()  # only the first on its GPU dies: relaunched as it was, the other stays
        assert pool.revive() == 2 and launched[4:] == first[:1] and pool.relaunches == 3


# ------------------------------------------------------------------------------ late joins
class FailingServer(FakeServer):
    def wait_ready(self, *, timeout_s: float, ready: Callable[[str], bool], poll_s: float = 0.01) -> None:
        if self.gate is not None:
            self.gate()
        raise LaunchError(f"{self.name} exited with code 1 before becoming ready")


def late_pool(kinds: list[type[FakeServer]], gates: dict[str, Callable[[], None]]) -> tuple[ServerPool, list]:
    log: list[tuple[str, str]] = []
    lock = threading.Lock()
    places = sglang_placements([], num_servers=len(kinds), gpus=1)  # one GPU: one launch group

    def spec(i: int) -> LaunchSpec:
        def make(port: int) -> FakeServer:
            return kinds[i](f"s{i}", log, lock, gate=gates.get(f"s{i}"))
        return LaunchSpec(f"s{i}", make, launch_group=places[i].launch_group)

    pool = ServerPool(specs=[spec(i) for i in range(len(kinds))], ready=lambda url: True, port=lambda: 0,
                      launch_timeout_s=10, join_late=True)
    return pool, log


def test_join_late_serves_from_the_first_ready_server_and_announces_the_next():
    release = threading.Event()
    pool, log = late_pool([FakeServer, FakeServer, FakeServer], {"s1": lambda: release.wait(5)})
    joined: list[str] = []
    pool.on_join(joined.append)
    try:
        assert pool.start() == ["http://fake/s0"]  # s1 (same GPU, after s0) still loading
        assert ("start", "s1") in log and ("ready", "s1") not in log
        assert pool.revive() == 1  # a server in its first launch is not relaunched
        release.set()
        deadline = time.monotonic() + 5
        while len(joined) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert joined == ["http://fake/s1", "http://fake/s2"] and len(pool.urls) == 3
        assert set(pool.ready_after_s) == {"s0", "s1", "s2"} and pool.late_failures == [] and pool.relaunches == 0
    finally:
        pool.stop()


def test_join_late_a_late_failure_is_recorded_and_the_served_servers_stay():
    pool, log = late_pool([FakeServer, FailingServer, FakeServer], {})
    with pool:
        deadline = time.monotonic() + 5
        while not pool.late_failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.urls == ["http://fake/s0"] and pool._owned[0].process.alive()
        assert len(pool.late_failures) == 1 and pool.late_failures[0].startswith("s1: s1 exited with code 1")
        assert ("start", "s2") not in log  # the failed one's GPU starts no more


def test_join_late_a_failure_before_any_server_is_ready_fails_the_start():
    pool, _ = late_pool([FailingServer, FakeServer], {})
    with pytest.raises(LaunchError, match="s0 exited"):
        pool.start()
    assert pool.urls == [] and not any(o.process and o.process.alive() for o in pool._owned)


def test_join_late_a_server_refused_when_joining_is_retired_and_never_relaunched():
    pool, _ = late_pool([FakeServer, FakeServer], {})

    def refuse(url: str) -> None:
        raise ValueError("serves other numerics")

    pool.on_join(refuse)
    with pool:
        deadline = time.monotonic() + 5
        while not pool.late_failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.late_failures == ["s1: refused when joining: serves other numerics"]
        assert pool.urls == ["http://fake/s0"] and not pool._owned[1].process.alive()
        assert pool.revive() == 1 and pool.relaunches == 0


def test_join_late_a_server_ready_before_anyone_listens_waits_for_on_join():
    """The run registers its joiner only after its preflight of the first servers: one ready meanwhile is not
    served unvetted (not among urls) and is announced when the joiner comes."""
    pool, _ = late_pool([FakeServer, FakeServer], {})
    with pool:
        deadline = time.monotonic() + 5
        while "s1" not in pool.ready_after_s and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.urls == ["http://fake/s0"] and "http://fake/s1" in pool.live_urls()
        joined: list[str] = []
        pool.on_join(joined.append)
        assert joined == ["http://fake/s1"] and pool.urls == ["http://fake/s0", "http://fake/s1"]


def test_revive_waits_while_a_server_of_the_same_gpu_is_still_starting():
    release = threading.Event()
    pool, log = late_pool([FakeServer, FakeServer], {"s1": lambda: release.wait(5)})
    pool.on_join(lambda url: None)
    try:
        pool.start()
        pool._owned[0].process.stop()  # s0 dies while s1 (same GPU) is sizing its memory
        threading.Timer(0.3, release.set).start()
        assert pool.revive() == 2 and pool.relaunches == 1  # waited for s1, then relaunched s0
        at = {event: i for i, event in enumerate(log)}
        assert log.count(("start", "s0")) == 2 and at["ready", "s1"] < len(log) - 1 - log[::-1].index(("start", "s0"))
    finally:
        pool.stop()
