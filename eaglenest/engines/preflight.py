"""Preflight: read every capture server's contract before any sample is sent.

:func:`preflight` reads ``/get_model_info`` (+ ``/get_server_info``) of every server: capture on, aux
layers / hidden size / provenance, the servers' capture folders, and the context length. A server whose
capture contract disagrees with the run (or with the other servers) is refused with :class:`PreflightError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from eaglenest import contract


class PreflightError(RuntimeError):
    """A server's capture contract disagrees with the run. Terminal: fix the launch, then re-run."""

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
