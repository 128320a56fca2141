"""The ``eaglenest`` command line: :func:`main` (the entry point) and the typer ``app``."""

from eaglenest.cli.main import app, main

__all__ = ["app", "main"]
