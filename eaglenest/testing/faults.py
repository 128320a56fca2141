"""Opt-in fault injection for the embedded server, so tests can break it the way real servers break.

Enabled only by the environment variable ``EAGLENEST_FAULTS`` (read when the app is created), e.g.
``EAGLENEST_FAULTS="fail_every=3,hang_every=5,hang_s=2,exit_after=20"``. Every ``POST /generate`` is
counted (1, 2, 3, ...; the launcher's readiness probe included):

- ``fail_every=K``: request n with n % K == 0 is answered ``fail_status`` (default 503) at once.
- ``hang_every=M``: request n with n % M == 0 is held ``hang_s`` seconds (default 3600), then answered
  503 without being served (the client's timeout fires first: a hung server that never does the work).
- ``exit_after=N``: request N + 1 ends the whole process at once (``os._exit(17)``), in-flight requests
  included (a crash mid-batch). Use it only in a subprocess server.
- ``gate=PATH``: the faults above apply only while the file PATH exists; requests arriving while it is
  absent pass through untouched and are not counted (so a test can plant a failure, then lift it before
  a retry without changing the run's parameters or environment). The count restarts at 1 each time
  the gate is planted again. Checked per request (one ``stat``).

Without the variable nothing is wrapped. Nothing here is used in production paths.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

from eaglenest.engines import ENV_FAULTS as ENV


@dataclass(frozen=True, slots=True)
class Faults:
    fail_every: int = 0
    fail_status: int = 503
    hang_every: int = 0
    hang_s: float = 3600.0
    exit_after: int = 0
    gate: str | None = None

    @property
    def active(self) -> bool:
        """Whether the faults apply now (always without a gate; else while the gate file exists)."""
        return self.gate is None or os.path.exists(self.gate)

    @classmethod
    def parse(cls, text: str) -> Faults:
        kwargs: dict[str, float | int | str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key not in cls.__dataclass_fields__:
                raise ValueError(f"{ENV}: unknown fault {key!r} (known: {', '.join(cls.__dataclass_fields__)})")
            if key == "gate":
                if not value:
                    raise ValueError(f"{ENV}: gate needs a file path (gate=/path/to/file)")
                kwargs[key] = value
            else:
                kwargs[key] = float(value) if key == "hang_s" else int(value)
        return cls(**kwargs)

    @classmethod
    def from_env(cls) -> Faults | None:
        text = os.environ.get(ENV, "").strip()
        return cls.parse(text) if text else None


class FaultMiddleware:
    """Pure ASGI middleware applying :class:`Faults` to ``POST /generate``."""

    def __init__(self, app, faults: Faults) -> None:
        self.app, self.faults, self.count, self.was_active = app, faults, 0, False

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") != "/generate":
            await self.app(scope, receive, send)
            return
        active = self.faults.active
        if active and not self.was_active:
            self.count = 0  # a (re)planted gate starts counting afresh
        self.was_active = active
        if not active:
            await self.app(scope, receive, send)
            return
        self.count += 1
        n, f = self.count, self.faults
        if f.exit_after and n > f.exit_after:
            os._exit(17)
        if f.fail_every and n % f.fail_every == 0:
            await self._error(send, f.fail_status, f"injected fault on request {n}")
            return
        if f.hang_every and n % f.hang_every == 0:
            await asyncio.sleep(f.hang_s)
            await self._error(send, 503, f"injected hang on request {n}")
            return
        await self.app(scope, receive, send)

    @staticmethod
    async def _error(send, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "injected", "code": status}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
