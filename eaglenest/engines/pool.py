"""Engine server processes: the one place that launches, records and stops them.

Owns the life of every external server (the embedded server as a subprocess, SGLang), for the extraction,
the benchmarks and the GPU scripts alike:

- :class:`ServerProcess` starts a command in its own process group (log in a file). The child asks the
  kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), so a launcher killed with SIGKILL takes
  its server along; the fork happens on one long-lived thread because that signal follows the *thread*
  that forked, not the process. A port that already answers is refused before anything starts (a leftover
  server would otherwise be fed or measured in its place), and every launch carries a token
  (``EAGLENEST_LAUNCH_TOKEN``) that a server reporting one in ``/get_server_info`` (the embedded server)
  must echo before it counts as ours.
- Ready means a real ``/generate`` succeeded (``/health`` alone can lie) within a bounded time; otherwise
  :class:`LaunchError` carries the log tail and the whole group is killed. Every exit path sends the whole
  group SIGTERM, then SIGKILL after a grace period.
- :class:`ServerRecords` is the one record format (``servers.json``: pid, command line and URL of each
  launched server). Ending recorded servers compares ``/proc/<pid>/cmdline`` with the recorded command,
  so a recycled PID is never killed.
- A pool of them (given URLs or N launched servers, relaunches, late joins) is
  :class:`eaglenest.engines.server_pool.ServerPool`.
- Commands: :func:`embedded_command`; SGLang's flags and placements live in :mod:`eaglenest.engines.sglang_flags`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from eaglenest import contract
from eaglenest.atomic import atomic_write_bytes

ENV_LAUNCH_TOKEN = "EAGLENEST_LAUNCH_TOKEN"
_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """The server did not become ready; the message ends with its log tail."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_serving(url: str, *, timeout_s: float = 0.5) -> bool:
    """Whether something already accepts connections where ``url`` points."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=timeout_s):
            return True
    except OSError:
        return False


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
    try:
        with httpx.Client(timeout=timeout_s) as c:
            if c.get(f"{url}/health").status_code != 200:
                return False
            r = c.post(f"{url}/generate", json={
                "input_ids": [1, 2, 3], "rid": f"{contract.NO_CAPTURE_RID_PREFIX}ready-{time.time_ns()}",
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            })
            return r.status_code == 200
    except httpx.HTTPError:
        return False


def reported_launch_token(url: str, *, timeout_s: float = 10.0) -> str | None:
    """The launch token a server reports in ``/get_server_info`` (None: it reports none, e.g. SGLang)."""
    with contextlib.suppress(httpx.HTTPError, ValueError), httpx.Client(timeout=timeout_s) as c:
        r = c.get(f"{url}/get_server_info")
        if r.status_code == 200 and isinstance(r.json(), dict):
            token = r.json().get("launch_token")
            return str(token) if token else None
    return None


# ------------------------------------------------------------------------------ the child's parent-death signal
try:
    _libc = ctypes.CDLL(None, use_errno=True)  # loaded in the parent: the child only calls into it
except OSError:  # not Linux: servers still end on every normal exit path
    _libc = None


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    if _libc is None or not hasattr(_libc, "prctl"):
        return None

    def preexec() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the launcher died between fork and prctl
            os._exit(1)

    return preexec


_spawner: cf.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _on_spawner_thread(fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """Run ``fn`` (a fork) on the one long-lived spawner thread: PR_SET_PDEATHSIG fires when the forking
    thread ends, and launch threads (a pool's parallel launches, a task runner's workers) end early."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = cf.ThreadPoolExecutor(1, thread_name_prefix="eaglenest-spawner")
    return _spawner.submit(fn).result()


# ------------------------------------------------------------------------------ one server
@dataclass
class ServerProcess:
    """A launched server: its command, URL, log file and process (leader of its own group)."""

    cmd: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Passed as ``EAGLENEST_LAUNCH_TOKEN``; a server that reports a different one is not ours."""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ServerProcess:
        if port_serving(self.url):
            raise LaunchError(f"{self.url} is already serving before launch: another server (a leftover of a "
                              "killed run?) holds the port; end it or choose another port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, ENV_LAUNCH_TOKEN: self.token}
        preexec = _die_with_parent(os.getpid())
        with open(self.log_path, "ab") as log:
            self.proc = _on_spawner_thread(lambda: subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env, preexec_fn=preexec,
            ))
        return self

    def _launch_failed(self, why: str) -> LaunchError:
        return LaunchError(f"{why}: {' '.join(self.cmd)}\n--- log tail ({self.log_path}) ---\n"
                           f"{log_tail(self.log_path)}")

    def wait_ready(
        self, *, timeout_s: float, poll_s: float = 0.5, ready: Callable[[str], bool] = probe_ready
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise self._launch_failed(f"server exited with code {self.proc.returncode} before becoming ready")
            if ready(self.url):
                token = reported_launch_token(self.url)
                if token is not None and token != self.token:
                    raise self._launch_failed(f"{self.url} is answered by a server this launch did not start")
                return
            time.sleep(poll_s)
        raise self._launch_failed(f"server not ready after {timeout_s:.0f} s at {self.url}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, *, grace_s: float = 10.0) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid, grace_s=grace_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)


def local_server(cmd: Sequence[str], *, port: int, log_path: Path, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> ServerProcess:
    """A not-yet-started server listening on ``host:port`` (the one place its URL is spelled)."""
    return ServerProcess(cmd=list(cmd), url=f"http://{host}:{port}", log_path=Path(log_path), env=dict(env or {}))


@contextlib.contextmanager
def launched(server: ServerProcess, *, timeout_s: float = 300.0, ready: Callable[[str], bool] = probe_ready,
             records: ServerRecords | None = None,
             while_starting: Callable[[], object] | None = None) -> Iterator[ServerProcess]:
    """Start, record, run ``while_starting`` (CPU work overlapping the server's start-up), wait until ready,
    yield; the process group is ended on every exit path."""
    server.start()
    try:
        if records is not None:
            records.add(server)
        if while_starting is not None:
            while_starting()
        server.wait_ready(timeout_s=timeout_s, ready=ready)
        yield server
    finally:
        server.stop()
        if records is not None:
            records.remove(server)


# ------------------------------------------------------------------------------ records
@dataclass(frozen=True, slots=True)
class ServerRecord:
    pid: int
    cmd: tuple[str, ...]
    url: str

    def running(self) -> bool:
        """Whether ``pid`` still runs the recorded command (a recycled PID runs something else)."""
        try:
            argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return tuple(a.decode(errors="replace") for a in argv if a)[: len(self.cmd)] == self.cmd


class ServerRecords:
    """``servers.json``: the servers launched for one extraction or benchmark, so a later run or a crash hook
    can end them. Rewritten atomically on every change; removed when no server is left."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def read(self) -> list[ServerRecord]:
        try:
            data = json.loads(self.path.read_text())
            return [ServerRecord(int(s["pid"]), tuple(s["cmd"]), str(s["url"])) for s in data["servers"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def _write(self, records: list[ServerRecord]) -> None:
        if not records:
            self.path.unlink(missing_ok=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"servers": [{"pid": r.pid, "cmd": list(r.cmd), "url": r.url} for r in records]}
        atomic_write_bytes(self.path, json.dumps(data).encode())

    def add(self, server: ServerProcess) -> None:
        if server.pid is None:
            return
        with self._lock:
            self._write([r for r in self.read() if r.pid != server.pid]
                        + [ServerRecord(server.pid, tuple(server.cmd), server.url)])

    def remove(self, server: ServerProcess) -> None:
        with self._lock:
            self._write([r for r in self.read() if r.pid != server.pid])

    def pids(self) -> list[int]:
        return [r.pid for r in self.read()]

    def end_all(self, *, grace_s: float = 5.0) -> int:
        """End every recorded group that still runs its recorded command; clears the record. Returns how many."""
        with self._lock:
            live = [r for r in self.read() if r.running()]
            for r in live:
                kill_group(r.pid, grace_s=grace_s)
            self._write([])
        return len(live)


def end_recorded_servers(path: str | Path, *, grace_s: float = 5.0) -> int:
    """Crash teardown: end the servers recorded in ``path`` (checked by command line); returns how many."""
    return ServerRecords(path).end_all(grace_s=grace_s)


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
