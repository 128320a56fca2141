"""SIGTERM during a live benchmark level ends the bench: the handler's exception reaches the caller instead of
being taken by asyncio for a failed socket write (which turned into one failed request, and the bench ran on)."""

import asyncio.selector_events
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eaglenest.speculative.live import run_levels
from tests.extraction.test_extract_sigterm import HANDLERS, _SignallingSocket, sigterm_handler


class Generate(BaseHTTPRequestHandler):
    served = 0

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        time.sleep(0.02)
        type(self).served += 1
        body = json.dumps({"meta_info": {"completion_tokens": 8}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


@pytest.fixture
def generate_server(monkeypatch):
    monkeypatch.setattr(Generate, "served", 0)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("kind", HANDLERS)
def test_sigterm_inside_a_socket_write_ends_the_bench(kind, generate_server, monkeypatch):
    handler, raised = HANDLERS[kind]
    transport_cls = asyncio.selector_events._SelectorSocketTransport
    init = transport_cls.__init__

    def wrapped_init(self, loop, sock, *args, **kwargs):
        init(self, loop, sock, *args, **kwargs)
        self._sock = _SignallingSocket(self._sock, at=5)

    monkeypatch.setattr(transport_cls, "__init__", wrapped_init)
    monkeypatch.setattr(_SignallingSocket, "sends", 0)
    with sigterm_handler(handler), pytest.raises(raised):
        run_levels(generate_server, [[1, 2, 3]] * 4, [2, 2], max_new_tokens=8, requests_per_level=40)
    assert Generate.served < 40  # the first level never finished, and no second one started
