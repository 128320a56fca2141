"""The embedded capture server: SGLang's native HTTP subset over a transformers model on the CPU.

Owns the embedded engine's scheduling, batching and capture (its HTTP layer is
:mod:`eaglenest.engines.embedded_http`):

- ``GET /health``, ``GET /get_model_info`` (+ ``/model_info``), ``GET /get_server_info`` and
  ``POST /generate`` with ``input_ids`` or ``text`` (single or batched), ``rid`` and
  ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``, ``ignore_eos``, ``seed``).
- Concurrent prefill-only requests (``max_new_tokens == 0``) are batched by a single scheduler thread
  (length-sorted, bounded by batch size and padded tokens); generating requests run one by one with a
  KV cache.
- The scheduler thread is the engine's torch thread: :meth:`EmbeddedEngine.load` builds the runner and
  the greedy decoder on it, before it serves. Torch's CPU ops run on OpenMP, and a thread that ran a
  parallel op keeps its own team of workers while it lives. Beside a second live team (the loading
  thread's), decoding ran 1.8x slower on 2 cores, on one busy core; loading on a thread that had exited
  cost nothing. The likely cause: with more OpenMP threads than cores the workers stop spin-waiting, so
  each of a decode step's many small parallel regions waits for a worker to wake up.
- With a capture folder, every request except those whose rid starts with
  ``contract.NO_CAPTURE_RID_PREFIX`` is captured in its prefill and written as one shard (atomic) by a
  writer pool; the HTTP answer is sent only after its shard is durable, and names the shard and
  shapes in ``meta_info.capture``.

A rid that already has a shard is answered from that file when the request is the same (same
input_ids and provenance: idempotent, ``existing: true``) and refused otherwise; a receipt always
describes the file on disk.

Errors: 400 for bad requests (naming the field), 409 for a rid whose shard holds other token ids,
413 for prompts beyond the context, 422 for captures that break the contract (non-finite values:
never written), 507 when the disk is full (terminal: no retry storm), 500 otherwise.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest import contract
from eaglenest.atomic import clean_temporaries
from eaglenest.engines.runtime import Captured, Generation, TargetRunner

log = logging.getLogger(__name__)


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass(slots=True)
class Work:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    capture: bool = False
    future: cf.Future = field(default_factory=cf.Future)
    t_arrival: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    max_batch_size: int = 8
    """Most prefill-only requests in one forward."""
    max_batch_tokens: int = 8192
    """Most padded tokens (batch x longest) in one forward."""
    batch_wait_s: float = 0.002
    """How long the scheduler waits for more requests before a forward."""
    writer_threads: int = 2
    max_pending_writes: int = 64
    """Back-pressure: the scheduler stops computing while this many shard writes are queued."""


class EmbeddedEngine:
    """Scheduler + shard writer around a :class:`TargetRunner`.

    ``greedy_decoder`` (opt-in, e.g. eaglenest.speculative's EAGLE-3 decoder): an object with
    ``generate_greedy(input_ids, *, max_new_tokens, ignore_eos) -> Generation`` that serves greedy
    requests which are not captured; everything else runs on the runner.

    Servers build with :meth:`load` (runner and decoder made on the scheduler thread); the constructor
    takes a runner made elsewhere (tests, tools), which works but decodes slower when its thread ran
    parallel torch ops (the module docstring says why).
    """

    def __init__(
        self, runner: TargetRunner, *, capture_dir: str | Path | None, settings: ServerSettings | None = None,
        greedy_decoder: Any = None,
    ) -> None:
        self._start(lambda: (runner, greedy_decoder), capture_dir=capture_dir, settings=settings)

    @classmethod
    def load(
        cls, build: Callable[[], tuple[TargetRunner, Any]], *, capture_dir: str | Path | None,
        settings: ServerSettings | None = None,
    ) -> EmbeddedEngine:
        """An engine whose runner and greedy decoder (or None) ``build`` makes on the scheduler thread, so
        every torch call of the engine runs on that one thread. Returns once they are built; raises what
        ``build`` raised."""
        engine = cls.__new__(cls)
        engine._start(build, capture_dir=capture_dir, settings=settings)
        return engine

    def _start(self, build: Callable[[], tuple[TargetRunner, Any]], *, capture_dir: str | Path | None,
               settings: ServerSettings | None) -> None:
        self.settings = settings or ServerSettings()
        self.capture_dir = Path(capture_dir) if capture_dir else None
        if self.capture_dir:
            self.capture_dir.mkdir(parents=True, exist_ok=True)
            removed = clean_temporaries(self.capture_dir)
            if removed:
                log.info("removed %d stale temporaries from %s", removed, self.capture_dir)
        self._queue: queue.Queue[Work | None] = queue.Queue()
        self._writer = cf.ThreadPoolExecutor(self.settings.writer_threads, thread_name_prefix="shard-writer")
        self._write_slots = threading.BoundedSemaphore(self.settings.max_pending_writes)
        self.stats = {"requests": 0, "prefill_tokens": 0, "shards": 0, "shard_bytes": 0, "forwards": 0}
        built: cf.Future = cf.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="scheduler", daemon=True)
        self._thread.start()
        try:
            self.runner, self.greedy_decoder = built.result()
        except BaseException:  # the build failed, or an interrupt came while waiting for it
            self._queue.put(None)  # a build that still finishes then ends its scheduler at once
            self._writer.shutdown(wait=False)
            raise
        self.provenance = self.runner.provenance()

    def _run(self, build: Callable[[], tuple[TargetRunner, Any]], built: cf.Future) -> None:
        try:
            built.set_result(build())
        except BaseException as e:  # the constructor re-raises it; the scheduler never starts
            built.set_exception(e)
            return
        self._loop()

    # ---------------------------------------------------------------- scheduling
    def submit(self, work: Work) -> cf.Future:
        self._queue.put(work)
        return work.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._writer.shutdown(wait=True)

    def _collect(self, first: Work) -> list[Work]:
        batch = [first]
        deadline = time.perf_counter() + self.settings.batch_wait_s
        while len(batch) < 4 * self.settings.max_batch_size:
            timeout = deadline - time.perf_counter()
            try:
                item = self._queue.get(timeout=max(timeout, 0)) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            works = self._collect(first)
            prefill = sorted((w for w in works if w.max_new_tokens == 0), key=lambda w: len(w.input_ids))
            for group in self._groups(prefill):
                self._run_prefill(group)
            for w in works:
                if w.max_new_tokens > 0:
                    self._run_generate(w)

    def _groups(self, works: list[Work]) -> list[list[Work]]:
        groups: list[list[Work]] = []
        current: list[Work] = []
        for w in works:
            width = max([len(w.input_ids)] + [len(x.input_ids) for x in current])
            if current and (
                len(current) >= self.settings.max_batch_size
                or width * (len(current) + 1) > self.settings.max_batch_tokens
            ):
                groups.append(current)
                current = []
            current.append(w)
        if current:
            groups.append(current)
        return groups

    def _run_prefill(self, group: list[Work]) -> None:
        try:
            captured = self.runner.capture([w.input_ids for w in group])
        except Exception as e:  # a forward failure answers every request of the batch
            log.exception("prefill failed")
            for w in group:
                w.future.set_exception(RequestError(500, f"prefill failed: {e}", "engine_error"))
            return
        self.stats["forwards"] += 1
        for w, cap in zip(group, captured, strict=True):
            self._finish(w, Generation([], "length", cap, 0.0, 0.0))

    def _run_generate(self, w: Work) -> None:
        try:
            if self.greedy_decoder is not None and w.temperature <= 0 and not w.capture:
                result = self.greedy_decoder.generate_greedy(w.input_ids, max_new_tokens=w.max_new_tokens,
                                                             ignore_eos=w.ignore_eos)
                self.stats["spec_verify_ct"] = self.stats.get("spec_verify_ct", 0) + result.spec_verify_ct
                self.stats["spec_correct_drafts"] = (self.stats.get("spec_correct_drafts", 0)
                                                     + result.spec_correct_drafts)
            else:
                result = self.runner.generate(
                    w.input_ids, max_new_tokens=w.max_new_tokens, temperature=w.temperature, top_p=w.top_p,
                    ignore_eos=w.ignore_eos, capture=w.capture, seed=w.seed,
                )
        except Exception as e:
            log.exception("generation failed")
            w.future.set_exception(RequestError(500, f"generation failed: {e}", "engine_error"))
            return
        self.stats["forwards"] += 1 + len(result.output_ids)
        self._finish(w, result)

    def _finish(self, w: Work, result: Generation) -> None:
        self.stats["requests"] += 1
        self.stats["prefill_tokens"] += len(w.input_ids)
        if not (w.capture and self.capture_dir is not None and result.captured is not None):
            w.future.set_result((result, None))
            return
        self._write_slots.acquire()  # back-pressure: never more than max_pending_writes in memory
        fut = self._writer.submit(self._write, w, result.captured)

        def done(f: cf.Future) -> None:
            self._write_slots.release()
            if f.exception() is not None:
                w.future.set_exception(f.exception())
            else:
                w.future.set_result((result, f.result()))

        fut.add_done_callback(done)

    def _write(self, w: Work, cap: Captured) -> dict[str, Any]:
        shard = contract.Shard(
            sample_id=w.rid,
            input_ids=_int32(w.input_ids),
            aux_hidden=cap.aux_hidden,
            final_hidden=cap.final_hidden,
            provenance=self.provenance,
        )
        try:
            receipt = contract.publish_shard(self.capture_dir / contract.shard_filename(w.rid),
                                             contract.encode_shard(shard))
        except contract.ShardConflict as e:
            raise RequestError(409, str(e), "rid_conflict") from None
        except contract.ContractError as e:
            raise RequestError(422, str(e), "capture_invalid") from None
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise RequestError(507, f"capture disk full writing {w.rid!r}: {e}", "disk_full") from None
            raise RequestError(500, f"capture write failed for {w.rid!r}: {e}", "write_failed") from None
        if not receipt["existing"]:
            self.stats["shards"] += 1
            self.stats["shard_bytes"] += receipt["bytes"]
        return receipt

    # ---------------------------------------------------------------- info
    def model_info(self) -> dict[str, Any]:
        r = self.runner
        return {
            "model_path": str(r.model_dir),
            "tokenizer_path": str(r.model_dir),
            "is_generation": True,
            "context_length": r.context_length,
            "capture": {
                "enabled": self.capture_dir is not None,
                "capture_dir": str(self.capture_dir) if self.capture_dir else None,
                "aux_layer_ids": list(r.aux_layer_ids),
                "hidden_size": r.hidden_size,
                "num_layers": r.num_layers,
                "provenance": json_provenance(self.provenance),
            },
        }


def json_provenance(p: contract.Provenance) -> dict[str, Any]:
    import json

    return json.loads(p.to_json())


def _int32(ids: list[int]):
    import torch

    return torch.tensor(ids, dtype=torch.int32)
