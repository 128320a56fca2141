"""Running the async prefill client from sync code, so that a termination request always ends it.

Owns :func:`run_sync`, the one place the extraction enters an event loop. The loop runs on a thread of its
own and the caller's thread only waits. The reason is signals: the CLI turns SIGTERM into
``sys.exit(143)`` and a Prefect flow turns it into ``TerminationSignal`` (a ``BaseException``), each
raised from a signal handler at whatever line the main thread is running. If the loop ran on the main
thread, that line could be inside asyncio's own code, and asyncio catches ``BaseException`` there. A
socket write that catches it treats it as a failed write and closes the connection: the request is
retried and the termination is lost, so the run carries on to the end.

Invariants: the event loop never runs on the calling thread, so a handler's exception is raised where
the caller waits and nowhere else; whatever ends that wait (SIGTERM, Ctrl-C) cancels the coroutine, waits
for it to unwind (requests cancelled, connections closed, nothing sent after), then is re-raised unchanged;
the coroutine sees the caller's context variables (a Prefect run context, for example).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable
from typing import Any

POLL_S = 0.2
"""How often the waiting thread wakes. A process-directed signal that the kernel hands to another thread
is only acted on when the main thread next runs Python code; waking often bounds that delay."""

UNWIND_S = 30.0
"""How long an interrupted call waits for the coroutine to unwind before re-raising anyway (the loop's
thread is a daemon: it cannot keep the process alive)."""


CLIENT_THREAD = "eaglenest-client"
"""The name of the thread :func:`run_sync` runs its loop on (the PROFILE diagnostics sample it by name)."""


def run_sync(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``coro_fn()`` to completion on a thread of its own and return its result (or raise its error).

    Also works when the calling thread already runs an event loop."""
    started, done, box = threading.Event(), threading.Event(), {}

    async def main() -> Any:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        box["cancel"] = lambda: loop.call_soon_threadsafe(task.cancel)
        started.set()
        return await coro_fn()

    def target() -> None:
        try:
            box["value"] = asyncio.run(main())
        except BaseException as e:  # handed to the caller below
            box["error"] = e
        finally:
            started.set()
            done.set()

    # waits on events, not Thread.join: a join interrupted by a signal handler's exception can mark the thread
    # stopped while it still runs (CPython 3.11), and a second join then returns at once
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name=CLIENT_THREAD, daemon=True)
    try:
        thread.start()
        while not done.wait(POLL_S):
            pass
    except BaseException:  # a signal handler raised in this thread: stop the coroutine, then let it propagate
        if thread.ident is not None:
            started.wait(UNWIND_S)
        with contextlib.suppress(KeyError, RuntimeError):  # RuntimeError: the loop already closed
            box["cancel"]()
        done.wait(UNWIND_S)
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]
