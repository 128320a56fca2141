"""The capture writer's child process and the scheduler stack sampler (CPU; no sglang needed).

The plugin glue tests in test_sglang_plugin.py run through both writers; these cover what only the
child process can do (die) and the diagnostics sampler.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from eaglenest.engines import sglang_plugin as plugin
from eaglenest.engines.sglang_receipts import receipt_path
from eaglenest.engines.sglang_staging import SHM_DIR, ProcessWriter, attach
from eaglenest.testing import sglang_profiler
from tests.sglang_capture_helpers import (
    EXTEND,
    check_shard,
    fake_req,
    forward,
    logits_processor,
    provenance,
    read_receipt,
)


def test_process_writer_fails_requests_clearly_when_its_child_dies(tmp_path, monkeypatch):
    writer = ProcessWriter(capture_dir=tmp_path / "capture", receipt_dir=tmp_path / "receipts",
                           provenance=provenance())
    runner = object()
    runtime = plugin.CaptureRuntime(writer=writer, copier=plugin.DeviceCopier(2, shared=True), num_aux=3,
                                    extend_mode=EXTEND, runner=runner)
    lp = logits_processor(runtime)
    monkeypatch.setattr(plugin, "_runtime", runtime)
    forward(runtime, lp, runner, [fake_req("ok", 3)], [0], [3], [(0, range(3))])
    forward(runtime, lp, runner, [fake_req("half", 6)], [0], [3], [(1, range(3))])  # chunk 1 of 2 in the child
    deadline = time.monotonic() + 30
    while not receipt_path(tmp_path / "receipts", "ok").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receipt_path(tmp_path / "receipts", "ok").exists()  # the child wrote the first shard
    writer._proc.kill()  # the writer process crashes (OOM killer, bug)
    writer._proc.wait()
    forward(runtime, lp, runner, [fake_req("half", 6)], [3], [3], [(1, range(3, 6))])
    forward(runtime, lp, runner, [fake_req("late", 2)], [0], [2], [(2, range(2))])
    writer.close(timeout_s=30)  # returns: nothing waits forever on a dead child
    check_shard(tmp_path / "capture" / "ok.safetensors", 0, 3)
    for rid in ("half", "late"):
        receipt = read_receipt(tmp_path, rid)
        assert receipt["status"] == 500 and "capture writer process" in receipt["message"], receipt
    assert not list(SHM_DIR.glob(f"eaglenest-{os.getpid()}-*"))  # the child unlinked every slot it mapped


def test_stack_sampler_attributes_time_to_the_functions_on_the_stack(tmp_path):
    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(200))

    def busy_long():
        spin(0.6)

    def busy_short():
        spin(0.2)

    sampler = sglang_profiler.StackSampler(tmp_path, interval_s=0.002)
    sampler.target = threading.get_ident()  # sample this (test) thread
    before = sglang_profiler.snapshot(tmp_path)
    sampler.start()
    busy_long()
    busy_short()
    sampler.stop()
    shares = dict(sglang_profiler.summarize(before, sglang_profiler.snapshot(tmp_path))["inclusive"])
    long_share = next(v for k, v in shares.items() if k.endswith(":busy_long"))
    short_share = next(v for k, v in shares.items() if k.endswith(":busy_short"))
    assert 1.5 < long_share / short_share < 6  # 3:1 by time


def test_sampler_follows_a_named_thread_and_writes_a_timeline(tmp_path):
    """The extraction's request loop runs on a thread of its own (one per round): the sampler finds it by name,
    and each flush appends what ran since the last one, to line up with the GPU's idle seconds."""
    import json

    def busy_named():
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            sum(range(200))

    sampler = sglang_profiler.StackSampler(tmp_path, interval_s=0.002, flush_s=0.1, role="client",
                                           thread_name="eaglenest-client").start()
    worker = threading.Thread(target=busy_named, name="eaglenest-client")
    worker.start()
    worker.join()
    sampler.stop()
    lines = [json.loads(x) for x in sampler.timeline.read_text().splitlines()]
    assert len(lines) >= 3 and all(set(x) == {"t", "samples", "self"} for x in lines)
    assert sum(x["samples"] for x in lines) == sampler.samples > 0  # no thread of that name: no sample
    assert any(name.endswith(":busy_named") for x in lines for name, _ in x["self"])
    assert not sampler.timeline.name.endswith(".json")  # snapshot() globs <role>-*.json: not the timeline


def test_sampler_with_a_name_prefix_samples_every_worker_of_a_pool(tmp_path):
    """``check`` samples the validation's shard-checking pool: every thread whose name starts with the prefix
    (one sample per worker per tick), never a thread of another name."""
    import concurrent.futures as cf

    release = threading.Event()
    running = threading.Semaphore(0)

    def pool_worker():
        running.release()
        while not release.is_set():
            sum(range(200))

    def other_worker():
        running.release()
        while not release.is_set():
            sum(range(200))

    sampler = sglang_profiler.StackSampler(tmp_path, role="check", thread_name="pool-x*")
    other = threading.Thread(target=other_worker, name="other-thread", daemon=True)
    try:
        with cf.ThreadPoolExecutor(2, thread_name_prefix="pool-x") as pool:
            futures = [pool.submit(pool_worker) for _ in range(2)]
            other.start()
            for _ in range(3):
                assert running.acquire(timeout=10)
            for _ in range(20):
                sampler.sample()
            release.set()
            for f in futures:
                f.result()
    finally:
        release.set()  # never leave busy threads behind a failed assertion
    other.join()
    assert sampler.samples == 40
    on_stack = {k.split(":")[-1]: n for k, n in sampler.inclusive.items()}
    assert on_stack.get("pool_worker") == 40 and "other_worker" not in on_stack


def test_shared_slot_grows_into_a_new_segment_and_drops_the_old_one():
    copier = plugin.DeviceCopier(1, shared=True)
    small = [torch.full((2, 4), float(k)) for k in range(3)]
    aux, fin, _ready, release, (slot, first) = copier.stage(torch.ones(2, 4), small, [(0, 2)])
    assert aux.shape == (2, 12) and fin.eq(1).all() and os.path.exists(first)
    release()
    big = [torch.full((5000, 4), float(k)) for k in range(3)]
    aux, fin, _ready, release, (slot2, second) = copier.stage(torch.zeros(5000, 4), big, [(0, 5000)])
    assert slot2 == slot and second != first and not os.path.exists(first)  # the outgrown segment is gone
    assert aux[:, 4:8].eq(1).all() and aux[:, 8:].eq(2).all() and fin.eq(0).all()
    mapped = attach(second)  # what the child sees, by path
    assert mapped[: 5000 * 12].view(5000, 12).equal(aux) and not os.path.exists(second)
    release()
    copier.close()
