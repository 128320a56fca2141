"""Shard checks in worker processes: the same verdicts as in threads, profiled and signal-proof processes that
end with their run, and the Validator's fallback to threads when a check pool breaks mid-round."""

import concurrent.futures as cf
import os
import time

import pytest
import torch

from eaglenest.extraction.checking import check_pool, default_check_processes
from eaglenest.extraction.validate import ValidateConfig
from tests.validate_helpers import H, check, prov, sample, shard_bytes


def test_checks_in_worker_processes_decide_what_checks_in_threads_decide(tmp_path):
    """ValidateConfig.processes: the shards are read and checked in spawned processes (a GPU host's request loop
    keeps the GIL busy) and every verdict, statistic and reason is the one of the threads: valid, non-finite,
    wrong provenance, below the argmax floor, missing; one pool serves batch after batch."""
    g = torch.Generator().manual_seed(3)
    lm_head = torch.eye(H) + 0.01 * torch.randn(H, H, generator=g)

    def batch(tag):
        items = []
        for i in range(4):
            s = sample(f"{tag}-ok{i}", t=8, regenerated=i % 2 == 0)
            ids = torch.tensor(s.input_ids.tolist())
            final = torch.zeros(8, H)
            final[:-1] = lm_head[ids[1:]]
            final[2 : 2 + i] = lm_head[0]  # 0-3 wrong predictions: the regenerated one with 2 is below the floor
            items.append((s, shard_bytes(s, final=final)))
        nan, other = sample(f"{tag}-nan"), sample(f"{tag}-prov")
        return [*items, (nan, shard_bytes(nan, raw_nan=True)), (other, shard_bytes(other, p=prov(dtype="float16"))),
                (sample(f"{tag}-gone"), None)]

    def verdicts(res):  # (the folders' names left out of the reasons)
        def reason(i):
            return i.reason.replace(str(tmp_path / "p"), "X").replace(str(tmp_path / "t"), "X")

        return ([(e.sample_id, e.sha256, e.bytes, e.stats) for e in res.entries],
                sorted((i.sample_id, i.kind, i.requeue, reason(i)) for i in res.invalid))

    threads = ValidateConfig(shard_wait_s=0, min_argmax_agreement=0.7)
    procs = ValidateConfig(shard_wait_s=0, min_argmax_agreement=0.7, processes=2)
    want = [verdicts(check(tmp_path / "t", batch(tag), lm_head=lm_head, config=threads)) for tag in ("a", "b")]
    with check_pool(procs) as pool:
        assert isinstance(pool, cf.ProcessPoolExecutor)
        got = [verdicts(check(tmp_path / "p", batch(tag), lm_head=lm_head, config=procs, pool=pool))
               for tag in ("a", "b")]
    assert [[(sid, stats) for sid, _, _, stats in e] for e, _ in got] == [
        [(sid, stats) for sid, _, _, stats in e] for e, _ in want]
    assert [i for _, i in got] == [i for _, i in want]
    entries, invalid = got[0]
    assert [sid for sid, *_ in entries] == ["a-ok0", "a-ok1", "a-ok3"]  # a-ok2: regenerated, 4/6 agree < 0.7
    assert entries[0][3]["argmax_agreement"] == 1.0 and "argmax_agreement" not in entries[1][3]
    assert {(sid, kind) for sid, kind, *_ in invalid} == {
        ("a-ok2", "argmax"), ("a-nan", "nonfinite"), ("a-prov", "provenance"), ("a-gone", "missing")}


def test_check_processes_of_a_profiled_run_sample_themselves(tmp_path, monkeypatch):
    """With EAGLENEST_SAMPLE_PROFILE set, each check process writes its own role-``check`` profile (the run's
    sampler sees only its own process's threads)."""
    from eaglenest.engines import ENV_PROFILE_DIR
    from eaglenest.testing import sglang_profiler

    monkeypatch.setenv(ENV_PROFILE_DIR, str(tmp_path / "prof"))
    with check_pool(ValidateConfig(processes=1)) as pool:
        pid = pool.submit(os.getpid).result()
        deadline = time.monotonic() + 30
        while not (tmp_path / "prof" / f"check-{pid}.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # (the sampler writes its file each second)
    assert pid != os.getpid()
    assert sglang_profiler.snapshot(tmp_path / "prof", "check")["samples"]["all"] > 0


def test_worker_processes_by_engine_when_the_run_does_not_say():
    assert [default_check_processes("sglang", n) for n in (2, 4, 8, 16, 64)] == [0, 0, 4, 8, 8]
    assert default_check_processes("embedded", 64) == 0


def test_a_dead_check_process_sends_its_chunk_and_the_rest_of_the_round_to_threads(monkeypatch):
    """A check process that dies breaks its pool before the chunk records anything: the Validator checks that chunk
    again in threads, and the later chunks too; nothing is lost or counted twice."""
    from types import SimpleNamespace

    from eaglenest.extraction import stream, validator
    from eaglenest.extraction.report import Counts

    pools = []

    def step(ext, ctx, batch, *, allow_requeue, pool):
        pools.append(type(pool).__name__)
        if isinstance(pool, cf.ProcessPoolExecutor):
            raise cf.process.BrokenProcessPool("a child process terminated abruptly")
        return validator.ValidateStep(counts=Counts(validated=len(batch)))

    monkeypatch.setattr(validator, "validate_step", step)
    ctx = SimpleNamespace(validate_config=ValidateConfig(processes=1))
    v = validator.Validator(None, ctx, stream.Phase(), chunk=4, allow_requeue=True, linger_s=0.0)
    for i in range(6):
        v.put(sample(f"s{i}"))
    v.close()
    assert pools[:2] == ["ProcessPoolExecutor", "ThreadPoolExecutor"] and set(pools[2:]) <= {"ThreadPoolExecutor"}
    assert v.counts.validated == 6


def test_check_processes_outlive_the_signals_sent_to_their_process_group():
    """``timeout -s TERM`` and Ctrl-C signal the whole process group: the check processes ignore SIGTERM and
    SIGINT, so the pool is not broken (the run decides when its checks end)."""
    import signal

    with check_pool(ValidateConfig(processes=1)) as pool:
        pid = pool.submit(os.getpid).result()
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(pid, sig)
        time.sleep(0.5)
        assert pool.submit(os.getpid).result(timeout=30) == pid


def test_a_check_process_ends_with_its_run_when_the_run_is_killed(tmp_path):
    """A run killed outright (SIGKILL) leaves no check process behind although they ignore SIGTERM: the pool's
    pipe closes and the worker exits."""
    import signal
    import subprocess
    import sys

    code = ("import os, sys, time\n"
            "from eaglenest.extraction.checking import check_pool\n"
            "from eaglenest.extraction.validate import ValidateConfig\n"
            "pool = check_pool(ValidateConfig(processes=1))\n"
            "print(pool.submit(os.getpid).result(), flush=True)\n"
            "time.sleep(60)\n")
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        worker = int(run.stdout.readline())
        run.kill()
        run.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(worker, signal.SIGKILL)
            pytest.fail(f"check process {worker} outlived its killed run")
    finally:
        if run.poll() is None:
            run.kill()


def test_a_check_pool_broken_while_the_round_ends_leaves_its_chunk_to_the_run(monkeypatch):
    """A pool that breaks while the round is being abandoned (the run is stopping) does not check the chunk again in
    threads (minutes for a large chunk): the chunk joins what the run validates after stopping its servers."""
    from types import SimpleNamespace

    from eaglenest.extraction import stream, validator

    pools = []

    def step(ext, ctx, batch, *, allow_requeue, pool):
        pools.append(type(pool).__name__)
        deadline = time.monotonic() + 10
        while not v._abandon and time.monotonic() < deadline:  # the run stops while this chunk is checked
            time.sleep(0.01)
        raise cf.process.BrokenProcessPool("a child process terminated abruptly")

    ctx = SimpleNamespace(validate_config=ValidateConfig(processes=1))
    monkeypatch.setattr(validator, "validate_step", step)
    v = validator.Validator(None, ctx, stream.Phase(), chunk=4, allow_requeue=True, linger_s=0.0)
    v.put(sample("s0"))
    time.sleep(0.2)  # the chunk [s0] is being checked
    for i in range(1, 4):
        v.put(sample(f"s{i}"))
    v.close(drain=False)
    assert pools == ["ProcessPoolExecutor"]
    assert sorted(s.sample_id for s in v.left) == ["s0", "s1", "s2", "s3"] and v.counts.validated == 0


def test_a_chunk_checked_again_in_threads_stops_between_pieces_when_the_round_ends(monkeypatch):
    """The pool broke first (a check process killed while starting, by the signal that stops the run) and the chunk
    is being checked again in threads: once the round is abandoned, the pieces not checked yet join ``left``."""
    from types import SimpleNamespace

    from eaglenest.extraction import stream, validator
    from eaglenest.extraction.report import Counts

    pieces = []

    def step(ext, ctx, batch, *, allow_requeue, pool):
        if isinstance(pool, cf.ProcessPoolExecutor):
            raise cf.process.BrokenProcessPool("a child process terminated abruptly")
        pieces.append(len(batch))
        if len(pieces) == 2:
            v._abandon = True  # the run stops while the second piece is checked
        return validator.ValidateStep(counts=Counts(validated=len(batch)))

    monkeypatch.setattr(validator, "validate_step", step)
    monkeypatch.setattr(validator, "RECHECK_PIECE", 4)
    ctx = SimpleNamespace(validate_config=ValidateConfig(processes=1))
    v = validator.Validator(None, ctx, stream.Phase(), chunk=20, allow_requeue=True, linger_s=0.0)
    chunk = [sample(f"s{i}") for i in range(20)]
    v._validate(chunk)  # (the thread is idle: nothing was put)
    v.close()
    assert pieces == [4, 4] and [s.sample_id for s in v.left] == [f"s{i}" for i in range(8, 20)]
