"""Test instrument: a sampling profiler for sglang's processes (where does a prefill step's time go?).

Enabled only by ``EAGLENEST_SAMPLE_PROFILE=<dir>`` (GPU diagnostics, never in production); works with or
without capture, so a baseline server can be profiled the same way (the plugin must be discoverable
there: ``scripts/gpu_p1.py`` shows how). A daemon thread in every scheduler process (role ``sched``), in
the HTTP process (role ``http``: tokenizer manager, receipt waits) and in the extraction (role ``client``: its
request loop; ``extract`` roles ``validate`` and ``check``, its shard-checking threads or processes, too) looks
at the main (or named) thread's stack every ``EAGLENEST_SAMPLE_INTERVAL_S`` (default 0.005 s) and counts, per
function, the samples in which it was on the stack (inclusive) and innermost (self). Every second it writes
``<dir>/<role>-<pid>.json`` and appends that second's top innermost functions to
``<dir>/<role>-<pid>.timeline.jsonl`` (to line up with ``nvidia-smi dmon``); :func:`snapshot` sums a role's
files and :func:`summarize` turns two snapshots into the top rows.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from eaglenest.engines import ENV_PROFILE_DIR as ENV_SAMPLE_DIR
from eaglenest.engines import ENV_PROFILE_INTERVAL as ENV_SAMPLE_INTERVAL


def _label(code) -> str:
    path = code.co_filename
    for marker in ("/sglang/", "/eaglenest/", "/torch/", "/triton/"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{code.co_name}"


class StackSampler:
    def __init__(self, out_dir: str | Path, interval_s: float = 0.005, flush_s: float = 1.0,
                 role: str = "sched", thread_name: str | None = None) -> None:
        self.out = Path(out_dir) / f"{role}-{os.getpid()}.json"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.interval_s, self.flush_s = interval_s, flush_s
        self.target = threading.main_thread().ident
        self.thread_name = thread_name
        """Sample the (current) thread of this name instead of the main thread (the extraction's client loop
        runs on a thread of its own, one per round); a name ending in ``*`` samples every thread whose name
        starts with the rest (a pool's workers: one sample per worker per tick)."""
        self.inclusive: Counter[str] = Counter()
        self.own: Counter[str] = Counter()
        self.samples = 0
        self.timeline = self.out.with_suffix(".timeline.jsonl")
        self._last_own: Counter[str] = Counter()
        self._last_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eaglenest-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def _targets(self) -> list[int | None]:
        if self.thread_name is None:
            return [self.target]
        if self.thread_name.endswith("*"):
            prefix = self.thread_name[:-1]
            return [t.ident for t in threading.enumerate() if t.name.startswith(prefix)]
        return [next((t.ident for t in threading.enumerate() if t.name == self.thread_name), None)]

    def sample(self) -> None:
        frames = sys._current_frames()
        for target in self._targets():
            self._count(frames.get(target))

    def _count(self, frame) -> None:
        if frame is None:
            return
        self.samples += 1
        self.own[_label(frame.f_code)] += 1
        seen = set()
        while frame is not None:
            label = _label(frame.f_code)
            if label not in seen:
                seen.add(label)
                self.inclusive[label] += 1
            frame = frame.f_back

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.sample()
            if time.monotonic() - last >= self.flush_s:
                last = time.monotonic()
                self.flush()

    def flush(self) -> None:
        data = {"pid": os.getpid(), "interval_s": self.interval_s, "samples": self.samples,
                "inclusive": dict(self.inclusive.most_common(400)), "self": dict(self.own.most_common(400))}
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.out)
        # the timeline: what ran since the last flush (to line up with nvidia-smi dmon's idle seconds)
        delta = self.own - self._last_own
        self._last_own = Counter(self.own)
        line = {"t": round(time.time(), 2), "samples": self.samples - self._last_samples,
                "self": delta.most_common(6)}
        self._last_samples = self.samples
        with open(self.timeline, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


_samplers: dict[str, StackSampler] = {}


def maybe_start(role: str = "sched", *, thread_name: str | None = None) -> StackSampler | None:
    """Start the sampler of ``role`` in this process when ``EAGLENEST_SAMPLE_PROFILE`` is set."""
    out = os.environ.get(ENV_SAMPLE_DIR)
    if out and role not in _samplers:
        _samplers[role] = StackSampler(out, float(os.environ.get(ENV_SAMPLE_INTERVAL, "0.005")), role=role,
                                       thread_name=thread_name).start()
    return _samplers.get(role)


def snapshot(out_dir: str | Path, role: str = "sched") -> dict[str, Counter]:
    """Sum of the counters of every ``role`` process in ``out_dir`` (call before and after a workload)."""
    total = {"inclusive": Counter(), "self": Counter(), "samples": Counter()}
    for path in Path(out_dir).glob(f"{role}-*.json"):
        data = json.loads(path.read_text())
        total["inclusive"].update(data["inclusive"])
        total["self"].update(data["self"])
        total["samples"]["all"] += data["samples"]
    return total


def summarize(before: dict[str, Counter], after: dict[str, Counter], top: int = 40) -> dict:
    """The share of samples per function between two snapshots, largest first."""
    n = max(1, after["samples"]["all"] - before["samples"]["all"])
    out = {"samples": n}
    for kind in ("inclusive", "self"):
        diff = after[kind] - before[kind]
        out[kind] = [(k, round(v / n, 4)) for k, v in diff.most_common(top)]
    return out
