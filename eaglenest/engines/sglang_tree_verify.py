"""Split-KV attention for SGLang's EAGLE target-verify forward of a draft TREE (triton attention backend).

Why: a 7x8x48 tree's verify is ~1.6 ms of a ~3.7-ms cycle on an H100 with SmolLM2-135M, and its attention
alone 0.66 ms against a decode step's 0.17 ms (results/2026-12-06g-h100's profile). SGLang verifies through
its prefill kernel, which walks the whole prefix serially in one program per (sequence, head): 9 programs
for this target on a 132-SM GPU. SGLang 0.5.17 has a split-KV verify path, but only for chains (topk 1) and
only on AMD gfx95; trees fall back to the prefill kernel.

What: the same answer computed flash-decode style. Stage 1 runs (sequence, query head, split) programs:
splits ``0..N-1`` each take a slice of the prefix (every draft token sees the whole prefix), split ``N``
takes the draft tokens themselves under the tree's mask (SGLang's ``custom_mask``: per sequence a row-major
``[n_draft, prefix + n_draft]`` block at ``mask_indptr[b]``; without one, causal). Each writes its rows'
partial output and log-sum-exp; stage 2 merges the ``N + 1`` partials per row. The result equals the prefill
kernel's up to the summation order (greedy outputs can differ only where two logits nearly tie, as between
any two attention kernels).

:func:`tree_verify_fwd` takes ``extend_attention_fwd``'s arguments, as SGLang's ``verify_splitkv_fwd``
hook does, and returns False (doing nothing) for what it does not serve: logit caps, sinks, sliding
windows, fp8 scales, xai temperature, paged or MLA pools, heads over 256, a masked prefix. The plugin
installs it on the target's backend (:func:`install`), opt-in with ``EAGLENEST_VERIFY_KERNEL=splitkv``. It
allocates nothing per call beyond two scratch tensors from torch's allocator (CUDA-graph safe: captured once,
replayed with fixed addresses).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import triton
import triton.language as tl

from eaglenest.engines import VERIFY_KERNEL_CALLED

log = logging.getLogger("eaglenest.sglang")

ENV_SPLITS = "EAGLENEST_VERIFY_SPLITS"
DEFAULT_SPLITS = 8  # prefix slices per (sequence, head); fixed because CUDA graphs cannot read lengths
BLOCK_N = 64  # keys per inner step
_logged = False


@triton.jit
def _online_softmax_step(q, k, v, seen, m_i, l_i, acc, sm_scale):
    """One block of keys ``k`` ([d, keys]) and values ``v`` ([keys, dv]) folded into the running max ``m_i``, sum
    ``l_i`` and output ``acc`` of the rows, where ``seen`` ([rows, keys]) lets a row see a key."""
    qk = tl.where(seen, tl.dot(q, k.to(q.dtype)) * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty
    p = tl.exp(qk - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _tree_verify_partials(
    Q, K_Buf, V_Buf, K_Ext, V_Ext, Mask,
    qo_indptr, kv_indptr, kv_indices, mask_indptr,
    Part_O, Part_L, sm_scale,
    s_qt, s_qh, s_kbt, s_kbh, s_vbt, s_vbh, s_ket, s_keh, s_vet, s_veh,
    s_ob, s_oh, s_os, s_ol, s_lb, s_lh, s_ls,
    GROUP: tl.constexpr, N_SPLITS: tl.constexpr, L_PAD: tl.constexpr, BLOCK: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_MASK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(qo_indptr + b)
    n_q = tl.load(qo_indptr + b + 1) - q_start
    kv_start = tl.load(kv_indptr + b)
    n_prefix = tl.load(kv_indptr + b + 1) - kv_start

    rows = tl.arange(0, L_PAD)
    cols = tl.arange(0, BLOCK)
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < n_q
    q = tl.load(Q + (q_start + rows)[:, None] * s_qt + h * s_qh + dq[None, :],
                mask=row_ok[:, None] & (dq[None, :] < D), other=0.0)

    m_i = tl.full([L_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([L_PAD], tl.float32)
    acc = tl.zeros([L_PAD, BLOCK_DV], tl.float32)

    # splits 0..N-1: a slice of the prefix, seen by every draft token (an empty range for split N)
    per = tl.cdiv(n_prefix, N_SPLITS)
    lo = tl.minimum(s * per, n_prefix)
    hi = tl.minimum(lo + per, n_prefix)
    for start in range(lo, hi, BLOCK):
        key = start + cols
        key_ok = key < hi
        loc = tl.load(kv_indices + kv_start + key, mask=key_ok, other=0)
        k = tl.load(K_Buf + loc[None, :] * s_kbt + kvh * s_kbh + dq[:, None],
                    mask=key_ok[None, :] & (dq[:, None] < D), other=0.0)
        v = tl.load(V_Buf + loc[:, None] * s_vbt + kvh * s_vbh + dv[None, :],
                    mask=key_ok[:, None] & (dv[None, :] < DV), other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, row_ok[:, None] & key_ok[None, :], m_i, l_i, acc, sm_scale)

    # split N: the draft tokens among themselves, under the tree's mask (an empty range for the other splits)
    n_ext = tl.where(s == N_SPLITS, n_q, 0)
    mask_start = tl.load(mask_indptr + b)
    for start in range(0, n_ext, BLOCK):
        key = start + cols
        key_ok = key < n_ext
        k = tl.load(K_Ext + (q_start + key)[None, :] * s_ket + kvh * s_keh + dq[:, None],
                    mask=key_ok[None, :] & (dq[:, None] < D), other=0.0)
        v = tl.load(V_Ext + (q_start + key)[:, None] * s_vet + kvh * s_veh + dv[None, :],
                    mask=key_ok[:, None] & (dv[None, :] < DV), other=0.0)
        seen = row_ok[:, None] & key_ok[None, :]
        if USE_MASK:
            bits = tl.load(Mask + mask_start + rows[:, None] * (n_prefix + n_q) + n_prefix + key[None, :],
                           mask=seen, other=0)
            seen = seen & (bits != 0)
        else:
            seen = seen & (key[None, :] <= rows[:, None])
        m_i, l_i, acc = _online_softmax_step(q, k, v, seen, m_i, l_i, acc, sm_scale)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(Part_O + b * s_ob + h * s_oh + s * s_os + rows[:, None] * s_ol + dv[None, :], out,
             mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(Part_L + b * s_lb + h * s_lh + s * s_ls + rows, lse, mask=row_ok)


@triton.jit
def _tree_verify_merge(
    Part_O, Part_L, Out, qo_indptr,
    s_ob, s_oh, s_os, s_ol, s_lb, s_lh, s_ls, s_ot, s_oh2,
    N_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, L_PAD: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(qo_indptr + b)
    n_q = tl.load(qo_indptr + b + 1) - q_start
    parts = tl.arange(0, PARTS_PAD)
    rows = tl.arange(0, L_PAD)
    dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < n_q
    ok = (parts[:, None] < N_PARTS) & row_ok[None, :]
    lse = tl.load(Part_L + b * s_lb + h * s_lh + parts[:, None] * s_ls + rows[None, :], mask=ok,
                  other=float("-inf"))  # [parts, rows]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - m[None, :]), 0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.zeros([L_PAD, BLOCK_DV], tl.float32)
    for i in range(N_PARTS):  # one [rows, dv] partial at a time (all at once would not fit in registers)
        lse_i = tl.load(Part_L + b * s_lb + h * s_lh + i * s_ls + rows, mask=row_ok, other=float("-inf"))
        part = tl.load(Part_O + b * s_ob + h * s_oh + i * s_os + rows[:, None] * s_ol + dv[None, :],
                       mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
        out += part * (tl.exp(lse_i - m) / total)[:, None]
    tl.store(Out + (q_start + rows)[:, None] * s_ot + h * s_oh2 + dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))


def _splits() -> int:
    raw = os.environ.get(ENV_SPLITS, "")
    try:
        n = int(raw) if raw else DEFAULT_SPLITS
    except ValueError:
        raise ValueError(f"{ENV_SPLITS}={raw!r}: expected a whole number of prefix splits, 1-64") from None
    if not 1 <= n <= 64:
        raise ValueError(f"{ENV_SPLITS}={n}: expected 1-64 prefix splits")
    return n


def tree_verify_fwd(
    q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor, o: torch.Tensor,
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor, custom_mask: torch.Tensor | None, causal: bool, mask_indptr: torch.Tensor,
    max_len_extend: int, k_scale: float = 1.0, v_scale: float = 1.0, sm_scale: float | None = None,
    logit_cap: float = 0.0, sliding_window_size: int = -1, sinks: Any = None, window_kv_offsets: Any = None,
    xai_temperature_len: int = -1, skip_prefix_custom_mask: bool = True, splits: int | None = None, **_: Any,
) -> bool:
    """Write ``o`` ([tokens, q heads, v dim]) for a target-verify forward and return True, or return False for a
    case it does not serve (the caller then runs SGLang's prefill kernel). Arguments as ``extend_attention_fwd``:
    ``q``/``k_extend``/``v_extend`` the draft tokens' rows, ``k_buffer``/``v_buffer`` the KV pool indexed by
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` (the prefix), ``custom_mask`` the tree's (None: causal)."""
    if (logit_cap and logit_cap > 0) or sinks is not None or (sliding_window_size or -1) > 0 \
            or (xai_temperature_len or -1) > 0 or k_scale != 1.0 or v_scale != 1.0:
        return False
    if (custom_mask is None and not causal) or not skip_prefix_custom_mask:  # (a masked prefix: SGLang's kernel)
        return False
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3:  # e.g. paged or MLA pools
        return False
    _, heads, d = q.shape
    kv_heads, dv = k_buffer.shape[1], v_buffer.shape[-1]
    if heads % kv_heads or k_extend.shape[1] != kv_heads or o.shape[-1] != dv or max(d, dv) > 256:
        return False
    bs = qo_indptr.shape[0] - 1
    n_split = splits or _splits()
    global _logged
    if not _logged:
        _logged = True
        log.info("%s (batch %d, %d draft tokens, %d/%d heads, %d prefix splits, %s mask)", VERIFY_KERNEL_CALLED, bs,
                 max_len_extend, heads, kv_heads, n_split, "tree" if custom_mask is not None else "causal")
    l_pad = max(16, triton.next_power_of_2(int(max_len_extend)))
    parts = torch.empty((bs, heads, n_split + 1, l_pad, dv), dtype=torch.float32, device=q.device)
    lse = torch.empty((bs, heads, n_split + 1, l_pad), dtype=torch.float32, device=q.device)
    scale = sm_scale if sm_scale is not None else d ** -0.5
    mask = custom_mask if custom_mask is not None else kv_indptr  # a placeholder pointer when causal
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    _tree_verify_partials[(bs, heads, n_split + 1)](
        q, k_buffer, v_buffer, k_extend, v_extend, mask, qo_indptr, kv_indptr, kv_indices, mask_indptr,
        parts, lse, scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k_extend.stride(0), k_extend.stride(1), v_extend.stride(0), v_extend.stride(1),
        parts.stride(0), parts.stride(1), parts.stride(2), parts.stride(3), lse.stride(0), lse.stride(1),
        lse.stride(2),
        GROUP=heads // kv_heads, N_SPLITS=n_split, L_PAD=l_pad, BLOCK=BLOCK_N, D=d, DV=dv, BLOCK_D=block_d,
        BLOCK_DV=block_dv, USE_MASK=custom_mask is not None,
    )
    _tree_verify_merge[(bs, heads)](
        parts, lse, o, qo_indptr,
        parts.stride(0), parts.stride(1), parts.stride(2), parts.stride(3), lse.stride(0), lse.stride(1),
        lse.stride(2), o.stride(0), o.stride(1),
        N_PARTS=n_split + 1, PARTS_PAD=triton.next_power_of_2(n_split + 1), L_PAD=l_pad, DV=dv, BLOCK_DV=block_dv,
    )
    return True


class VerifyKernelError(RuntimeError):
    """The server was asked for eaglenest's verify kernel and cannot run it."""


def install(runner: Any) -> bool:
    """Route a target runner's tree verify through :func:`tree_verify_fwd` (SGLang's triton backend only).

    Called after ``ModelRunner.init_attention_backends``, before CUDA-graph capture. Returns False for a draft
    runner (it never verifies); raises :class:`VerifyKernelError` for a target whose backend has no split-KV verify
    hook, so that a server asked for this kernel never runs (and gets measured) with SGLang's instead."""
    if getattr(runner, "is_draft_worker", False):
        return False
    backend = getattr(runner, "attn_backend", None)
    if not hasattr(backend, "use_verify_splitkv") or not hasattr(backend, "verify_splitkv_fwd"):
        raise VerifyKernelError(f"eaglenest verify kernel: the target's attention backend {type(backend).__name__} "
                                "has no split-KV verify hook (SGLang's triton backend has one: --attention-backend "
                                "triton)")
    backend.verify_splitkv_fwd = torch.compiler.disable(tree_verify_fwd)  # (as SGLang wraps its own)
    backend.use_verify_splitkv = True
    log.info("eaglenest verify kernel: split-KV tree verify on %s (%d prefix splits)", type(backend).__name__,
             _splits())
    return True
