"""The split-KV tree-verify kernel against plain attention, run by Triton's interpreter on the CPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# The interpreter is chosen when triton and the kernels are decorated AND read again at each launch, so it is set
# before triton is imported and left set (nothing else in the suite runs triton; torch's CPU build does not import it)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported before this module could select its interpreter (TRITON_INTERPRET=1)",
                pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
tv = pytest.importorskip("eaglenest.engines.sglang_tree_verify")


def _tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] bool: node i sees node j iff j is i or one of its ancestors (node 0 the root)."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def _case(prefixes: list[int], n_draft: int, *, heads: int = 4, kv_heads: int = 2, d: int = 16, tree: bool = True,
          dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    bs, pool = len(prefixes), sum(prefixes) + 50
    k_buf = torch.randn(pool, kv_heads, d, generator=gen).to(dtype)
    v_buf = torch.randn(pool, kv_heads, d, generator=gen).to(dtype)
    perm = torch.randperm(pool, generator=gen)  # the pool's slots in no particular order
    kv_indptr = torch.tensor([0, *torch.tensor(prefixes).cumsum(0).tolist()], dtype=torch.int32)
    kv_indices = perm[: sum(prefixes)].to(torch.int64)
    qo_indptr = torch.arange(0, (bs + 1) * n_draft, n_draft, dtype=torch.int32)
    q = torch.randn(bs * n_draft, heads, d, generator=gen).to(dtype)
    k_ext = torch.randn(bs * n_draft, kv_heads, d, generator=gen).to(dtype)
    v_ext = torch.randn(bs * n_draft, kv_heads, d, generator=gen).to(dtype)
    masks, blocks = [], []
    for p in prefixes:  # SGLang's layout: per sequence a row-major [n_draft, prefix + n_draft] block
        tm = _tree_mask(n_draft, gen) if tree else torch.ones(n_draft, n_draft, dtype=torch.bool).tril()
        masks.append(tm)
        blocks.append(torch.cat([torch.ones(n_draft, p, dtype=torch.bool), tm], 1).flatten())
    custom = torch.cat(blocks) if tree else None
    mask_indptr = torch.tensor([0, *torch.tensor([b.numel() for b in blocks]).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=q, k_ext=k_ext, v_ext=v_ext, k_buf=k_buf, v_buf=v_buf, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                kv_indices=kv_indices, custom=custom, mask_indptr=mask_indptr, masks=masks, prefixes=prefixes)


def _reference(c: dict, scale: float) -> torch.Tensor:
    heads, kv_heads = c["q"].shape[1], c["k_buf"].shape[1]
    group, n = heads // kv_heads, c["masks"][0].shape[0]
    out = torch.empty(c["q"].shape, dtype=torch.float64)
    for b, p in enumerate(c["prefixes"]):
        idx = c["kv_indices"][int(c["kv_indptr"][b]):int(c["kv_indptr"][b + 1])]
        rows = slice(b * n, (b + 1) * n)
        k = torch.cat([c["k_buf"][idx], c["k_ext"][rows]]).double()
        v = torch.cat([c["v_buf"][idx], c["v_ext"][rows]]).double()
        seen = torch.cat([torch.ones(n, p, dtype=torch.bool), c["masks"][b]], 1)
        for h in range(heads):
            s = c["q"][rows, h].double() @ k[:, h // group].T * scale
            out[rows, h] = torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v[:, h // group]
    return out


def _run(c: dict, scale: float, *, splits: int, causal: bool = False) -> torch.Tensor:
    o = torch.zeros(c["q"].shape, dtype=c["q"].dtype)
    took = tv.tree_verify_fwd(c["q"], c["k_ext"], c["v_ext"], o, c["k_buf"], c["v_buf"], c["qo_indptr"],
                              c["kv_indptr"], c["kv_indices"], c["custom"], causal, c["mask_indptr"],
                              c["masks"][0].shape[0], 1.0, 1.0, scale, splits=splits)
    assert took
    return o


@pytest.mark.parametrize(("prefixes", "n_draft", "splits"), [
    ([70, 5], 12, 3),  # two sequences, one with a prefix shorter than its splits; 12 rows padded to 16
    ([0, 131], 16, 2),  # an empty prefix, and a slice spanning three key blocks
])
def test_tree_verify_matches_masked_attention(prefixes, n_draft, splits):
    c = _case(prefixes, n_draft, seed=len(prefixes) + n_draft)
    got, want = _run(c, 0.25, splits=splits).double(), _reference(c, 0.25)
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()


def test_tree_verify_without_a_mask_is_causal_and_the_mask_matters():
    chain = _case([40], 16, tree=False, seed=3)
    assert torch.allclose(_run(chain, 0.3, splits=4, causal=True).double(), _reference(chain, 0.3), atol=2e-5)
    tree = _case([40], 16, seed=3)
    got = _run(tree, 0.3, splits=4)
    causal = dict(tree, masks=[torch.ones_like(m).tril() for m in tree["masks"]])  # the tree's holes filled
    assert not torch.allclose(got.double(), _reference(causal, 0.3), atol=1e-3)


def test_tree_verify_declines_what_it_does_not_serve():
    c = _case([8], 16, seed=4)
    o = torch.zeros(c["q"].shape)
    args = (c["q"], c["k_ext"], c["v_ext"], o, c["k_buf"], c["v_buf"], c["qo_indptr"], c["kv_indptr"],
            c["kv_indices"], c["custom"], False, c["mask_indptr"], 16)
    assert not tv.tree_verify_fwd(*args, logit_cap=30.0)
    assert not tv.tree_verify_fwd(*args, sliding_window_size=4)
    assert not tv.tree_verify_fwd(*args, k_scale=0.5)
    assert not tv.tree_verify_fwd(*args, sinks=torch.zeros(4))
    assert not torch.any(o)  # nothing written: SGLang's own kernel runs instead


def test_splits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(tv.ENV_SPLITS, "4")
    assert tv._splits() == 4
    monkeypatch.setenv(tv.ENV_SPLITS, "0")
    with pytest.raises(ValueError, match="EAGLENEST_VERIFY_SPLITS=0"):
        tv._splits()


class _Backend:
    def __init__(self):
        self.use_verify_splitkv = False
        self.verify_splitkv_fwd = None


def test_install_takes_the_target_backend_hook_only():
    target = type("Runner", (), {"attn_backend": _Backend(), "is_draft_worker": False})()
    assert tv.install(target)
    assert target.attn_backend.use_verify_splitkv and target.attn_backend.verify_splitkv_fwd is tv.tree_verify_fwd
    draft = type("Runner", (), {"attn_backend": _Backend(), "is_draft_worker": True})()
    assert not tv.install(draft) and not draft.attn_backend.use_verify_splitkv
    other = type("Runner", (), {"attn_backend": object(), "is_draft_worker": False})()
    with pytest.raises(tv.VerifyKernelError, match="has no split-KV verify hook"):
        tv.install(other)  # e.g. flashinfer: the server must not run (and be measured) with another kernel
