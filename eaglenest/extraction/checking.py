"""Where shard checks run: threads of the run's process or worker processes (:func:`check_pool`), and how many
processes a run gets when it does not say (:func:`default_check_processes`). :mod:`eaglenest.extraction.validate`
does the checks.

Invariants: a check process never dies of a signal sent to its run's process group, and never outlives its run.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eaglenest.extraction.validate import ValidateConfig

CHECK_THREADS = "extract-check"
"""Name prefix of the threads that read and check shards (the profiler's ``check`` role samples them)."""


def default_check_processes(engine: str, cpus: int | None = None) -> int:
    """Worker processes for shard checks when the run does not say: a GPU engine's host (SGLang; 8 or more cores)
    checks in processes, half its cores up to 8, because the request loop of 1,024 generations in flight keeps
    the GIL busy (on the H200, 2026-12-04b: 8 check threads validated 79 shards/s while 120/s were captured, and
    the run's budget ended with 10,604 of 18,361 captured shards validated); the embedded engine computes on the
    same few cores, so its checks stay in threads."""
    if cpus is None:
        cpus = os.cpu_count() or 1
    return min(8, cpus // 2) if engine == "sglang" and cpus >= 8 else 0


def check_pool(config: ValidateConfig) -> cf.Executor:
    """The executor that checks shards: ``config.processes`` worker processes (spawned: the caller may hold CUDA
    and threads), else ``config.workers`` threads. One per run;
    :func:`~eaglenest.extraction.validate.validate_batch` takes it as ``pool``."""
    if config.processes > 0:
        import multiprocessing as mp

        return cf.ProcessPoolExecutor(config.processes, mp_context=mp.get_context("spawn"),
                                      initializer=_start_check_process)
    return cf.ThreadPoolExecutor(max(1, config.workers), thread_name_prefix=CHECK_THREADS)


def _start_check_process() -> None:
    """A check process ignores SIGTERM and SIGINT: they go to the whole process group (``timeout``, Ctrl-C in a
    terminal), and the run that owns the pool decides when its checks end (the pool's shutdown). Before, on the
    H100 (2026-12-05), ``timeout -s TERM`` killed the check processes with the run; the broken pool sent the chunk
    in progress (thousands of shards) to threads, and the run had not ended 3.5 minutes later. (A signal that comes
    while a check process is still starting, before this runs, still ends it: the Validator then checks in threads,
    piece by piece, so a stopping run does not wait for a whole chunk.) Nor does one
    outlive its run killed outright (SIGKILL: the pool's pipes stay open in the workers, so they would wait
    forever): it ends when the run's process does. A check process of a profiled extraction
    (``EAGLENEST_SAMPLE_PROFILE`` set, inherited from the run) samples its own stack as role ``check``, as the
    check threads are sampled in the run's process."""
    import signal

    from eaglenest.engines import ENV_PROFILE_DIR

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_end_with_parent, name="eaglenest-check-parent", daemon=True).start()

    if os.environ.get(ENV_PROFILE_DIR):
        from eaglenest.testing import sglang_profiler

        sglang_profiler.maybe_start("check")


def _end_with_parent() -> None:
    import multiprocessing as mp

    parent = mp.parent_process()
    if parent is not None:
        parent.join()  # returns when the run's process has ended, however it ended
        os._exit(0)
