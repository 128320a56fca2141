"""Tree-verify attention cases in SGLang's layout, and plain masked attention as their reference.

Used by the CPU tests of :mod:`eaglenest.engines.sglang_tree_verify` (Triton's interpreter) and by
scripts/gpu_verify_kernel.py (the kernel against SGLang's own on a GPU, correctness and time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] bool for a random tree: node i sees node j iff j is i or one of its ancestors (node 0 the root)."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


@dataclass
class VerifyCase:
    """One target-verify forward: ``len(prefixes)`` sequences of ``n_draft`` draft tokens each."""

    prefixes: list[int]
    masks: list[torch.Tensor]  # per sequence [n_draft, n_draft]: the draft tokens among themselves
    q: torch.Tensor  # [bs * n_draft, heads, d]
    k_ext: torch.Tensor  # [bs * n_draft, kv_heads, d]
    v_ext: torch.Tensor
    k_buf: torch.Tensor  # [pool, kv_heads, d]: the KV pool, prefixes at kv_indices
    v_buf: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: torch.Tensor | None  # SGLang's: per sequence a row-major [n_draft, prefix + n_draft] block
    mask_indptr: torch.Tensor

    @property
    def n_draft(self) -> int:
        return self.masks[0].shape[0]

    def args(self, o: torch.Tensor, *, causal: bool = False) -> tuple:
        """``extend_attention_fwd``'s positional arguments up to ``max_len_extend``."""
        return (self.q, self.k_ext, self.v_ext, o, self.k_buf, self.v_buf, self.qo_indptr, self.kv_indptr,
                self.kv_indices, self.custom_mask, causal, self.mask_indptr, self.n_draft)


def verify_case(prefixes: list[int], n_draft: int, *, heads: int = 4, kv_heads: int = 2, d: int = 16,
                tree: bool = True, dtype: torch.dtype = torch.float32, device: str = "cpu",
                seed: int = 0) -> VerifyCase:
    """Random queries, keys and values; the prefixes scattered over a shuffled pool; a random tree per sequence
    (``tree=False``: a chain, causal, and no custom mask)."""
    gen = torch.Generator().manual_seed(seed)
    bs, pool = len(prefixes), sum(prefixes) + 50

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    k_buf, v_buf = rand(pool, kv_heads, d), rand(pool, kv_heads, d)
    kv_indices = torch.randperm(pool, generator=gen)[: sum(prefixes)].to(device=device, dtype=torch.int64)
    kv_indptr = torch.tensor([0, *torch.tensor(prefixes).cumsum(0).tolist()], dtype=torch.int32, device=device)
    qo_indptr = torch.arange(0, (bs + 1) * n_draft, n_draft, dtype=torch.int32, device=device)
    q, k_ext, v_ext = rand(bs * n_draft, heads, d), rand(bs * n_draft, kv_heads, d), rand(bs * n_draft, kv_heads, d)
    masks = [tree_mask(n_draft, gen) if tree else torch.ones(n_draft, n_draft, dtype=torch.bool).tril()
             for _ in prefixes]
    blocks = [torch.cat([torch.ones(n_draft, p, dtype=torch.bool), m], 1).flatten() for p, m in zip(prefixes, masks,
                                                                                                     strict=True)]
    mask_indptr = torch.tensor([0, *torch.tensor([b.numel() for b in blocks]).cumsum(0).tolist()], dtype=torch.int32,
                               device=device)
    return VerifyCase(prefixes=list(prefixes), masks=masks, q=q, k_ext=k_ext, v_ext=v_ext, k_buf=k_buf, v_buf=v_buf,
                      qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                      custom_mask=torch.cat(blocks).to(device) if tree else None, mask_indptr=mask_indptr)


def reference(case: VerifyCase, scale: float, masks: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Plain softmax attention in float64: every draft token sees its whole prefix and the draft tokens ``masks``
    (default the case's) lets it see."""
    masks = case.masks if masks is None else masks
    heads, kv_heads, n = case.q.shape[1], case.k_buf.shape[1], case.n_draft
    group = heads // kv_heads
    out = torch.empty(case.q.shape, dtype=torch.float64)
    indptr = case.kv_indptr.tolist()
    for b, p in enumerate(case.prefixes):
        idx = case.kv_indices[indptr[b]:indptr[b + 1]]
        rows = slice(b * n, (b + 1) * n)
        k = torch.cat([case.k_buf[idx], case.k_ext[rows]]).double().cpu()
        v = torch.cat([case.v_buf[idx], case.v_ext[rows]]).double().cpu()
        seen = torch.cat([torch.ones(n, p, dtype=torch.bool), masks[b]], 1)
        q = case.q[rows].double().cpu()
        for h in range(heads):
            s = q[:, h] @ k[:, h // group].T * scale
            out[rows, h] = torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v[:, h // group]
    return out
