"""The bf16 decode kernels of ``skinny.cpp``, built once per machine by torch's C++ extension loader.

Owns whether the kernels can run here and their calls: :func:`skinny_linear` (a few rows times a
weight, streaming it like a GEMV) and :func:`decode_attention` (grouped-query attention of a few
rows over a preallocated cache) are None where they cannot (no AVX512-BF16, no compiler, a failed
build, or ``EAGLENEST_SKINNY=0``); callers fall back to oneDNN and SDPA. Both compute each row
exactly as they would alone (fixed summation orders, masked keys skipped), so in bf16 a verify
forward reproduces the 1-row decode steps bit for bit. :func:`skinny_linear_i8` is the linear kernel
over int8 weights with a scale per weight row: half the bytes to stream from memory, slower than bf16
on weights already in cache (it converts each value); :func:`skinny_linear_q4` over int4 weights with a
scale per group of values (:mod:`~eaglenest.speculative.quant` packs them): a quarter. On a CPU with AMX-BF16
(Intel Sapphire Rapids and later), inside :func:`amx`, :func:`skinny_linear` runs bf16 weights of a multiple of 64
rows and 32 input features on the tile unit, each row still computed alone: SmolLM2's linears for 4 rows then cost
what they cost for 1 (1.26x on AVX512), while a 1-row pass is 3-8% slower than on AVX512; so the speculative
decoder's forwards run there and plain decoding stays on AVX512 (``EAGLENEST_AMX=0``: never AMX). The first use on a
machine compiles them (~40 s on 2 cores) into a folder of their own per source (:func:`build_dir`), kept for later
processes. A build killed midway (Ctrl-C during a first benchmark) leaves torch's ``lock`` file behind, on which
every later build would wait forever; builds here take an OS lock first, which dies with its process, so a ``lock``
found while holding it is such a leftover and is removed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("skinny.cpp")
MAX_ROWS = 16
"""Rows up to which the linear kernel runs. oneDNN's prepacked GEMM costs about the same for any few rows; the
kernel streaming SmolLM2's weights costs ~1.0x its 1-row time for 2 rows, ~1.07x for 4 and ~1.5x for 8
(compute; ``scripts/bench_kernels_cpu.py``), and up to here it keeps rows exact."""
Q4_BLOCK = 64
"""Packed int4 values per 32 bytes (one low and one high nibble each): the q4 kernel takes input features in
whole blocks."""
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
         "-fopenmp"]


def _cpu_has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512bw", "avx512vl"} <= cpu_flags()


def build_dir() -> Path:
    """Where the kernels are built: under torch's extensions folder (``TORCH_EXTENSIONS_DIR``), one folder per source
    and flags, so checkouts of one source share a build and a changed source gets a new one."""
    import hashlib

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode()).hexdigest()
    return root / f"eaglenest_skinny-{key[:12]}"


def _build():
    import fcntl

    from torch.utils.cpp_extension import load

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "eaglenest-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # every build here holds it; released when its process ends, however
        stale = where / "lock"
        if stale.exists():  # torch's own lock, with no build of ours running: left by a killed one
            log.warning("removing %s, left by a build that was killed; building the kernels again", stale)
            stale.unlink()
        return load(name="eaglenest_skinny", sources=[str(SOURCE)], extra_cflags=FLAGS, build_directory=str(where),
                    verbose=False)


@functools.cache
def _module():
    """The built extension, or None where it cannot run (logged once)."""
    if os.environ.get("EAGLENEST_SKINNY", "1") == "0" or not _cpu_has_avx512_bf16():
        return None
    try:
        return _build()
    except Exception as e:  # no compiler, no ninja, a failed build: decode on oneDNN and SDPA instead
        log.warning("skinny bf16 kernels unavailable (%s: %s); decode forwards use oneDNN and SDPA",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def skinny_linear() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``f(x [M, K] bf16, w [N, K] bf16) -> x @ w.T [M, N] bf16`` (M <= :data:`MAX_ROWS`, N % 4 == 0), or None."""
    mod = _module()
    return None if mod is None else mod.skinny_linear


@functools.cache
def _cpuinfo(path: Path) -> str:
    """``/proc/cpuinfo`` (or ``path``), read once per process ("" where it cannot be read): the default shape is
    looked up whenever a bench config resolves its shape."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _cpuinfo_field(name: str, path: Path) -> str:
    return next((ln.partition(":")[2].strip() for ln in _cpuinfo(path).splitlines() if ln.startswith(name)), "")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as the kernel lists them (empty where ``cpuinfo`` cannot be read)."""
    return frozenset(_cpuinfo_field("flags", cpuinfo).split())


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as the kernel gives it ("" where ``cpuinfo`` cannot be read)."""
    return _cpuinfo_field("model name", cpuinfo)


def cpu_class(flags: frozenset[str] | None = None) -> str:
    """Which kind of CPU a measured default belongs to: ``amx`` where speculation's forwards run on the tile unit
    (AMX-BF16, unless ``EAGLENEST_AMX=0``), else ``no-amx``. The two rank speculation shapes differently (a tree's
    wider verify is nearly free on AMX, not on AVX512), so each keeps its own. Read from the flags alone: no build."""
    flags = cpu_flags() if flags is None else flags
    on = {"amx_bf16", "amx_tile"} <= flags and os.environ.get("EAGLENEST_AMX", "1") != "0"
    return "amx" if on else "no-amx"


def amx_available() -> bool:
    """Whether :func:`skinny_linear` can run bf16 weights on AMX here (inside :func:`amx`)."""
    mod = _module()
    return mod is not None and mod.amx_available()


@contextlib.contextmanager
def amx():
    """:func:`skinny_linear` on AMX for this block where the CPU has it (process-wide; else a no-op). The two paths
    round sums in other orders, so a decoder runs its 1-row steps and its verifies on the same one."""
    mod = _module()
    before = mod.set_amx(True) if mod is not None else None
    try:
        yield
    finally:
        if mod is not None:
            mod.set_amx(before)


def skinny_linear_i8() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``f(x [M, K] bf16, w [N, K] int8, scale [N] fp32) -> (x @ w.T) * scale [M, N] bf16`` (M <= :data:`MAX_ROWS`,
    N % 4 == 0), or None."""
    mod = _module()
    return None if mod is None else mod.skinny_linear_i8


def skinny_linear_q4() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``f(x [M, K] bf16, w [N, K / 2] uint8, scale [N, K / G] bf16) -> x @ dequantized(w).T [M, N] bf16``: two int4
    per byte as :func:`eaglenest.speculative.quant.quantize_q4` packs them, G in (32, 64, 128), K % 64 == 0,
    M <= :data:`MAX_ROWS`, N % 4 == 0; or None."""
    mod = _module()
    return None if mod is None else mod.skinny_linear_q4


def decode_attention() -> Callable[..., torch.Tensor] | None:
    """``f(q [S, H, hd], k [Hkv, capacity, hd], v, T, mask [S, T] bool | None) -> [S, H*hd]`` (bf16,
    softmax scale 1/sqrt(hd); without a mask row s sees keys ``0 .. T - S + s``), or None."""
    mod = _module()
    return None if mod is None else mod.decode_attention


def rms_norm_out() -> Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor, bool], None] | None:
    """``f(x [S, N] bf16, w [N] fp32, eps, out [S, N] bf16, round_twice)``: ``out = x / rms(x) * w`` row by row in
    fp32, rounded once (the drafter's norm) or, ``round_twice``, also before the product with ``w`` (transformers'
    Llama RMSNorm in bf16); ``out`` may be a column block of a wider tensor; N % 16 == 0. None where unavailable."""
    mod = _module()
    return None if mod is None else mod.rms_norm_out


def rope_() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None] | None:
    """``f(x [S, heads, hd] bf16, cos [S, hd] fp32, sin [S, hd] fp32, bf16_ops)``: neox RoPE in place (any row and
    head strides; hd % 32 == 0) in fp32 rounded once (the drafter's) or, ``bf16_ops``, rounding each product and
    the sum to bf16 as torch's ops on bf16 tensors and tables do (the target's); None where unavailable."""
    mod = _module()
    return None if mod is None else mod.rope_


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, ``x`` [S, V] -> [S] int64 (the first of equal ones): one pass of
    the kernel over bf16 rows on the CPU (torch's argmax took ~0.2 ms for SmolLM2's 49K logits), else
    ``torch.argmax``. Only NaN rows differ: the kernel never picks NaN."""
    mod = _module()
    if mod is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1:
        return mod.argmax_rows(x)
    return x.argmax(dim=-1)


def skinny_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` runs on a skinny kernel here: bf16 rows, a bf16 weight (:func:`skinny_linear`), an
    int8 one (:func:`skinny_linear_i8`) or packed int4 (uint8, :func:`skinny_linear_q4`: input features a multiple
    of :data:`Q4_BLOCK`), CPU, at most :data:`MAX_ROWS` rows, contiguous, output features a multiple of 4."""
    packed = weight.dtype == torch.uint8
    return (x.dtype == torch.bfloat16 and (weight.dtype in (torch.bfloat16, torch.int8) or packed)
            and x.device.type == "cpu" and x.numel() <= MAX_ROWS * x.shape[-1] and weight.shape[0] % 4 == 0
            and (not packed or x.shape[-1] % Q4_BLOCK == 0) and x.is_contiguous() and weight.is_contiguous()
            and skinny_linear() is not None)
