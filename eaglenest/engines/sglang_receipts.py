"""Receipts: how the writer rank tells sglang's HTTP process that a request's shard is durable (or failed).

A receipt is a small JSON file per request id in the receipt folder, published by rename after the shard
was fsynced (or naming the failure); the HTTP side polls for it before answering and consumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglenest import contract
from eaglenest.atomic import TMP_SUFFIX

log = logging.getLogger("eaglenest.sglang")


def receipt_path(receipt_dir: str | Path, rid: str) -> Path:
    return Path(receipt_dir) / (contract.shard_filename(rid) + ".json")


def write_receipt(receipt_dir: str | Path, rid: str, payload: dict[str, Any]) -> None:
    """Publish a receipt atomically (rename); no fsync: receipts are ephemeral signals, the shard
    they name was fsynced before."""
    path = receipt_path(receipt_dir, rid)
    tmp = path.with_name(path.name + f".{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    tmp.write_text(json.dumps({"rid": rid, **payload}))
    os.replace(tmp, path)


def report_failure(receipt_dir: str | Path, rid: str, message: str, *, status: int = 422,
                   kind: str = "capture_invalid") -> None:
    """Log a request that will not get a shard and publish its failure receipt (terminal for that sample)."""
    log.error("eaglenest capture: %s", message)
    try:
        write_receipt(receipt_dir, rid, {"ok": False, "status": status, "kind": kind, "message": message})
    except OSError:
        log.exception("eaglenest capture: could not write the failure receipt for %r", rid)


def clear_receipt(receipt_dir: str | Path, rid: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(receipt_path(receipt_dir, rid))


async def wait_for_receipt(
    receipt_dir: str | Path, rid: str, *, timeout_s: float,
    sleep: Callable[[float], Any] = asyncio.sleep, clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Wait (polling with backoff, 1 ms up to 20 ms) for the writer's receipt; consume and return it.

    On timeout returns a failure receipt (status 504) instead of raising."""
    path = receipt_path(receipt_dir, rid)
    deadline = clock() + timeout_s
    delay = 0.001
    while True:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            data = None
        except json.JSONDecodeError:  # never torn (rename), but be safe: read again
            data = None
        if data is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return data
        if clock() >= deadline:
            return {"rid": rid, "ok": False, "status": 504, "kind": "capture_timeout",
                    "message": f"shard for {rid!r} not durable after {timeout_s:.0f} s; see the sglang log "
                               "(scheduler, writer rank) for the capture error"}
        await sleep(delay)
        delay = min(delay * 2, 0.02)
