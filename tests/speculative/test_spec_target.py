"""The decode-time target: the lean Llama forward computes what transformers computes (fp32, bit for
bit), its preallocated cache keeps and drops rows like ``DynamicCache``, and decoding on either is lossless."""

from __future__ import annotations

import pytest
import torch
from spec_support import one_thread, random_prompts

from eaglenest.speculative.decoder import plain_greedy
from eaglenest.speculative.onednn import phase
from eaglenest.speculative.serve import load_spec_decoder
from eaglenest.speculative.target import HFTarget, LeanTarget, decode_target
from eaglenest.speculative.tree import DraftTree, verify_inputs


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _tree_step(tgt, cache, root: int, tree: DraftTree, past: int):
    ids, pos, mask = verify_inputs(root, tree, past)
    return tgt.forward(cache, ids, pos=pos, mask=mask, aux=True)


@pytest.mark.parametrize("onednn", [False, True])
def test_lean_forward_equals_transformers(tiny_runner, onednn):
    aux_ids = (0, 2, tiny_runner.num_layers - 1)  # the last layer: transformers returns it normed
    lean, hf = decode_target(tiny_runner.model, aux_ids), decode_target(tiny_runner.model, aux_ids, lean=False)
    assert isinstance(lean, LeanTarget) and isinstance(hf, HFTarget)
    ids = random_prompts(1, seed=3, lo=11, hi=12)[0]
    caches = lean.new_cache(4), hf.new_cache(4)  # the lean cache grows past its capacity
    pairs = list(zip((lean, hf), caches, strict=True))
    chain, tree = DraftTree.chain([5, 6, 7]), DraftTree([8, 9, 10, 11], [-1, 0, -1, 2])
    with torch.inference_mode(), phase(onednn):
        got = [tgt.forward(c, torch.tensor([ids]), aux=True, last_only=True) for tgt, c in pairs]
        past = len(ids)
        for step in ("one", "chain", "tree", "one"):
            assert all(torch.equal(a, b) for a, b in zip(got[0], got[1], strict=True)), step
            if step == "one":
                got = [tgt.forward(c, torch.tensor([[4]]), aux=True) for tgt, c in pairs]
                rows = [0]
            else:
                t = chain if step == "chain" else tree
                got = [_tree_step(tgt, c, 4, t, past) for tgt, c in pairs]
                rows = [0, 1, 2] if step == "chain" else [0, 3, 4]  # a tree path is gathered into place
            for tgt, c in pairs:
                tgt.keep_rows(c, past, rows)
            past += len(rows)
        assert caches[0].length == caches[1].get_seq_length() == past


def test_decode_target_is_made_once_per_aux_layers(tiny_runner):
    model = tiny_runner.model
    assert decode_target(model, (1,)) is decode_target(model, [1])
    assert decode_target(model, (1,)) is not decode_target(model, (2,))
    assert isinstance(decode_target(model, (1,), lean=False), HFTarget)


def test_speculation_on_transformers_forward_is_lossless_too(spec_tiny):
    runner, _, fitted, seqs, plens = spec_tiny
    dec = load_spec_decoder(runner, fitted, num_steps=3)
    dec.lean = False
    for s, n in list(zip(seqs, plens, strict=True))[:4]:
        ref = plain_greedy(runner, s[:n], max_new_tokens=24, ignore_eos=True, lean=False).output_ids
        assert dec.generate(s[:n], max_new_tokens=24, ignore_eos=True).output_ids == ref == s[n: n + 24]
