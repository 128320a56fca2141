"""Running the embedded engine: blocking (CLI) or on a background thread (tests, benchmarks).

Owns the uvicorn lifecycle for :mod:`eaglenest.engines.embedded`. Binds 127.0.0.1 unless told
otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from eaglenest.engines.embedded import EmbeddedEngine, ServerSettings
from eaglenest.engines.embedded_http import create_app
from eaglenest.engines.pool import free_port
from eaglenest.engines.runtime import TargetRunner


def build_engine(
    model_dir: str | Path,
    *,
    capture_dir: str | Path | None,
    aux_layer_ids: Sequence[int] | None = None,
    dtype: str = "auto",
    settings: ServerSettings | None = None,
) -> EmbeddedEngine:
    """The capture server's engine, its model loaded on the engine's scheduler thread."""
    return EmbeddedEngine.load(lambda: (TargetRunner(model_dir, dtype=dtype, aux_layer_ids=aux_layer_ids), None),
                               capture_dir=capture_dir, settings=settings)


def serve(engine: EmbeddedEngine, *, host: str = "127.0.0.1", port: int = 30000, log_level: str = "warning") -> None:
    """Serve until interrupted (SIGINT/SIGTERM), then drain the shard writer."""
    try:
        uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level, access_log=False)
    finally:
        engine.close()


class BackgroundServer:
    """The embedded server on a daemon thread: ``with BackgroundServer(engine) as url: ...``."""

    def __init__(self, engine: EmbeddedEngine, *, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.engine = engine
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(create_app(engine), host=self.host, port=self.port, log_level="warning",
                                access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="embedded-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"embedded server did not start on {self.url}")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
