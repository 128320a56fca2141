"""SIGTERM during a live benchmark level ends the bench: the handler's exception reaches the caller instead of
being taken by asyncio for a failed socket write (which turned into one failed request, and the bench ran on)."""

import pytest

from eaglenest.speculative.loadgen import run_levels
from tests.sigterm_helpers import HANDLERS, SlowServer, sigterm_handler, sigterm_in_socket_send, slow_server  # noqa: F401


@pytest.mark.parametrize("kind", HANDLERS)
def test_sigterm_inside_a_socket_write_ends_the_bench(kind, slow_server, monkeypatch):  # noqa: F811
    handler, raised = HANDLERS[kind]
    sigterm_in_socket_send(monkeypatch, at=5)
    with sigterm_handler(handler), pytest.raises(raised):
        run_levels(slow_server, [[1, 2, 3]] * 4, [2, 2], max_new_tokens=8, requests_per_level=40)
    assert SlowServer.served < 40  # the first level never finished, and no second one started
