"""Owning an engine server process: start in its own process group, prove it ready, tear it down.

Owns the life of external server processes (the embedded server as a subprocess, SGLang):

- The process starts in a new session (its own process group) with stdout/stderr in a log file.
- Ready means a real ``/generate`` request succeeded (``/health`` alone can lie), within a bounded
  time; otherwise :class:`LaunchError` carries the log tail and the whole group is killed.
- On every exit path (normal, exception, SIGTERM handled by the caller) the whole group gets SIGTERM,
  then SIGKILL after a grace period, so no orphaned worker survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class LaunchError(RuntimeError):
    """The server did not become ready; the message ends with its log tail."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def kill_group(pid: int, *, grace_s: float = 10.0) -> None:
    """SIGTERM the process group led by ``pid``, SIGKILL what is left after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def probe_ready(url: str, *, timeout_s: float = 30.0) -> bool:
    """One real request: /health, then a 1-token generation that is never captured."""
    from eaglenest.contract import NO_CAPTURE_RID_PREFIX

    try:
        with httpx.Client(timeout=timeout_s) as c:
            if c.get(f"{url}/health").status_code != 200:
                return False
            r = c.post(f"{url}/generate", json={
                "input_ids": [1, 2, 3], "rid": f"{NO_CAPTURE_RID_PREFIX}ready-{time.time_ns()}",
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            })
            return r.status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ServerProcess:
    """A launched server: its command, URL, log file and process (leader of its own group)."""

    cmd: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, **self.env},
            )
        return self

    def wait_ready(
        self, *, timeout_s: float, poll_s: float = 0.5, ready: Callable[[str], bool] = probe_ready
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise LaunchError(
                    f"server exited with code {self.proc.returncode} before becoming ready: {' '.join(self.cmd)}\n"
                    f"--- log tail ({self.log_path}) ---\n{log_tail(self.log_path)}"
                )
            if ready(self.url):
                return
            time.sleep(poll_s)
        raise LaunchError(
            f"server not ready after {timeout_s:.0f} s at {self.url}: {' '.join(self.cmd)}\n"
            f"--- log tail ({self.log_path}) ---\n{log_tail(self.log_path)}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, *, grace_s: float = 10.0) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid, grace_s=grace_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)


@contextlib.contextmanager
def launched(server: ServerProcess, *, timeout_s: float = 300.0,
             ready: Callable[[str], bool] = probe_ready) -> Iterator[ServerProcess]:
    """Start, wait until ready, yield; the process group is ended on every exit path."""
    server.start()
    try:
        server.wait_ready(timeout_s=timeout_s, ready=ready)
        yield server
    finally:
        server.stop()


def embedded_command(
    *, model: str, port: int, capture_dir: str | None, host: str = "127.0.0.1",
    aux_layer_ids: Sequence[int] | None = None, dtype: str = "auto", extra: Sequence[str] = (),
) -> list[str]:
    """The command line that runs ``eaglenest serve --engine embedded`` in a fresh interpreter."""
    cmd = [sys.executable, "-m", "eaglenest", "serve", "--engine", "embedded", "--model", model,
           "--host", host, "--port", str(port), "--dtype", dtype]
    if capture_dir:
        cmd += ["--capture-dir", capture_dir]
    if aux_layer_ids:
        cmd += ["--aux-layers", ",".join(str(i) for i in aux_layer_ids)]
    return cmd + list(extra)
