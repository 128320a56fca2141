"""The target's decode fast path (fused projections, grouped-query attention without K/V copies)
computes what the unprepared model computes: bit for bit outside a phase, to fp32 rounding inside."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from spec_support import one_thread, random_prompts

from eaglenest.engines.runtime import TargetRunner
from eaglenest.speculative import fastpath
from eaglenest.speculative.onednn import phase


@pytest.fixture
def runners(tiny_model_dir):
    """(reference runner, runner with a prepared target), fp32, one thread."""
    with one_thread():
        ref, fast = TargetRunner(tiny_model_dir, dtype="float32"), TargetRunner(tiny_model_dir, dtype="float32")
        fastpath.prepare_target(fast.model)
        fastpath.prepare_target(fast.model)  # idempotent
        yield ref, fast


def test_prepare_fuses_the_projections_and_sets_the_attention(runners):
    _, fast = runners
    layer = fast.model.model.layers[0]
    assert fast.model.config._attn_implementation == fastpath.ATTENTION
    parts = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
             layer.mlp.up_proj]
    assert all(isinstance(p, fastpath.FusedPart) for p in parts)
    assert not isinstance(layer.mlp.down_proj, fastpath.FusedPart)


def test_outside_a_phase_nothing_changes(runners):
    ref, fast = runners
    seqs = random_prompts(3, seed=5)
    for a, b in zip(ref.capture(seqs), fast.capture(seqs), strict=True):  # padded batch: a 2-D mask
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden)
    assert ref.generate(seqs[0], max_new_tokens=8).output_ids == fast.generate(seqs[0], max_new_tokens=8).output_ids


def _logits(runner, ids: list[int], steps: list[list[int]], extra: list[dict] | None = None, *,
            onednn: bool | None) -> list[torch.Tensor]:
    """Logits of each forward over ``steps`` rows after a prefill of ``ids`` (one growing KV cache),
    inside a phase with ``onednn`` (None: outside any phase); ``extra``: more arguments per step."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.inference_mode(), contextlib.nullcontext() if onednn is None else phase(onednn):
        runner.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        for i, rows in enumerate(steps):
            out.append(runner.model(input_ids=torch.tensor([rows]), past_key_values=cache, use_cache=True,
                                    **(extra[i] if extra else {})).logits[0])
    return out


@pytest.mark.parametrize("onednn", [False, True])
def test_steps_and_verify_forwards_match_the_unprepared_model(runners, monkeypatch, onednn):
    ref, fast = runners
    ids = random_prompts(1, seed=9, lo=12, hi=13)[0]
    steps = [[7], [8, 9, 10, 11], [12], [13, 14, 15]]  # 1-row steps and chain verifies
    want = _logits(ref, ids, steps, onednn=None)
    seen: list[tuple[tuple[int, ...], int, bool]] = []  # (query shape, K/V heads, enable_gqa) per attention call
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((tuple(q.shape), k.shape[1], bool(kwargs.get("enable_gqa"))))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = _logits(fast, ids, steps, onednn=onednn)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    cfg = fast.model.config
    heads, kv, hd, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    step, verify = seen[n: 2 * n], seen[2 * n: 3 * n]  # after the prefill's calls
    assert all(q == (1, kv, heads // kv, hd) and k == kv for q, k, _ in step)  # query groups folded into rows
    assert all(q == (1, heads, 4, hd) and k == kv and gqa for q, k, gqa in verify)  # K/V never repeated


def test_a_tree_mask_verify_matches_the_unprepared_model(runners):
    ref, fast = runners
    ids = random_prompts(1, seed=10, lo=10, hi=11)[0]
    past = len(ids) + 1
    block = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # two branches
    mask = torch.cat((torch.ones(4, past, dtype=torch.bool), block), dim=1)[None, None]
    pos = torch.tensor([[past, past + 1, past + 1, past + 2]])
    tree = {"attention_mask": mask, "position_ids": pos}
    want = _logits(ref, ids, [[5], [6, 7, 8, 9]], [{}, tree], onednn=None)
    got = _logits(fast, ids, [[5], [6, 7, 8, 9]], [{}, tree], onednn=True)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
