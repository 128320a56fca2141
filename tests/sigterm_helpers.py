"""What the SIGTERM tests share: the handlers (Prefect-like and the CLI's), a slow HTTP server that counts the
requests it served, and a hook that signals this process from inside asyncio's socket write, the line where a
handler's exception used to be taken for a failed write."""

import asyncio.selector_events
import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class Terminated(BaseException):
    """What Prefect's SIGTERM handler raises (TerminationSignal): a BaseException that is not SystemExit, which
    asyncio does not re-raise from its transports and callbacks."""


def raise_terminated(*_):
    raise Terminated


HANDLERS = {"prefect-like": (raise_terminated, Terminated), "cli": (lambda *_: sys.exit(143), SystemExit)}


@contextmanager
def sigterm_handler(handler):
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class SlowServer(BaseHTTPRequestHandler):
    """Answers every POST after 50 ms with an empty ``meta_info``; ``served`` counts the answers."""

    served = 0

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        time.sleep(0.05)
        type(self).served += 1
        body = json.dumps({"meta_info": {}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


@pytest.fixture
def slow_server(monkeypatch):
    monkeypatch.setattr(SlowServer, "served", 0)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), SlowServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


class _SignallingSocket:
    """A transport's socket whose ``at``-th send is followed by SIGTERM to this process, while asyncio's write
    still runs inside its own ``try``."""

    sends = 0

    def __init__(self, real, at):
        self._real, self._at = real, at

    def __getattr__(self, name):
        return getattr(self._real, name)

    def send(self, data):
        n = self._real.send(data)
        type(self).sends += 1
        if type(self).sends == self._at:
            signal.raise_signal(signal.SIGTERM)
        return n


def sigterm_in_socket_send(monkeypatch, at):
    """From now on (undone with ``monkeypatch``), the ``at``-th socket send of any asyncio transport is followed
    by SIGTERM to this process."""
    transport_cls = asyncio.selector_events._SelectorSocketTransport
    init = transport_cls.__init__

    def wrapped_init(self, loop, sock, *args, **kwargs):
        init(self, loop, sock, *args, **kwargs)
        self._sock = _SignallingSocket(self._sock, at=at)

    monkeypatch.setattr(transport_cls, "__init__", wrapped_init)
    monkeypatch.setattr(_SignallingSocket, "sends", 0)
