"""SGLang launch flags: the backends verified on the GPU kit, the decode-batch flags for a given load, the
tensor-parallel size a command asks for, the host's GPUs, and where each server of a pool runs (its GPU, its
memory fraction when it shares one, its launch group). The one home of these rules; :mod:`eaglenest.engines.pool`
starts the processes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from eaglenest.engines.pool import LaunchError
from eaglenest.engines.sglang_guards import flag_value, split_flags


def sglang_flags(
    *, attention_backend: str | None = "triton", sampling_backend: str | None = "pytorch",
    mem_fraction_static: float | None = None, cuda_graph: bool = True, chunked_prefill_size: int | None = None,
    log_level: str | None = None,
) -> list[str]:
    """``sglang.launch_server`` flags: triton attention and pytorch sampling, the backends verified on the GPU
    kit. Callers set ``mem_fraction_static`` lower when something else shares the GPU (a second server, a
    reference forward) and turn CUDA graphs off where start-up time matters more than decode speed."""
    flags: list[str] = []
    if attention_backend:
        flags += ["--attention-backend", attention_backend]
    if sampling_backend:
        flags += ["--sampling-backend", sampling_backend]
    if mem_fraction_static is not None:
        flags += ["--mem-fraction-static", str(mem_fraction_static)]
    if chunked_prefill_size is not None:
        flags += ["--chunked-prefill-size", str(chunked_prefill_size)]
    if not cuda_graph:
        flags.append("--disable-cuda-graph")
    if log_level:
        flags += ["--log-level", log_level]
    return flags


def sglang_decode_batch_flags(args: Sequence[str], *, concurrency: int, admit: int = 0) -> list[str]:
    """``args`` plus what lets one server decode ``concurrency`` requests as ONE batch, for each flag the user
    did not set: ``--max-running-requests`` (admit them all, plus ``admit`` more: the captures of their own
    lane, which must not wait for a decode slot) and ``--cuda-graph-max-bs`` (SGLang replays a CUDA graph only
    for batches up to that size and decodes larger ones eagerly, several times slower for a small target; its
    default is below the 512-1024 requests regeneration keeps in flight)."""
    given = {flag for flag, _ in split_flags(args)}
    out = list(args)
    if "--max-running-requests" not in given:
        out += ["--max-running-requests", str(concurrency + admit)]
    if "--cuda-graph-max-bs" not in given and "--disable-cuda-graph" not in given:
        out += ["--cuda-graph-max-bs", str(min(concurrency, 1024))]
    return out


def sglang_tp_size(args: Sequence[str]) -> int:
    """The tensor-parallel size ``args`` ask for (1 when they do not say)."""
    sizes = [v for f, v in split_flags(args) if f in ("--tp-size", "--tensor-parallel-size", "--tp")]
    return int(sizes[0]) if sizes and sizes[0] and sizes[0].isdigit() else 1


def visible_gpus() -> int:
    """GPUs a launched server may use: CUDA_VISIBLE_DEVICES when set, else what torch sees (0 without CUDA)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([x for x in env.split(",") if x.strip() and x.strip() != "-1"])
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


DEFAULT_SHARED_MEM_FRACTION = 0.8
"""``--mem-fraction-static`` that the servers sharing one GPU hold together when the user gives none."""


@dataclass(frozen=True, slots=True)
class SglangPlacement:
    """Where one SGLang server of a pool runs: its first GPU, its memory fraction when it shares that GPU, and
    its launch group (the servers of one GPU start one after another). None: the user's flags stay."""

    base_gpu_id: int | None = None
    mem_fraction_static: float | None = None
    launch_group: str | None = None

    def flags(self, args: Sequence[str]) -> list[str]:
        """``args`` with this placement's ``--base-gpu-id`` / ``--mem-fraction-static`` in place of the user's."""
        ours = {flag: value for flag, value in (("--base-gpu-id", self.base_gpu_id),
                                                ("--mem-fraction-static", self.mem_fraction_static))
                if value is not None}
        pairs = split_flags(args)
        kept = list(args)
        if ours.keys() & {flag for flag, _ in pairs}:
            kept = [tok for flag, value in pairs if flag not in ours
                    for tok in (flag, *(() if value is None else (value,)))]
        return kept + [tok for flag, value in ours.items() for tok in (flag, f"{value:g}")]


def _shared_total(args: Sequence[str]) -> float:
    given = flag_value(args, "--mem-fraction-static")
    try:
        total = DEFAULT_SHARED_MEM_FRACTION if given is None else float(given)
    except ValueError:
        total = math.nan
    if not 0 < total < 1:
        raise LaunchError(f"--mem-fraction-static {given}: servers sharing a GPU need a fraction between 0 and 1 "
                          "(the total they hold together)")
    return total


def sglang_placements(args: Sequence[str], *, num_servers: int, gpus: int) -> list[SglangPlacement]:
    """Where each of ``num_servers`` SGLang servers launched on one host runs: the one home of their GPUs and
    memory fractions.

    Servers go round-robin over the host's GPU groups of ``tp`` GPUs (``--base-gpu-id`` 0, tp, 2 tp, ...); a
    user-given ``--base-gpu-id`` puts them all on that GPU; ``gpus`` 0 (not known here) gives each server its
    own group. A server alone on its GPU keeps the user's ``--mem-fraction-static`` (or SGLang's default).

    The k servers sharing a GPU hold ``total`` of it together (the user's ``--mem-fraction-static``, else
    DEFAULT_SHARED_MEM_FRACTION), ``share = total / k`` each. SGLang 0.5.17 sizes its static memory (weights and
    KV cache) as ``f`` times the GPU memory free when IT starts, not of the whole GPU: its KV cache gets
    ``free_after_loading_weights - pre_model_load_memory * (1 - f)``, both measured by ``mem_get_info``
    (``KVCacheConfigurator._profile_available_bytes``). Servers that start together all see an idle GPU, and
    all but the first to allocate find no room for a KV cache (seen on the H200: two at 0.42 each). So
    they start one after another (one launch group per GPU), and the j-th (0-based) asks for
    ``share / (1 - j * share)`` of what the j before it left free: each holds ``share`` of the GPU, and
    ``1 - total`` of it stays free for their activations and CUDA graphs. Fractions are rounded down.

    Refused (LaunchError) before anything starts: servers sharing GPUs at tensor parallel > 1 (untested),
    tensor parallel larger than the host, a ``--mem-fraction-static`` outside (0, 1) for shared GPUs.
    """
    if num_servers <= 1:
        return [SglangPlacement()]
    tp = sglang_tp_size(args)
    user_base = flag_value(args, "--base-gpu-id")
    if user_base is not None:
        bases = [int(user_base)] if user_base.isdigit() else []
        if not bases:
            raise LaunchError(f"--base-gpu-id {user_base}: not a GPU index")
    elif gpus:
        bases = [g * tp for g in range(gpus // tp)]
        if not bases:
            raise LaunchError(f"tensor parallel {tp} needs {tp} GPUs; this host shows {gpus} "
                              "(CUDA_VISIBLE_DEVICES / torch)")
    else:
        bases = [i * tp for i in range(num_servers)]
    per_gpu = [len(range(g, num_servers, len(bases))) for g in range(len(bases))]
    if tp > 1 and max(per_gpu) > 1:
        raise LaunchError(f"{num_servers} SGLang servers x tensor parallel {tp} would share GPUs (this host shows "
                          f"{gpus}, CUDA_VISIBLE_DEVICES / torch); servers share GPUs only at tensor parallel 1: "
                          f"launch at most {len(bases)} servers, or use --tp-size 1")
    total = _shared_total(args) if max(per_gpu) > 1 else 0.0
    out = []
    for i in range(num_servers):
        gpu, slot = i % len(bases), i // len(bases)
        k = per_gpu[gpu]
        if k == 1:
            out.append(SglangPlacement(base_gpu_id=bases[gpu]))
            continue
        share = total / k
        fraction = math.floor(share / (1 - slot * share) * 1000 + 1e-6) / 1000
        out.append(SglangPlacement(base_gpu_id=bases[gpu], mem_fraction_static=fraction,
                                   launch_group=f"gpu-{bases[gpu]}"))
    return out
