"""A flow run from the command line on a machine that never ran Prefect: its temporary server gets time to
create its database (the first `make demo` of a fresh machine had timed out at Prefect's 20 s)."""

from __future__ import annotations

import os

import flows


def test_the_temporary_server_gets_time_for_its_first_start_unless_the_user_set_it(monkeypatch):
    key = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
    monkeypatch.delenv(key, raising=False)
    flows.allow_slow_first_start()
    assert int(os.environ[key]) >= 120
    monkeypatch.setenv(key, "45")
    flows.allow_slow_first_start()
    assert os.environ[key] == "45"
