"""The split-KV tree-verify kernel against plain attention, run by Triton's interpreter on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in Triton's CPU interpreter, which tests/conftest.py selects where no CUDA GPU is (on a GPU: "
                "tests/engines/test_tree_verify_device.py)", allow_module_level=True)
pytest.importorskip("triton")
tv = pytest.importorskip("eaglenest.engines.sglang_tree_verify")

from eaglenest.testing.verify_cases import VerifyCase, reference, verify_case  # noqa: E402


def _run(c: VerifyCase, scale: float, *, splits: int, causal: bool = False) -> torch.Tensor:
    o = torch.zeros(c.q.shape, dtype=c.q.dtype)
    assert tv.tree_verify_fwd(*c.args(o, causal=causal), 1.0, 1.0, scale, splits=splits)
    return o


@pytest.mark.parametrize(("prefixes", "n_draft", "splits"), [
    ([70, 5], 12, 3),  # two sequences, one with a prefix shorter than its splits; 12 rows padded to 16
    ([0, 131], 16, 2),  # an empty prefix, and a slice spanning three key blocks
])
def test_tree_verify_matches_masked_attention(prefixes, n_draft, splits):
    c = verify_case(prefixes, n_draft, seed=len(prefixes) + n_draft)
    got, want = _run(c, 0.25, splits=splits).double(), reference(c, 0.25)
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()


def test_tree_verify_takes_cuda_graph_buffers_int64_offsets_and_a_uint8_mask():
    c = verify_case([33, 70], 16, seed=7)  # under CUDA graphs SGLang passes int64 indptrs and a uint8 mask
    c.qo_indptr, c.mask_indptr = c.qo_indptr.long(), c.mask_indptr.long()
    c.custom_mask = c.custom_mask.to(torch.uint8)
    got = _run(c, 0.2, splits=4).double()
    assert torch.allclose(got, reference(c, 0.2), atol=2e-5)


def test_tree_verify_without_a_mask_is_causal_and_the_mask_matters():
    chain = verify_case([40], 16, tree=False, seed=3)
    assert torch.allclose(_run(chain, 0.3, splits=4, causal=True).double(), reference(chain, 0.3), atol=2e-5)
    tree = verify_case([40], 16, seed=3)
    got = _run(tree, 0.3, splits=4).double()
    assert torch.allclose(got, reference(tree, 0.3), atol=2e-5)
    filled = [torch.ones_like(m).tril() for m in tree.masks]  # the tree's holes filled: a chain's mask
    assert not torch.allclose(got, reference(tree, 0.3, filled), atol=1e-3)


def test_tree_verify_declines_what_it_does_not_serve():
    c = verify_case([8], 16, seed=4)
    o = torch.zeros(c.q.shape)
    args = c.args(o)
    assert not tv.tree_verify_fwd(*args, logit_cap=30.0)
    assert not tv.tree_verify_fwd(*args, sliding_window_size=4)
    assert not tv.tree_verify_fwd(*args, k_scale=0.5)
    assert not tv.tree_verify_fwd(*args, sinks=torch.zeros(4))
    assert not tv.tree_verify_fwd(*args, skip_prefix_custom_mask=False)
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
    assert target.attn_backend.use_verify_splitkv
    assert target.attn_backend.verify_splitkv_fwd.__wrapped__ is tv.tree_verify_fwd
    draft = type("Runner", (), {"attn_backend": _Backend(), "is_draft_worker": True})()
    assert not tv.install(draft) and not draft.attn_backend.use_verify_splitkv
    other = type("Runner", (), {"attn_backend": object(), "is_draft_worker": False})()
    with pytest.raises(tv.VerifyKernelError, match="has no split-KV verify hook"):
        tv.install(other)  # e.g. flashinfer: the server must not run (and be measured) with another kernel
