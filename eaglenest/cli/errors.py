"""Which failures are the user's to fix, and how they are reported: one line, exit code 2.

Expected mistakes (a missing source or model, an unknown protocol, an invalid option value, a missing
store, an existing export folder, a missing fsspec backend or credentials) end in one line that says what
is wrong and what to do; a traceback is printed only with ``--debug`` (or ``EAGLENEST_DEBUG=1``). Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

USER_ERROR_EXIT = 2


class UsageError(ValueError):
    """A command line that cannot work as given (the message says what to give instead)."""


def _project_errors() -> tuple[type[BaseException], ...]:
    from pydantic import ValidationError

    from eaglenest.contract import ContractError
    from eaglenest.data.sources import SourceError
    from eaglenest.drafter.checkpoint import CheckpointError
    from eaglenest.engines.pool import LaunchError
    from eaglenest.engines.preflight import PreflightError
    from eaglenest.engines.sglang_compat import SGLangCompatError
    from eaglenest.engines.sglang_guards import SGLangArgsError
    from eaglenest.extraction.state import ExtractionError
    from eaglenest.models import ModelError
    from eaglenest.packaged_data import WheelFetchError
    from eaglenest.store.layout import StoreError

    return (UsageError, ValidationError, ContractError, SourceError, CheckpointError, LaunchError, PreflightError,
            SGLangCompatError, SGLangArgsError, ExtractionError, ModelError, WheelFetchError, StoreError,
            FileExistsError, FileNotFoundError)


def _validation_line(e) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err.get("loc", ())) or e.title
        if err.get("type") == "extra_forbidden":
            parts.append(f"{where}: not a {e.title} field")
        elif "input" in err and err.get("type") not in ("missing", "model_type"):
            parts.append(f"{where}: {err['msg']} (got {err['input']!r})")
        else:
            parts.append(f"{where}: {err['msg']}")
    return f"invalid {e.title}: " + "; ".join(parts) + " (fix the option or the --params file)"


def user_error_line(e: BaseException) -> str | None:
    """The one line for an expected user mistake, or None when ``e`` is a bug (keep its traceback)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        return _validation_line(e)
    if isinstance(e, _project_errors()):
        return " ".join(str(e).split()) or type(e).__name__
    text = " ".join(str(e).split())
    if isinstance(e, ValueError) and text.startswith("Protocol not known"):
        protocol = text.rsplit(":", 1)[-1].strip()
        return (f"unknown storage protocol {protocol!r}: use a local path or a URL fsspec knows "
                "(file://, memory://, s3://, gs://, ...)")
    if isinstance(e, ImportError) and text.startswith("Install "):  # fsspec: "Install s3fs to access S3"
        return f"{text} (the URL's storage backend is not installed; pip install it, or use a local path)"
    if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return f"{text}: set the object store's credentials (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    return None


_debug = False


def debug_requested(argv: list[str] | None = None) -> bool:
    """``--debug`` on this command line (``argv`` given: remembered for :func:`one_line` until the next one)
    or ``EAGLENEST_DEBUG=1``."""
    global _debug
    if argv is not None:
        _debug = "--debug" in argv
    return _debug or os.environ.get("EAGLENEST_DEBUG", "") not in ("", "0")


def one_line(command: Callable) -> Callable:
    """Wrap a command: a user error becomes one line on stderr and exit code 2 (unless debugging)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Exception as e:
            code = report(e, debug=debug_requested(), prog="eaglenest")
            if code is None:
                raise
            raise SystemExit(code) from None

    return wrapper


def report(e: BaseException, *, debug: bool, prog: str) -> int | None:
    """Print a user error as one line and return its exit code; None: not a user error (re-raise it)."""
    line = user_error_line(e)
    if line is None or debug:
        return None
    print(f"{prog}: error: {line}", file=sys.stderr)
    return USER_ERROR_EXIT
