"""The capture servers an extraction talks to: launched (and relaunched) or given, and what they report.

Owns server lifetimes for one extraction run and the preflight that reads their capture contract:

- :class:`ServerPool` either attaches to given URLs (never launched, never killed) or launches N
  servers from :class:`LaunchSpec` factories in parallel, each its own process group
  (:class:`~eaglenest.engines.launcher.ServerProcess`), ready only after a real request. A failed
  launch stops every server it started and raises ``LaunchError`` with the log tail.
  :meth:`ServerPool.revive` relaunches owned servers that died or stopped answering (bounded).
  The pids are written to ``servers.json`` so a crash hook can end the groups.
- :func:`preflight` reads ``/get_model_info`` (+ ``/get_server_info``) of every server: capture on,
  aux layers / hidden size / provenance, the servers' capture folders, and the context length.

Invariants: every exit path of ``with ServerPool(...)`` ends the process groups it started; a server
whose capture contract disagrees with the run is refused before any sample is sent.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from eaglenest import contract
from eaglenest.engines.launcher import LaunchError, ServerProcess, kill_group, probe_ready


class PreflightError(RuntimeError):
    """A server's capture contract disagrees with the run. Terminal: fix the launch, then re-run."""


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """How to start one server: ``make(port)`` returns a not-yet-started ServerProcess (or any object with
    its ``start / wait_ready / alive / stop / url / pid`` interface, e.g. an in-thread server in tests)."""

    name: str
    make: Callable[[int], ServerProcess]


@dataclass(slots=True)
class _Owned:
    spec: LaunchSpec
    process: ServerProcess | None = None
    relaunches: int = 0


@dataclass
class ServerPool:
    urls_given: Sequence[str] = ()
    specs: Sequence[LaunchSpec] = ()
    launch_timeout_s: float = 600.0
    max_relaunches: int = 3
    record_path: Path | None = None
    """Where the launched pids are written (``servers.json``), for crash teardown."""
    ready: Callable[[str], bool] = probe_ready
    port: Callable[[], int] = field(default=lambda: _free_port())
    _owned: list[_Owned] = field(default_factory=list, init=False)
    launched: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _closing: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if bool(self.urls_given) == bool(self.specs):
            raise ValueError("a ServerPool needs server URLs or launch specs (exactly one of them)")
        self._owned = [_Owned(s) for s in self.specs]
        if self.ready is probe_ready:  # a probe never waits longer than the launch bound
            self.ready = functools.partial(probe_ready, timeout_s=min(30.0, self.launch_timeout_s))

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> ServerPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def urls(self) -> list[str]:
        if self.urls_given:
            return [u.rstrip("/") for u in self.urls_given]
        return [o.process.url for o in self._owned if o.process is not None]

    def pids(self) -> list[int]:
        return [o.process.pid for o in self._owned
                if o.process is not None and o.process.pid is not None and o.process.alive()]

    def start(self) -> list[str]:
        if self.urls_given:
            down = [u for u in self.urls if not self.ready(u)]
            if down:
                raise LaunchError(f"given servers are not answering: {', '.join(down)} (start them, or let the "
                                  "extraction launch servers by leaving server_urls empty)")
            return self.urls
        self._closing = False
        ex = cf.ThreadPoolExecutor(len(self._owned), thread_name_prefix="launch")
        try:
            for f in [ex.submit(self._launch, o) for o in self._owned]:
                f.result()
        except BaseException:  # a failed launch or a signal: end every group now (their waits then fail fast)
            self.stop()
            raise
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
        return self.urls

    def _launch(self, owned: _Owned) -> None:
        proc = owned.spec.make(self.port())
        with self._lock:
            if self._closing:
                raise LaunchError("the pool is stopping; not launching")
            owned.process = proc
            proc.start()
            self.launched += 1
            self._record()
        proc.wait_ready(timeout_s=self.launch_timeout_s, ready=self.ready)

    def stop(self) -> None:
        with self._lock:
            self._closing = True
        for o in self._owned:
            if o.process is not None:
                o.process.stop()
        with self._lock:
            self._record()

    def _record(self) -> None:
        if self.record_path is not None:
            data = {"pids": self.pids(), "urls": self.urls}
            contract.atomic_write_bytes(self.record_path, json.dumps(data).encode())

    def revive(self) -> int:
        """Relaunch owned servers that died or stopped answering; returns how many answer now."""
        if self.urls_given:
            return sum(1 for u in self.urls if self.ready(u))
        healthy = 0
        for o in self._owned:
            p = o.process
            if p is not None and p.alive() and self.ready(p.url):
                healthy += 1
                continue
            if o.relaunches >= self.max_relaunches:
                continue
            if p is not None:
                p.stop()
            o.relaunches += 1
            try:
                self._launch(o)
                healthy += 1
            except LaunchError:
                if o.process is not None:
                    o.process.stop()
        return healthy

    @property
    def relaunches(self) -> int:
        return sum(o.relaunches for o in self._owned)


def _free_port() -> int:
    from eaglenest.engines.serving import free_port

    return free_port()


def end_recorded_servers(record_path: str | Path, *, grace_s: float = 5.0) -> int:
    """Crash teardown: end every process group named in ``servers.json``; returns how many were named."""
    try:
        pids = json.loads(Path(record_path).read_text()).get("pids", [])
    except (OSError, ValueError):
        return 0
    for pid in pids:
        kill_group(int(pid), grace_s=grace_s)
    return len(pids)


# ------------------------------------------------------------------------------ preflight
@dataclass(frozen=True, slots=True)
class ServerInfo:
    url: str
    capture: dict | None
    """The /get_model_info "capture" block (None: the server does not report one, e.g. SGLang)."""
    context_length: int | None


@dataclass(frozen=True, slots=True)
class Preflight:
    provenance: contract.Provenance | None
    aux_layer_ids: tuple[int, ...] | None
    context_length: int | None
    capture_dirs: tuple[str, ...]
    servers: tuple[ServerInfo, ...]


def _get(client: httpx.Client, url: str, paths: Sequence[str]) -> dict:
    for p in paths:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = client.get(url + p)
            if r.status_code == 200 and isinstance(r.json(), dict):
                return r.json()
    return {}


def read_server(url: str, *, timeout_s: float = 30.0, transport: httpx.BaseTransport | None = None) -> ServerInfo:
    with httpx.Client(timeout=timeout_s, transport=transport) as c:
        info = _get(c, url, ("/get_model_info", "/model_info"))
        if not info:
            raise PreflightError(f"{url}/get_model_info did not answer with a JSON object; is it an SGLang-style "
                                 "server?")
        server = _get(c, url, ("/get_server_info", "/server_info"))
    lengths = [v for v in (info.get("context_length"), server.get("context_length"))
               if isinstance(v, int) and v > 0]
    if isinstance(server.get("max_req_input_len"), int) and server["max_req_input_len"] > 0:
        lengths.append(server["max_req_input_len"] + 1)
    cap = info.get("capture")
    return ServerInfo(url, cap if isinstance(cap, dict) else None, min(lengths) if lengths else None)


def preflight(urls: Sequence[str], *, aux_layer_ids: Sequence[int] | None, require_capture_block: bool,
              hidden_size: int, reader: Callable[[str], ServerInfo] = read_server) -> Preflight:
    """Read every server's capture contract and refuse disagreements (with the run or between servers)."""
    infos = [reader(u) for u in urls]
    provs: list[contract.Provenance] = []
    aux: tuple[int, ...] | None = tuple(aux_layer_ids) if aux_layer_ids is not None else None
    dirs: list[str] = []
    for s in infos:
        if s.capture is None:
            if require_capture_block:
                raise PreflightError(f"{s.url} reports no capture block in /get_model_info: it is not a capture "
                                     "server (launch it with `eaglenest serve --capture-dir ...`)")
            continue
        if not s.capture.get("enabled", True):
            raise PreflightError(f"{s.url} has capture turned off; launch it with a capture dir")
        ids = tuple(int(i) for i in s.capture.get("aux_layer_ids") or ())
        if aux is not None and ids and ids != aux:
            raise PreflightError(f"{s.url} captures aux layers {list(ids)}, the run asks for {list(aux)}; relaunch "
                                 "it with the run's aux layers or change aux_layer_ids")
        aux = ids or aux
        if s.capture.get("hidden_size") not in (None, hidden_size):
            raise PreflightError(f"{s.url} reports hidden size {s.capture['hidden_size']}, the model has "
                                 f"{hidden_size}: it serves another model")
        if s.capture.get("provenance"):
            provs.append(contract.Provenance.from_json(s.capture["provenance"]))
        if s.capture.get("capture_dir"):
            dirs.append(str(s.capture["capture_dir"]))
    for p in provs[1:]:
        diff = provs[0].mismatches(p)
        if diff:
            raise PreflightError(f"servers differ in provenance fields {diff}; one extraction needs one numerics")
    lengths = [s.context_length for s in infos if s.context_length]
    return Preflight(provs[0] if provs else None, aux, min(lengths) if lengths else None, tuple(dict.fromkeys(dirs)),
                     tuple(infos))
