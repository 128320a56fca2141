"""Prefect pull steps of eaglenest's deployments (run by the flow-run process on the worker, before the flow loads).

``set_working_directory_from_env`` reads the checkout's location from the worker's environment WHEN THE RUN
STARTS. (A ``{{ $EAGLENEST_ROOT }}`` placeholder in prefect.yaml is resolved by ``prefect deploy`` on the
machine that deploys whenever the variable is set there, baking that machine's path into the deployment.)
Invariant: on success the process's working directory is a checkout holding ``flows/`` and that checkout is
first on ``sys.path``, so ``flows/*.py`` entrypoints import ``eaglenest`` and ``tasks`` from the same tree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def set_working_directory_from_env(variable: str = "EAGLENEST_ROOT") -> dict[str, str]:
    """cd into the directory named by environment variable ``variable``; returns {"directory": path}."""
    value = os.environ.get(variable, "").strip()
    if not value:
        raise RuntimeError(f"pull step: {variable} is not set in the worker's environment; start the worker with "
                           f"{variable}=/path/to/eaglenest/checkout (terminal until the worker is restarted)")
    root = Path(value).expanduser().resolve()
    if not (root / "flows").is_dir():
        raise RuntimeError(f"pull step: {variable}={value} is not an eaglenest checkout (no flows/ folder in {root})")
    os.chdir(root)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return {"directory": str(root)}
