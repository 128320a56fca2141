"""Launching a real SGLang server with the eaglenest capture plugin.

Owns the command line and environment of ``python -m sglang.launch_server`` for capture:

- the correctness flags (:data:`sglang_guards.REQUIRED_FLAGS`: prefix reuse off, prefill CUDA graphs
  off, no warmup request) come first; chunked prefill stays on (the plugin coalesces chunks per
  request); user sglang arguments follow unchanged, and any that contradict the guards are refused
  before anything starts (:class:`SGLangArgsError`);
- the environment enables the plugin (:class:`CaptureConfig` variables); when the entry point
  ``sglang.srt.plugins: eaglenest_capture`` is not discoverable (eaglenest only on PYTHONPATH, not
  pip-installed) a tiny generated ``*.dist-info`` is put first on the child's PYTHONPATH;
- :func:`serve_foreground` checks the installed sglang source first (:func:`check_compat`), starts the
  server in its own process group (:class:`pool.ServerProcess`), calls it ready only after a real
  generation succeeded and ``/get_model_info`` shows the capture block, mirrors its log, and ends the
  whole group on every exit path (log tail on failure).

Durability: the plugin answers a captured request only after its shard is durable (fsync + rename),
and names it in ``meta_info.capture``; a failed capture answers 422 / 507 / 504.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from eaglenest import __version__, contract
from eaglenest.engines.pool import LaunchError, local_server, log_tail, probe_ready
from eaglenest.engines.sglang_capture import ENV_RECEIPT_DIR, CaptureConfig
from eaglenest.engines.sglang_compat import SUPPORTED_SGLANG_VERSIONS, SGLangCompatError, check_compat
from eaglenest.engines.sglang_guards import REQUIRED_FLAGS, SGLangArgsError, check_user_args
from eaglenest.engines.sglang_plugin import ENTRY_POINT, PLUGIN_NAME

__all__ = [
    "SUPPORTED_SGLANG_VERSIONS", "LaunchError", "SGLangArgsError", "SGLangCompatError", "build_command",
    "capture_ready", "check_compat", "plugin_discoverable", "plugin_loading_env", "release_work_dir",
    "serve_foreground",
]
ENTRY_POINT_GROUP = "sglang.srt.plugins"
DIST_NAME = "eaglenest_sglang_capture"
WORK_PREFIX = "eaglenest-sglang-"


def model_depth(model_dir: Path) -> tuple[int, int]:
    """(num_hidden_layers, hidden_size) from a local HF folder's config.json (text config if nested)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise SGLangArgsError(f"{model_dir} is not a local Hugging Face model folder (no config.json)")
    config = json.loads(path.read_text())
    text = config.get("text_config") or config
    try:
        return int(text["num_hidden_layers"]), int(text["hidden_size"])
    except KeyError as e:
        raise SGLangArgsError(f"{path} has no {e.args[0]}") from None


def plugin_discoverable() -> bool:
    """Whether this interpreter's sys.path already advertises the plugin's entry point."""
    return any(ep.value == ENTRY_POINT for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def write_plugin_dist_info(site_dir: Path) -> Path:
    """A minimal distribution advertising the entry point (for eaglenest used from PYTHONPATH)."""
    dist = site_dir / f"{DIST_NAME}-{__version__}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {__version__}\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{PLUGIN_NAME} = {ENTRY_POINT}\n")
    (dist / "RECORD").write_text("")
    return dist


def build_command(
    *, model_dir: str | Path, capture_dir: str | Path | None, host: str = "127.0.0.1", port: int = 30000,
    aux_layer_ids: Sequence[int] | None = None, sglang_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv for ``python -m sglang.launch_server`` with the capture guards, and the env enabling the plugin.

    ``capture_dir=None`` gives the same server without capture (for baselines). The env must be merged
    over ``os.environ`` (``pool.ServerProcess`` does). Creates a small temporary work folder
    (receipts, generated dist-info) when needed; :func:`release_work_dir` removes it after the server.
    """
    problems = check_user_args(list(sglang_args))
    if problems:
        raise SGLangArgsError("sglang arguments contradict the capture guards:\n  - " + "\n  - ".join(problems))
    model_dir = Path(model_dir).expanduser().resolve()
    layers, _ = model_depth(model_dir)
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", host,
            "--port", str(port), *REQUIRED_FLAGS, *[str(a) for a in sglang_args]]
    if capture_dir is None:
        return argv, {}
    try:
        ids = contract.check_aux_layer_ids(aux_layer_ids or contract.default_aux_layer_ids(layers), layers)
    except contract.ContractError as e:
        raise SGLangArgsError(f"aux layers for {model_dir.name}: {e}") from None
    work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
    config = CaptureConfig(capture_dir=Path(capture_dir).expanduser().resolve(), receipt_dir=work / "receipts",
                           aux_layer_ids=ids)
    return argv, {**config.to_env(), **plugin_loading_env(work / "site")}


def plugin_loading_env(site_dir: Path) -> dict[str, str]:
    """What a child ``sglang.launch_server`` needs in its env (merged over ``os.environ``) to load the plugin:
    eaglenest on its PYTHONPATH, a generated dist-info in ``site_dir`` when the entry point is not installed, and
    the plugin named in ``SGLANG_PLUGINS`` when that allow-list is set."""
    paths = []
    if not plugin_discoverable():
        write_plugin_dist_info(site_dir)
        paths.append(str(site_dir))
    paths.append(str(Path(__file__).resolve().parents[2]))  # the folder holding the eaglenest package
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        env["SGLANG_PLUGINS"] = f"{allowed},{PLUGIN_NAME}"
    return env


def release_work_dir(env: dict[str, str]) -> None:
    """Remove the temporary work folder build_command made for ``env`` (after the server stopped)."""
    receipts = env.get(ENV_RECEIPT_DIR)
    if receipts and Path(receipts).parent.name.startswith(WORK_PREFIX):
        shutil.rmtree(Path(receipts).parent, ignore_errors=True)


def capture_ready(url: str, *, expect_capture: bool = True, timeout_s: float = 30.0) -> bool:
    """Ready = a real generation succeeded; with capture, /get_model_info must also show the plugin."""
    if not probe_ready(url, timeout_s=timeout_s):
        return False
    if not expect_capture:
        return True
    try:
        info = httpx.get(f"{url}/get_model_info", timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return False
    block = info.get("capture") if isinstance(info, dict) else None
    if not isinstance(block, dict) or not block.get("enabled"):
        raise LaunchError(f"sglang at {url} serves, but the eaglenest capture plugin is not active in its HTTP "
                          "process (no 'capture' in /get_model_info): is the entry point discoverable and "
                          "EAGLENEST_CAPTURE_DIR set?")
    return True


def _follow(path: Path, stop: threading.Event) -> None:
    """Mirror the server log to stderr until ``stop`` is set."""
    with contextlib.suppress(OSError):
        while not path.exists() and not stop.is_set():
            time.sleep(0.2)
        with open(path, errors="replace") as f:
            while not stop.is_set():
                line = f.readline()
                if line:
                    sys.stderr.write(line)
                else:
                    time.sleep(0.2)


def serve_foreground(
    *, model_dir: str | Path, capture_dir: str | Path | None, host: str, port: int,
    aux_layer_ids: Sequence[int] | None, sglang_args: Sequence[str], ready_timeout_s: float | None = None,
) -> None:
    """``eaglenest serve --engine sglang``: serve until interrupted; raises LaunchError on failure."""
    version = check_compat()
    cmd, env = build_command(model_dir=model_dir, capture_dir=capture_dir, host=host, port=port,
                             aux_layer_ids=aux_layer_ids, sglang_args=sglang_args)
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    log_dir = Path(capture_dir).expanduser().resolve().parent if capture_dir else Path(tempfile.gettempdir())
    server = local_server(cmd, host=probe_host, port=port, env=env, log_path=log_dir / f"sglang-server-{port}.log")
    timeout = ready_timeout_s or float(os.environ.get("EAGLENEST_SGLANG_READY_TIMEOUT_S", "900"))
    print(f"sglang {version}: {' '.join(cmd)}\nlog: {server.log_path}", file=sys.stderr, flush=True)
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(server.log_path, stop), daemon=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        server.start()
        follower.start()

        def ready(url: str) -> bool:
            return capture_ready(url, expect_capture=capture_dir is not None)

        server.wait_ready(timeout_s=timeout, ready=ready)
        print(f"ready on {server.url} (capture {'-> ' + str(capture_dir) if capture_dir else 'off'})",
              file=sys.stderr, flush=True)
        code = server.proc.wait() if server.proc else 0
        if code:
            raise LaunchError(f"sglang exited with code {code}\n--- log tail ({server.log_path}) ---\n"
                              + log_tail(server.log_path))
    finally:
        stop.set()
        server.stop()
        signal.signal(signal.SIGTERM, previous)
        release_work_dir(env)

