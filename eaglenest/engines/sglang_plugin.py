"""SGLang general plugin: capture aux-layer outputs AND final-norm hidden states during prefill.

Loaded by sglang in every process through the entry-point group ``sglang.srt.plugins``
(``eaglenest_capture = eaglenest.engines.sglang_plugin:register``); no sglang source is edited.
Inert unless ``EAGLENEST_CAPTURE_DIR`` is set (the launcher sets it, see :mod:`sglang_capture`), or
``EAGLENEST_VERIFY_KERNEL=splitkv`` (an EAGLE3 server: the target's tree verify through
:mod:`sglang_tree_verify`, hooked AFTER ``ModelRunner.init_attention_backends``).

Scheduler process (every TP rank), hooks registered with sglang's HookRegistry:
- AFTER ``ModelRunner.init_attention_backends`` (target runner, before CUDA-graph capture): refuse
  unsafe server arguments (:mod:`sglang_guards`), turn on aux capture with
  ``set_eagle3_layers_to_capture(ids)`` (llama convention: ids name layers whose OUTPUT is taken;
  verified via ``layers_to_capture == ids + 1``; with EAGLE3 the draft's ids must equal ours), and on
  attention-TP rank 0 only wrap the target's ``logits_processor.forward`` (the one place that sees
  both the final-norm states and the aux states, before any pruning).
- AFTER ``ForwardBatch.init_new``: for EXTEND forwards of the target, remember per-request views
  (rid, prefix, extend and prompt lengths, prompt ids) read from the ScheduleBatch; the scheduler
  thread runs that forward next (the model sees a ``dataclasses.replace`` copy of the ForwardBatch,
  so nothing is attached to it; rids are compared instead).
- In the wrapped logits processor: split rows per request, copy only captured rows to pinned host
  buffers on a side stream (bounded slots: the scheduler waits only when ``max_inflight`` batches
  are still copying/encoding), hand them to the shard writer (coalescing, shards, receipts), which runs
  in a child process so that the scheduler thread never waits for the GIL (:mod:`sglang_staging`).
HTTP process (the one sglang.launch_server runs, not started by multiprocessing):
- ``TokenizerManager._init_req_state``: drop stale receipts of incoming rids.
- ``TokenizerManager._wait_one_response``: hold each captured request's final answer until its
  receipt says the shard is durable; add ``meta_info.capture``; a failed capture answers with the
  receipt's status (422 invalid, 409 a rid whose shard holds other tokens, 507 disk full, 504 timeout).
- ``http_server.model_info`` (serves ``/get_model_info``): add the ``capture`` block.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from typing import Any

import torch

from eaglenest import contract
from eaglenest.atomic import atomic_write_bytes, clean_temporaries
from eaglenest.engines import ENV_PROBE_DRAFT_DIR, ENV_PROFILE_DIR, ENV_VERIFY_KERNEL, VERIFY_KERNELS
from eaglenest.engines.sglang_capture import (
    PROVENANCE_FILE,
    CaptureConfig,
    CaptureError,
    CaptureWriter,
    HostBatch,
    ReqView,
    plan_segments,
    wants_capture,
)
from eaglenest.engines.sglang_compat import SUPPORTED_SGLANG_VERSIONS
from eaglenest.engines.sglang_guards import check_server_args
from eaglenest.engines.sglang_receipts import clear_receipt, wait_for_receipt
from eaglenest.engines.sglang_staging import DeviceCopier, ProcessWriter, shared_memory_available

log = logging.getLogger("eaglenest.sglang")

PLUGIN_NAME = "eaglenest_capture"
ENTRY_POINT = "eaglenest.engines.sglang_plugin:register"
T_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"
T_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
T_INIT_REQ = "sglang.srt.managers.tokenizer_manager.TokenizerManager._init_req_state"
T_WAIT_ONE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._wait_one_response"
T_MODEL_INFO = "sglang.srt.entrypoints.http_server.model_info"


class CaptureRefused(RuntimeError):
    """The server is configured so that capture would be wrong. Terminal: fix the launch."""


class CaptureFailed(ValueError):
    """A request's capture failed; sglang's HTTP layer answers with ``status_code``."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


_runtime: CaptureRuntime | None = None
_http_config: CaptureConfig | None = None


# ---------------------------------------------------------------- entry point
def register() -> None:
    """sglang calls this in every process it starts (and in the launching one)."""
    global _http_config
    config = CaptureConfig.from_env()
    probe_dir = os.environ.get(ENV_PROBE_DRAFT_DIR)
    profiling = bool(os.environ.get(ENV_PROFILE_DIR))  # opt-in diagnostics
    verify_kernel = os.environ.get(ENV_VERIFY_KERNEL, "") or "sglang"
    if verify_kernel not in VERIFY_KERNELS:  # load_plugins swallows Exceptions, not SystemExit
        raise SystemExit(f"eaglenest plugin: {ENV_VERIFY_KERNEL}={verify_kernel!r}: expected one of "
                         f"{', '.join(VERIFY_KERNELS)}")
    if config is None and not probe_dir and not profiling and verify_kernel == "sglang":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.version import __version__ as version

    if version not in SUPPORTED_SGLANG_VERSIONS:  # load_plugins swallows Exceptions, not SystemExit
        raise SystemExit(f"eaglenest capture plugin: sglang {version} is not supported "
                         f"(supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)})")
    if config is not None and multiprocessing.parent_process() is not None:  # scheduler processes
        HookRegistry.register(T_RUNNER, _after_init_attention_backends, HookType.AFTER)
        HookRegistry.register(T_INIT_NEW, _after_init_new, HookType.AFTER)
    elif config is not None:  # the process running sglang.launch_server (HTTP server, tokenizer manager)
        _http_config = config
        HookRegistry.register(T_INIT_REQ, _after_init_req_state, HookType.AFTER)
        HookRegistry.register(T_WAIT_ONE, _around_wait_one_response, HookType.AROUND)
        HookRegistry.register(T_MODEL_INFO, _around_model_info, HookType.AROUND)
    if profiling and multiprocessing.parent_process() is not None:  # diagnostics: a scheduler has a ModelRunner
        HookRegistry.register(T_RUNNER, _start_scheduler_sampler, HookType.AFTER)  # (the detokenizer has none)
    elif profiling:
        from eaglenest.testing import sglang_profiler

        sglang_profiler.maybe_start("http")
    if verify_kernel == "splitkv" and multiprocessing.parent_process() is not None:  # schedulers build the runners
        HookRegistry.register(T_RUNNER, _install_verify_kernel, HookType.AFTER)
    if probe_dir and multiprocessing.parent_process() is not None:
        from eaglenest.testing import sglang_probe

        sglang_probe.register(HookRegistry, HookType, probe_dir)


# ---------------------------------------------------------------- scheduler side
class CaptureRuntime:
    """Per scheduler process on the writer rank: batch views in, host batches out to the writer."""

    def __init__(self, *, writer: CaptureWriter, copier: DeviceCopier, num_aux: int, extend_mode: Any,
                 runner: Any = None) -> None:
        self.writer, self.copier, self.num_aux = writer, copier, num_aux
        self.extend_mode, self.runner = extend_mode, runner
        self._pending: list[ReqView] | None = None  # the scheduler thread's next target EXTEND forward

    def describe(self, forward_batch: Any, batch: Any) -> list[ReqView]:
        prefix = forward_batch.extend_prefix_lens_cpu or batch.prefix_lens
        extend = forward_batch.extend_seq_lens_cpu or batch.extend_lens
        views = []
        for i, req in enumerate(batch.reqs):
            rid = str(req.rid)
            capture, reason = wants_capture(rid), None
            if capture and (getattr(req, "to_finish", None) is not None or len(getattr(req, "output_ids", ()) or ())):
                capture = False  # aborting, or a re-prefill after retraction (prompt already captured)
            elif capture and getattr(req, "input_embeds", None) is not None:
                capture, reason = False, "requests given as input_embeds cannot be captured (no token ids)"
            elif capture and getattr(req, "multimodal_inputs", None) is not None:
                capture, reason = False, "multimodal requests are not supported by the capture plugin"
            prompt = req.origin_input_ids
            views.append(ReqView(rid, int(prefix[i]), int(extend[i]), len(prompt), capture,
                                 prompt if capture else None, reason))
        return views

    def _fail(self, views: list[ReqView], message: str) -> None:
        for v in views:
            if v.capture:
                self.writer.fail(v.rid, f"capture of {v.rid!r} failed: {message}", status=500, kind="capture_error")

    def on_init_new(self, forward_batch: Any, batch: Any, runner: Any) -> None:
        """Remember the views of the target's next EXTEND forward. They are kept here, not on the
        ForwardBatch: runners hand the model a ``dataclasses.replace`` copy (eager static buffers)."""
        if runner is not self.runner or forward_batch.forward_mode != self.extend_mode or batch is None:
            return
        views = self.describe(forward_batch, batch)
        for v in views:
            if v.skip_reason and v.prefix_len == 0:
                self.writer.fail(v.rid, f"{v.rid!r}: {v.skip_reason}", kind="not_capturable")
        stale, self._pending = self._pending, (views if any(v.capture for v in views) else None)
        if stale:
            self._fail(stale, "its prefill forward never reached the logits processor")

    def on_logits(self, forward_batch: Any, hidden_states: torch.Tensor, aux: Any) -> None:
        views = self._pending
        if views is None or getattr(forward_batch, "forward_mode", None) != self.extend_mode:
            return
        self._pending = None
        rids = getattr(forward_batch, "rids", None)
        if rids is not None and [str(r) for r in rids] != [v.rid for v in views]:
            self._fail(views, "the forward's requests differ from the scheduled batch")
            return
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            raise CaptureRefused("eaglenest capture: a prefill forward is being recorded into a CUDA graph; launch "
                                 "with --cuda-graph-backend-prefill disabled")
        captured = [v for v in views if v.capture]
        try:
            # llama returns a list of k [N, H] tensors; some models pack them as one [N, k*H] (same order)
            aux_list = [aux] if isinstance(aux, torch.Tensor) else list(aux or [])
            width = sum(int(a.shape[-1]) for a in aux_list)
            if width != self.num_aux * int(hidden_states.shape[-1]):
                raise CaptureError(f"the model returned aux states of width {width}, expected {self.num_aux} x "
                                   f"{hidden_states.shape[-1]} (is aux capture on for this model?)")
            segments, ranges = plan_segments(views, int(hidden_states.shape[0]))
            aux_host, fin_host, ready, release, where = self.copier.stage(hidden_states, aux_list, ranges)
        except Exception as e:
            log.exception("eaglenest capture: batch not captured")
            for v in captured:
                self.writer.fail(v.rid, f"capture of {v.rid!r} failed: {e}", status=500, kind="capture_error")
            return
        self.writer.submit(HostBatch(segments, aux_host, fin_host, ready, release, where))


def _layers_to_capture(model: Any) -> list[int]:
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers_to_capture", None) or getattr(model, "layers_to_capture", None) or [])


def _enable_aux_capture(model: Any, ids: tuple[int, ...]) -> None:
    expected = [i + 1 for i in ids]
    name = type(model).__name__
    if not callable(getattr(model, "set_eagle3_layers_to_capture", None)):
        raise CaptureRefused(f"eaglenest capture: {name} has no set_eagle3_layers_to_capture; model not supported")
    if getattr(model, "capture_aux_hidden_states", False):  # EAGLE3 already configured it from the draft
        have = _layers_to_capture(model)
        if have != expected:
            raise CaptureRefused(f"eaglenest capture: the server already captures aux layers {[i - 1 for i in have]} "
                                 f"(the EAGLE3 draft's ids) but capture was asked for {list(ids)}; pass the draft's "
                                 "eagle_aux_hidden_state_layer_ids as --aux-layers")
        return
    model.set_eagle3_layers_to_capture(list(ids))
    if _layers_to_capture(model) != expected:
        raise CaptureRefused(f"eaglenest capture: {name} maps aux ids {list(ids)} to layers "
                             f"{_layers_to_capture(model)}, not {expected} (llama convention); model not supported")


def _provenance(runner: Any, ids: tuple[int, ...]) -> contract.Provenance:
    from sglang.version import __version__

    from eaglenest.models import model_fingerprint

    mc, args = runner.model_config, runner.server_args
    return contract.Provenance(
        engine="sglang", engine_version=__version__, model_path=str(args.model_path),
        dtype=str(runner.dtype).removeprefix("torch."), tp_size=int(args.tp_size),
        attention_backend=str(getattr(runner, "prefill_attention_backend_str", None) or args.attention_backend),
        aux_layer_ids=ids, hidden_size=int(mc.hidden_size), num_layers=int(mc.num_hidden_layers),
        **model_fingerprint(args.model_path),
    )


def setup_runtime(runner: Any, config: CaptureConfig) -> CaptureRuntime | None:
    """Check the server, enable aux capture on the target model; on the writer rank build the runtime."""
    problems = check_server_args(runner.server_args)
    from sglang.srt.plugins.hook_registry import HookRegistry

    if T_INIT_NEW not in HookRegistry._patched:
        problems.append(f"hook on {T_INIT_NEW} was not applied (see the plugin errors above in this log)")
    if problems:
        raise CaptureRefused("eaglenest capture refused:\n  - " + "\n  - ".join(problems))
    mc = runner.model_config
    layers = int(mc.num_hidden_layers)
    ids = contract.check_aux_layer_ids(config.aux_layer_ids or contract.default_aux_layer_ids(layers), layers)
    _enable_aux_capture(runner.model, ids)
    lp = getattr(runner.model, "logits_processor", None)
    if lp is None:
        raise CaptureRefused(f"eaglenest capture: {type(runner.model).__name__} has no logits_processor")
    ps = getattr(runner, "ps", None)
    if int(getattr(ps, "attn_tp_rank", 0) or 0) != 0:
        return None  # replicated states: only attention-TP rank 0 writes
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    provenance = _provenance(runner, ids)
    config.capture_dir.mkdir(parents=True, exist_ok=True)
    clean_temporaries(config.capture_dir)
    # the writer runs in a child process (the scheduler thread must not wait for the GIL: sglang_staging)
    in_process = config.writer == "thread" or not shared_memory_available()
    writer_cls = CaptureWriter if in_process else ProcessWriter
    writer = writer_cls(capture_dir=config.capture_dir, receipt_dir=config.receipt_dir, provenance=provenance,
                        threads=config.writer_threads)
    atomic_write_bytes(config.receipt_dir / PROVENANCE_FILE, provenance.to_json().encode())
    runtime = CaptureRuntime(writer=writer, copier=DeviceCopier(config.max_inflight, shared=not in_process),
                             num_aux=len(ids), extend_mode=ForwardMode.EXTEND, runner=runner)
    wrap_logits_processor(lp, runtime)
    log.warning("eaglenest capture on: aux layers %s + final norm -> %s (%s; writer %s)", list(ids),
                config.capture_dir, provenance.attention_backend, "threads" if in_process else "process")
    return runtime


def wrap_logits_processor(lp: Any, runtime: CaptureRuntime) -> None:
    """Capture in THIS logits processor instance only (the target's; never the draft's)."""
    original = lp.forward
    names = ("input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states")

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(names, args, strict=False)) | {k: kwargs[k] for k in names if k in kwargs}
        runtime.on_logits(bound.get("logits_metadata"), bound["hidden_states"], bound.get("aux_hidden_states"))
        return original(*args, **kwargs)

    lp.forward = forward  # instance attribute shadows the class method for nn.Module.__call__


def _after_init_attention_backends(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    global _runtime
    config = CaptureConfig.from_env()
    if config is None or getattr(runner, "is_draft_worker", False) or getattr(runner, "_eaglenest_capture", False):
        return  # draft runners never capture; a re-initialized backend keeps its runtime (no double wrap)
    _runtime = setup_runtime(runner, config)
    runner._eaglenest_capture = True


def _install_verify_kernel(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """The target runner's tree verify through eaglenest's split-KV kernel (before its CUDA graphs are captured)."""
    from eaglenest.engines.sglang_tree_verify import install  # imports triton: only where asked for

    install(runner)


def _start_scheduler_sampler(result: Any, *args: Any, **kwargs: Any) -> None:
    from eaglenest.testing import sglang_profiler

    sglang_profiler.maybe_start("sched")


def _after_init_new(result: Any, *args: Any, **kwargs: Any) -> None:
    rt = _runtime
    if rt is None:
        return
    batch = kwargs.get("batch", args[1] if len(args) > 1 else None)
    runner = kwargs.get("model_runner", args[2] if len(args) > 2 else None)
    try:
        rt.on_init_new(result, batch, runner)
    except Exception as e:
        log.exception("eaglenest capture: could not read the batch")
        for req in getattr(batch, "reqs", []) or []:
            if wants_capture(str(req.rid)):
                rt.writer.fail(str(req.rid), f"capture of {req.rid!r} failed: {e}", status=500, kind="capture_error")


# ---------------------------------------------------------------- HTTP side
def _rids(obj: Any) -> list[str]:
    rid = getattr(obj, "rid", None)
    return [rid] if isinstance(rid, str) else [r for r in (rid or []) if isinstance(r, str)]


def _after_init_req_state(result: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    cfg = _http_config
    if cfg is not None:
        for rid in _rids(obj):
            if wants_capture(rid):
                clear_receipt(cfg.receipt_dir, rid)


def _around_wait_one_response(original: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    gen = original(manager, obj, *args, **kwargs)
    rid, cfg = getattr(obj, "rid", None), _http_config
    if cfg is None or not wants_capture(rid) or not getattr(manager, "is_generation", True):
        return gen
    return _hold_until_durable(gen, cfg, rid)


async def _hold_until_durable(gen: Any, cfg: CaptureConfig, rid: str) -> Any:
    try:
        async for out in gen:
            meta = out.get("meta_info") if isinstance(out, dict) else None
            reason = meta.get("finish_reason") if isinstance(meta, dict) else None
            if reason is not None and not (isinstance(reason, dict) and reason.get("type") == "abort"):
                receipt = await wait_for_receipt(cfg.receipt_dir, rid, timeout_s=cfg.receipt_timeout_s)
                if not receipt.get("ok"):
                    raise CaptureFailed(f"capture failed ({receipt.get('kind')}): {receipt.get('message')}",
                                        int(receipt.get("status", 500)))
                meta["capture"] = {k: v for k, v in receipt.items() if k not in ("ok", "rid")}
            yield out
    finally:
        await gen.aclose()


def capture_block(cfg: CaptureConfig) -> dict[str, Any]:
    """The ``capture`` block of /get_model_info (the same keys as the embedded server's)."""
    block: dict[str, Any] = {"enabled": True, "engine": "sglang", "capture_dir": str(cfg.capture_dir),
                             "aux_layer_ids": list(cfg.aux_layer_ids or [])}
    try:
        prov = json.loads((cfg.receipt_dir / PROVENANCE_FILE).read_text())
        block.update(aux_layer_ids=prov["aux_layer_ids"], hidden_size=prov["hidden_size"],
                     num_layers=prov["num_layers"], provenance=prov)
    except (OSError, ValueError, KeyError):
        block["provenance"] = None  # the writer rank has not started yet
    return block


def _around_model_info(original: Any, *args: Any, **kwargs: Any) -> Any:
    async def run() -> Any:
        result = await original(*args, **kwargs)
        if _http_config is not None and isinstance(result, dict):
            result["capture"] = capture_block(_http_config)
            try:
                from sglang.srt.entrypoints import http_server

                result.setdefault("context_length", http_server._global_state.tokenizer_manager.context_len)
            except Exception:
                pass
        return result

    return run()
