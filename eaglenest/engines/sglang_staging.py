"""Device-to-host staging and shard writing off the scheduler's interpreter.

Measured on the H200 (tiny Llama, 256-token prefill steps): with the shard writer as threads inside
sglang's scheduler process, capture cost 38% of prefill throughput. The scheduler thread is launch-bound
Python; every torch op releases and re-takes the GIL, and each re-take waited for writer threads busy with
encoding, hashing and receipts. So the writer runs in a child process (``python -m`` this module):

- :class:`DeviceCopier` copies a batch's captured rows into one of ``max_inflight`` host slots on a side
  stream. With ``shared=True`` a slot is a file in /dev/shm mapped by both processes and registered with
  CUDA (pinned), so the copy is asynchronous and nothing is copied again to reach the child.
- :class:`ProcessWriter` (scheduler side; the same ``submit``/``fail``/``close`` as
  :class:`~eaglenest.engines.sglang_capture.CaptureWriter`): a sender thread waits for a batch's copy
  event (the GIL is released while waiting) and pickles a small message (slot, shapes, segments) to the
  child's stdin; a receiver thread returns slots named on the child's stdout to the pool.
- :func:`main` (child): maps the slot, hands the rows to a ``CaptureWriter`` (coalescing, encoding,
  fsynced shards, receipts), and names the slot back once the rows were copied out of it.

If the child dies, pending and later requests fail with a clear receipt (500) instead of hanging.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import mmap
import os
import pickle
import queue
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from eaglenest import contract
from eaglenest.engines.sglang_capture import CaptureWriter, HostBatch
from eaglenest.engines.sglang_receipts import report_failure

log = logging.getLogger("eaglenest.sglang")
SHM_DIR = Path("/dev/shm")


def shared_memory_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class ShmBuffer:
    """A bf16 host buffer backed by a file in /dev/shm (mappable by path), CUDA-registered when asked."""

    def __init__(self, numel: int, *, pin: bool) -> None:
        self.path = SHM_DIR / f"eaglenest-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, numel * 2)
            self._map = mmap.mmap(fd, numel * 2)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.bfloat16, count=numel)
        self._pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), numel * 2, 0)
            self._pinned = int(err) == 0
            if not self._pinned:
                log.warning("eaglenest capture: cudaHostRegister failed (%s); device-to-host copies of captured "
                            "states will be synchronous", err)

    def numel(self) -> int:
        return self.tensor.numel()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unregister and drop the name; the mapping goes with the last reference (no view is in use)."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        self.unlink()


def attach(path: str) -> torch.Tensor:
    """Map a :class:`ShmBuffer` created by another process (then drop its name: both now hold the map)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return torch.frombuffer(mapped, dtype=torch.bfloat16, count=size // 2)


class DeviceCopier:
    """Bounded device-to-host staging: ``max_inflight`` reusable host slots (pinned; shared with
    ``shared=True``)."""

    def __init__(self, max_inflight: int, *, shared: bool = False) -> None:
        self.shared = shared
        self._free: queue.Queue[list[Any]] = queue.Queue()
        self._buffers: list[ShmBuffer] = []
        for i in range(max_inflight):
            self._free.put([i, None])
        self._stream: Any = None

    def _slot(self, need: int, cuda: bool) -> tuple[list[Any], torch.Tensor]:
        slot = self._free.get()  # back-pressure: waits only when every slot is still in use
        buf = slot[1]
        if buf is None or buf.numel() < need:
            size = int(need * 1.25) + 1024
            if self.shared:
                if buf is not None:  # released: no batch uses it any more
                    buf.close()
                    self._buffers.remove(buf)
                buf = ShmBuffer(size, pin=cuda)
                self._buffers.append(buf)
            else:
                buf = torch.empty(size, dtype=torch.bfloat16, pin_memory=cuda)
            slot[1] = buf
        return slot, (buf.tensor if self.shared else buf)

    def stage(self, final: torch.Tensor, aux: list[torch.Tensor], ranges: list[tuple[int, int]],
              ) -> tuple[torch.Tensor, torch.Tensor, Any, Any, tuple[int, str] | None]:
        """Copy rows ``ranges`` of final [N, H] and aux k x [N, H]; returns (aux [n, kH], final [n, H], ready,
        release, where) on the host; ``where`` = (slot, shm path) when shared."""
        aux_dev = torch.cat(aux, dim=-1)  # [N, kH]
        fin_dev = final
        if ranges != [(0, final.shape[0])]:
            aux_dev = torch.cat([aux_dev[a:b] for a, b in ranges])  # [n, kH]
            fin_dev = torch.cat([final[a:b] for a, b in ranges])  # [n, H]
        aux_dev, fin_dev = aux_dev.to(torch.bfloat16), fin_dev.to(torch.bfloat16)
        n, kh, h = aux_dev.shape[0], aux_dev.shape[1], fin_dev.shape[1]
        slot, host = self._slot(n * (kh + h), final.is_cuda)
        aux_host = host[: n * kh].view(n, kh)
        fin_host = host[n * kh: n * (kh + h)].view(n, h)
        where = (slot[0], str(slot[1].path)) if self.shared else None

        def release() -> None:
            self._free.put(slot)

        if not final.is_cuda:
            aux_host.copy_(aux_dev)
            fin_host.copy_(fin_dev)
            return aux_host, fin_host, (lambda: None), release, where
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=final.device)
        self._stream.wait_stream(torch.cuda.current_stream(final.device))
        with torch.cuda.stream(self._stream):
            aux_host.copy_(aux_dev, non_blocking=True)
            fin_host.copy_(fin_dev, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # the waiting thread sleeps, not spins
            done.record(self._stream)
        aux_dev.record_stream(self._stream)  # keep device memory alive until the copy ran
        fin_dev.record_stream(self._stream)
        return aux_host, fin_host, done.synchronize, release, where

    def close(self) -> None:
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()


class ProcessWriter:
    """Scheduler side of the child-process writer; see the module docstring."""

    def __init__(self, *, capture_dir: str | Path, receipt_dir: str | Path, provenance: contract.Provenance,
                 threads: int = 4) -> None:
        self.receipt_dir = Path(receipt_dir)
        self.receipt_dir.mkdir(parents=True, exist_ok=True)
        Path(capture_dir).mkdir(parents=True, exist_ok=True)
        config = {"capture_dir": str(capture_dir), "receipt_dir": str(receipt_dir), "threads": threads,
                  "provenance": provenance.to_json()}
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(config)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._pending: dict[int, HostBatch] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._queue: queue.Queue[HostBatch | None] = queue.Queue()
        self._dead: str | None = None
        self._sender = threading.Thread(target=self._send_loop, name="eaglenest-capture-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="eaglenest-capture-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    def submit(self, batch: HostBatch) -> None:
        if batch.where is None:
            raise ValueError("ProcessWriter needs batches staged in shared memory (DeviceCopier(shared=True))")
        self._queue.put(batch)

    def fail(self, rid: str, message: str, *, status: int = 422, kind: str = "capture_invalid") -> None:
        report_failure(self.receipt_dir, rid, message, status=status, kind=kind)

    def _fail_batch(self, batch: HostBatch, why: str) -> None:
        for seg in batch.segments:
            self.fail(seg.view.rid, f"capture of {seg.view.rid!r} failed: {why}", status=500, kind="capture_error")
        batch.release()

    def _send_loop(self) -> None:
        stdin = self._proc.stdin
        while (batch := self._queue.get()) is not None:
            try:
                batch.ready()  # the device-to-host copy finished (CUDA event; the GIL is free meanwhile)
            except Exception as e:
                self._fail_batch(batch, f"device-to-host copy failed: {e}")
                continue
            if self._dead:
                self._fail_batch(batch, self._dead)
                continue
            token = next(self._tokens)
            with self._lock:
                self._pending[token] = batch
            msg = (token, batch.where, tuple(batch.aux_hidden.shape), tuple(batch.final_hidden.shape),
                   batch.segments)
            try:
                pickle.dump(msg, stdin, protocol=pickle.HIGHEST_PROTOCOL)
                stdin.flush()
            except (OSError, ValueError) as e:
                self._dead = self._dead or f"the capture writer process is gone ({e!r}); see the log above"
                with self._lock:
                    lost = self._pending.pop(token, None)
                if lost is not None:
                    self._fail_batch(lost, self._dead)
        with contextlib.suppress(OSError):
            stdin.close()

    def _recv_loop(self) -> None:
        stdout = self._proc.stdout
        while True:
            try:
                token = pickle.load(stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            with self._lock:
                batch = self._pending.pop(token, None)
            if batch is not None:
                batch.release()
        code = self._proc.wait()
        if code != 0:
            self._dead = f"the capture writer process exited with code {code}; see the log above"
            log.error("eaglenest capture: %s", self._dead)
        with self._lock:
            lost, self._pending = list(self._pending.values()), {}
        for batch in lost:
            self._fail_batch(batch, self._dead or "the capture writer process exited")

    def close(self, timeout_s: float = 60.0) -> None:
        """Drain: every submitted batch is written (or failed) before this returns."""
        self._queue.put(None)
        self._sender.join(timeout_s)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._receiver.join(timeout_s)


def main() -> int:
    """Child: read (token, (slot, path), aux shape, final shape, segments) messages from stdin until EOF."""
    config = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # nothing printed by accident may corrupt the reply stream
    logging.basicConfig(level=logging.INFO, format="[eaglenest writer %(process)d] %(levelname)s %(message)s")
    torch.set_num_threads(2)
    writer = CaptureWriter(capture_dir=config["capture_dir"], receipt_dir=config["receipt_dir"],
                           provenance=contract.Provenance.from_json(config["provenance"]), threads=config["threads"])
    reply_lock = threading.Lock()

    def release(token: int) -> None:
        with reply_lock:
            pickle.dump(token, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()

    maps: dict[int, tuple[str, torch.Tensor]] = {}
    stdin = sys.stdin.buffer
    while True:
        try:
            token, (slot, path), (n, kh), (_, h), segments = pickle.load(stdin)
        except EOFError:
            break
        have = maps.get(slot)
        if have is None or have[0] != path:
            have = maps[slot] = (path, attach(path))
        host = have[1]
        writer.submit(HostBatch(segments, host[: n * kh].view(n, kh), host[n * kh: n * (kh + h)].view(n, h),
                                release=functools.partial(release, token)))
    writer.close()
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
