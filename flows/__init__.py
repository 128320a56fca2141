"""Prefect flows: composition only (extract, convert, train, bench, the whole pipeline)."""

import os

EPHEMERAL_STARTUP_S = "180"
"""Without a Prefect API URL, a flow run from the command line starts a temporary local server. On a machine
that never ran Prefect it first creates and migrates its database: 28-35 s measured on 2 cores, past Prefect's
20 s default, so the first `make demo` of a fresh machine failed with "Timed out while attempting to connect to
ephemeral Prefect API server"."""


def allow_slow_first_start() -> None:
    """Give the temporary server time for its first start (a setting the user gave wins)."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EPHEMERAL_STARTUP_S)
