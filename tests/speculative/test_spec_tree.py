"""Tree speculation in the embedded decoder: masks, acceptance, the lean drafter, lossless output."""

from __future__ import annotations

import json
import random

import pytest
import torch
from spec_support import one_thread, random_prompts

from eaglenest.speculative.decoder import SpecDecoder, plain_greedy
from eaglenest.speculative.draft import load_exported_drafter
from eaglenest.speculative.drafting import DraftState, Eagle3Proposer, FastDrafter
from eaglenest.speculative.kernels import cpu_class, cpu_flags, cpu_model
from eaglenest.speculative.serve import SpecConfig, load_spec_decoder
from eaglenest.speculative.tree import (
    BEST_SHAPE_FILE,
    DraftTree,
    SpecShape,
    accept,
    measured_best_shape,
    save_best_shape,
    verify_inputs,
)


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def test_shapes_parse_validate_and_map_to_sglang_flags():
    assert SpecShape.parse("chain3") == SpecShape(depth=3)
    t = SpecShape.parse("tree4x4n12")
    assert (t.depth, t.topk, t.nodes, t.name) == (4, 4, 12, "tree4x4n12")
    assert SpecConfig.of(t).shape == t and SpecConfig.of(t).draft_tokens == 13  # SGLang counts the root
    for bad in ("tree3", "chain", "tree2x2n99"):
        with pytest.raises(ValueError):
            SpecShape.parse(bad)
    with pytest.raises(ValueError, match="chain"):
        SpecShape(depth=3, draft_tokens=5)
    c = SpecShape.parse("chain5p0.4")  # a chain stopped where the draft probability falls below 0.4
    assert (c.depth, c.min_prob, c.name, c.to_json()["min_prob"]) == (5, 0.4, "chain5p0.4", 0.4)
    assert SpecShape.parse(c.name) == c and SpecShape.parse("chain5p.25").min_prob == 0.25
    assert "min_prob" not in SpecShape.parse("chain3").to_json()
    assert SpecShape.parse("chain3p0.00001").name == "chain3p0.00001"  # never an exponent: names parse back
    for bad in ("chain3p1.5", "chain3p1", "chain3p-0.2", "tree2x2n3p0.5", "chain3p.0", "chain1p0.5"):
        with pytest.raises(ValueError):
            SpecShape.parse(bad)
    with pytest.raises(ValueError, match="only a chain"):
        SpecShape(depth=3, topk=2, draft_tokens=4, min_prob=0.3)
    with pytest.raises(ValueError, match="decimals"):
        SpecShape(depth=3, min_prob=0.12345678901234)
    with pytest.raises(ValueError, match="no confidence stop"):
        SpecConfig.of(c)
    for name in ("chain2q8", "chain5p0.4q8", "tree4x4n12q8", "chain3q4", "chain5p0.4q4", "tree4x4n12q4"):
        quant = SpecShape.parse(name)  # int8 or int4 drafter weights: part of the name
        assert quant.quant == name[-2:] and quant.name == name and quant.to_json()["quant"] == name[-2:]
        assert SpecShape.parse(name[:-2]) == SpecShape(**{**_fields(quant), "quant": ""})
    assert "quant" not in SpecShape.parse("chain2").to_json()
    for name in ("chain2q8", "chain3q4"):
        with pytest.raises(ValueError, match=f"quantized drafter weights \\({name[-2:]}\\)"):
            SpecConfig.of(SpecShape.parse(name))
    for bad in ("q8chain2", "chain3q2", "chain3q8q4"):
        with pytest.raises(ValueError):
            SpecShape.parse(bad)
    with pytest.raises(ValueError, match="quant='q3'"):
        SpecShape(depth=3, quant="q3")


def _fields(shape: SpecShape) -> dict:
    return {f: getattr(shape, f) for f in ("depth", "topk", "draft_tokens", "min_prob", "quant")}


def test_confidence_stop_is_the_product_of_the_draft_probabilities():
    """A chain of depth 5 whose draft probabilities are 0.9, 0.8, 0.8, 0.95, ...: with min_prob 0.6 the products
    0.9, 0.72, 0.576 stop it after the third draft (a per-token rule would go on: each is >= 0.6)."""
    import math
    from types import SimpleNamespace

    vocab = 50

    def logits(p: float, top: int) -> torch.Tensor:
        out = torch.full((vocab,), math.log((1 - p) / (vocab - 1)))
        out[top] = math.log(p)
        return out

    probs = [0.9, 0.8, 0.8, 0.95, 0.95]
    steps = iter(())
    proposer = Eagle3Proposer.__new__(Eagle3Proposer)
    proposer.fd = SimpleNamespace(to_target=lambda ids: ids)
    proposer.last_logits, proposer.last_hidden, proposer.root_pos = logits(probs[0], 10), torch.zeros(1, 4), 7

    def forward(ids, hidden, pos, mask):
        i = next(steps)
        return hidden, logits(probs[i], 10 + i)[None]

    proposer._forward = forward
    for min_prob, expect in ((0.6, [10, 11, 12]), (0.95, [10]), (0.56, [10, 11, 12, 13]), (0.0, [10, 11, 12, 13, 14])):
        steps = iter(range(1, len(probs)))
        proposer.shape = SpecShape(depth=5, min_prob=min_prob)
        assert proposer.propose(5).tokens == expect, min_prob


def test_best_shape_file_round_trip(tmp_path):
    path = save_best_shape(SpecShape(depth=4, topk=2, draft_tokens=6), {"speedup": 1.6}, tmp_path / "s.json")
    assert measured_best_shape(path).name == "tree4x2n6"
    assert isinstance(measured_best_shape(), SpecShape)  # the shipped file is readable
    with pytest.raises(ValueError, match="no readable"):
        measured_best_shape(tmp_path / "missing.json")


def test_best_shape_is_kept_per_kind_of_cpu(tmp_path):
    """A tree wins where AMX makes a wide verify cheap, a chain where it does not: saving one kind's shape keeps the
    other's, each machine reads its own kind's, and a kind never measured takes another's."""
    path = tmp_path / "s.json"
    save_best_shape(SpecShape(depth=3, topk=2, draft_tokens=6, quant="q4"), {"speedup": 1.69}, path, cpu="amx")
    assert measured_best_shape(path, cpu="no-amx").name == "tree3x2n6q4"  # only AMX measured yet
    save_best_shape(SpecShape(depth=3, quant="q4"), {"speedup": 1.42}, path, cpu="no-amx")
    assert measured_best_shape(path, cpu="amx").name == "tree3x2n6q4"
    assert measured_best_shape(path, cpu="no-amx").name == "chain3q4"
    saved = json.loads(path.read_text())["by_cpu"]
    assert saved["no-amx"]["measured"] == {"speedup": 1.42} and saved["amx"]["measured"] == {"speedup": 1.69}
    shipped = json.loads(BEST_SHAPE_FILE.read_text())["by_cpu"]  # both kinds measured, each with its evidence
    assert {"amx", "no-amx"} <= set(shipped) and all(e["measured"]["result_file"] for e in shipped.values())
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a file of best shapes"):
        save_best_shape(SpecShape(depth=2), {}, path, cpu="amx")  # the other kind's entry is not overwritten blind


def test_cpu_class_from_flags(monkeypatch, tmp_path):
    monkeypatch.delenv("EAGLENEST_AMX", raising=False)
    assert cpu_class(frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})) == "amx"
    assert cpu_class(frozenset({"avx512f", "avx512_bf16"})) == "no-amx"
    monkeypatch.setenv("EAGLENEST_AMX", "0")  # the decoder never runs on AMX then: its shape is the other kind's
    assert cpu_class(frozenset({"amx_bf16", "amx_tile"})) == "no-amx"
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    assert cpu_flags(info) == {"fpu", "avx512f", "amx_bf16", "amx_tile"} and cpu_model(info) == "X"
    assert cpu_flags(tmp_path / "missing") == frozenset() and cpu_model(tmp_path / "missing") == ""


def test_verify_mask_and_acceptance_by_hand():
    #        root
    #      /   |   \
    #    0:a  1:b  2:c
    #    / \        |
    #  3:d 4:e     5:f
    #  |
    #  6:g
    tree = DraftTree([10, 11, 12, 13, 14, 15, 16], [-1, -1, -1, 0, 0, 2, 3])
    assert tree.depths() == [1, 1, 1, 2, 2, 2, 3] and not tree.is_chain
    ids, pos, mask = verify_inputs(99, tree, past=5)
    assert ids.tolist() == [[99, 10, 11, 12, 13, 14, 15, 16]]
    assert pos.tolist() == [[5, 6, 6, 6, 7, 7, 7, 8]]
    assert mask.shape == (1, 1, 8, 13) and mask[0, 0, :, :5].all()
    block = mask[0, 0, :, 5:].int().tolist()
    assert block[7] == [1, 1, 0, 0, 1, 0, 0, 1]  # g sees root, a, d and itself
    assert block[6] == [1, 0, 0, 1, 0, 0, 1, 0]  # f sees root, c and itself
    # target argmax per row (row 0 = root): a, then e after a -> path [0, 4], bonus = row of e
    target = [10, 14, 0, 0, 0, 77, 0, 0]
    assert accept(tree, target) == ([0, 4], 77)
    assert accept(tree, [12, 0, 0, 15, 0, 0, 55, 0]) == ([2, 5], 55)
    assert accept(tree, [42] * 8) == ([], 42)
    chain = DraftTree.chain([5, 6, 7])
    assert chain.is_chain and verify_inputs(1, chain, past=3)[1:] == (None, None)
    assert accept(chain, [5, 6, 9, 9]) == ([0, 1], 9)


def test_fast_drafter_equals_the_reference_drafter(spec_tiny):
    runner, _, fitted, seqs, plens = spec_tiny
    draft = load_exported_drafter(fitted, embed_weight=runner.model.get_input_embeddings().weight)
    fd = FastDrafter(draft)
    s, n = seqs[2], plens[2]
    aux = runner.capture([s])[0].aux_hidden.float()[None]  # [1, T, 3H]
    from eaglenest.drafter.model import DraftKVCache

    cache, st = DraftKVCache(), DraftState(fd, 2)
    with torch.inference_mode():
        ref = draft.extend(torch.tensor([s[1: n + 1]]), aux[:, :n], torch.arange(n)[None], cache)
        out, logits = fd.forward(st, torch.tensor(s[1: n + 1]), fd.project(aux[0, :n]), torch.arange(n), None)
        torch.testing.assert_close(logits, ref.logits[0], rtol=1e-5, atol=1e-5)
        st_last = DraftState(fd, 2)  # the extend's form: only the last row past the keys/values
        last_out, last = fd.forward(st_last, torch.tensor(s[1: n + 1]), fd.project(aux[0, :n]), torch.arange(n),
                                    None, last_only=True)
        torch.testing.assert_close(last, logits[-1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last_out, out[-1:], rtol=1e-5, atol=1e-5)
        assert torch.equal(st_last.k[:, :n], st.k[:, :n]) and torch.equal(st_last.v[:, :n], st.v[:, :n])
        h, h_ref = out[-1:], ref.hidden[:, -1:]
        for i in range(3):  # chain steps fed back through each cache
            tok = torch.tensor([s[n + 1 + i]])
            ref = draft(tok[None], h_ref, torch.tensor([[n + i]]), cache)
            h, logits = fd.forward(st, tok, h, torch.tensor([n + i]), None)
            h_ref = ref.hidden
            torch.testing.assert_close(logits, ref.logits[0], rtol=1e-5, atol=1e-5)
        assert st.length == cache.length == n + 3


@pytest.mark.parametrize(("quant", "kernel_name", "tolerance"), [("q8", "skinny_linear_i8", 0.03),
                                                                   ("q4", "skinny_linear_q4", 0.15)])
def test_quantized_fast_drafter_streams_its_weights_and_drafts_nearly_the_same(spec_tiny, monkeypatch, quant,
                                                                               kernel_name, tolerance):
    """bf16 rows through the int8 or int4 kernel (counted), logits within that rounding of the bf16 drafter's
    (relative differences measured: 0.008 for q8, 0.07 for q4)."""
    from eaglenest.speculative import kernels
    from eaglenest.speculative import quant as quant_mod

    kernel = getattr(kernels, kernel_name)()
    if kernel is None:
        pytest.skip("skinny kernel unavailable here (no AVX512-BF16 or no compiler)")
    calls = []
    monkeypatch.setattr(quant_mod, kernel_name, lambda: lambda *a: calls.append(a[1].shape) or kernel(*a))
    runner, _, fitted, seqs, plens = spec_tiny
    draft = load_exported_drafter(fitted, embed_weight=runner.model.get_input_embeddings().weight,
                                  dtype=torch.bfloat16)
    s, n = seqs[2], plens[2]
    aux = runner.capture([s])[0].aux_hidden[None]
    logits = {}
    with torch.inference_mode():
        for q in ("", quant):
            fd = FastDrafter(draft, quant=q)
            st = DraftState(fd, 2)
            fd.forward(st, torch.tensor(s[1: n]), fd.project(aux[0, : n - 1]), torch.arange(n - 1), None)
            _, logits[q] = fd.forward(st, torch.tensor(s[n: n + 1]), fd.project(aux[0, n - 1: n]),
                                      torch.tensor([n - 1]), None)
    assert len(calls) >= 5  # the one-row forward's qkv, o, gate_up, down and head (and fc) took the kernel
    a, b = logits[""].float(), logits[quant].float()
    assert float((a - b).norm() / a.norm()) < tolerance


@pytest.mark.parametrize("shape", ["tree2x2n3", "tree3x3n9", "tree4x4n16", "tree3x3n9q8", "tree3x3n9q4",
                                   pytest.param("tree5x3n12", marks=pytest.mark.slow),
                                   pytest.param("tree2x4n8", marks=pytest.mark.slow)])
def test_tree_speculation_equals_target_only(spec_tiny, shape):
    runner, untrained, fitted, seqs, plens = spec_tiny
    longest = 0
    fitted_prompts = random_prompts(2, seed=301) + [s[:n] for s, n in zip(seqs, plens, strict=True)][:3]
    for folder, prompts in ((untrained, random_prompts(2, seed=300)), (fitted, fitted_prompts)):
        dec = load_spec_decoder(runner, folder, shape=shape)
        assert dec.shape.name == shape
        for ids in prompts:
            ref = plain_greedy(runner, ids, max_new_tokens=33, ignore_eos=True).output_ids
            out = dec.generate(ids, max_new_tokens=33, ignore_eos=True)
            assert out.output_ids == ref
            assert sum(out.accepted) + out.verify_ct + 1 == len(ref)
            longest = max(longest, *out.accepted)
    assert longest == dec.shape.depth  # whole root-to-leaf paths were accepted


def test_trees_accept_more_than_a_chain_of_the_same_depth(spec_tiny):
    runner, _, fitted, _, _ = spec_tiny
    prompts = random_prompts(4, seed=400)

    def accept_length(shape):
        dec = load_spec_decoder(runner, fitted, shape=shape)
        acc = [a for ids in prompts for a in dec.generate(ids, max_new_tokens=30, ignore_eos=True).accepted]
        return (sum(acc) + len(acc)) / len(acc)

    assert accept_length("tree3x4n16") > accept_length("chain3")


class OracleTreeProposer:
    """Random trees around the greedy continuation: the true path runs to a random depth (then a
    corrupted token), with random distractor siblings; the decoder must find exactly that path."""

    def __init__(self, cont: list[int], rng: random.Random, depth: int) -> None:
        self.cont, self.rng, self.depth, self.pos = cont, rng, depth, 0
        self.expected: list[int] = []

    def begin(self, prompt_ids, aux_hidden, root):
        assert root == self.cont[0]

    def propose(self, k):
        tokens, parents = [], []
        true_len = self.rng.randint(0, k)
        self.expected.append(true_len)
        parent = -1
        for d in range(1, k + 1):
            i = self.pos + d
            truth = self.cont[i] if i < len(self.cont) else 0
            for _ in range(self.rng.randint(0, 2)):  # distractors hanging under the same parent
                tokens.append((truth + 1 + self.rng.randint(0, 5)) % 512)
                parents.append(parent)
            tokens.append(truth if d <= true_len else (truth + 7) % 512)
            parents.append(parent)
            parent = len(tokens) - 1
            if self.rng.random() < 0.3:  # a child of the previous node, never a true token
                tokens.append(self.rng.choice([t for t in range(512) if t not in self.cont]))
                parents.append(max(0, parent - 1))
        order = sorted(range(len(tokens)), key=lambda j: (parents[j] if parents[j] >= 0 else -1, j))
        where = {old: new for new, old in enumerate(order)}
        return DraftTree([tokens[j] for j in order], [where[parents[j]] if parents[j] >= 0 else -1 for j in order])

    def advance(self, tokens, aux_hidden):
        assert aux_hidden.shape[0] == len(tokens)
        assert list(tokens) == self.cont[self.pos + 1: self.pos + 1 + len(tokens)]
        self.pos += len(tokens)


@pytest.mark.parametrize("seed", range(3))
def test_tree_verify_and_cache_compaction_with_an_oracle(tiny_runner, seed):
    rng = random.Random(seed)
    ids = random_prompts(1, seed=500 + seed)[0]
    cont = plain_greedy(tiny_runner, ids, max_new_tokens=50, ignore_eos=True).output_ids
    k = rng.randint(2, 5)
    holder: list[OracleTreeProposer] = []

    def make():
        holder.append(OracleTreeProposer(cont, rng, k))
        return holder[-1]

    out = SpecDecoder(tiny_runner, make, shape=SpecShape(depth=k, topk=3, draft_tokens=3 * k)).generate(
        ids, max_new_tokens=50, ignore_eos=True)
    assert out.output_ids == cont
    expected = holder[0].expected
    assert list(out.accepted[: len(expected)]) == expected and not any(out.accepted[len(expected):])
    assert max(out.accepted) > 0


def test_proposer_tree_is_well_formed(spec_tiny):
    runner, _, fitted, seqs, plens = spec_tiny
    fd = FastDrafter(load_exported_drafter(fitted, embed_weight=runner.model.get_input_embeddings().weight))
    s, n = seqs[0], plens[0]
    aux = runner.capture([s])[0].aux_hidden.float()
    p = Eagle3Proposer(fd, SpecShape(depth=4, topk=3, draft_tokens=10))
    with torch.inference_mode():
        p.begin(s[:n], aux[:n], s[n])
        tree = p.propose(4)
        assert len(tree) == 10 and max(tree.depths()) <= 4
        chain = Eagle3Proposer(fd, SpecShape(depth=4))
        chain.begin(s[:n], aux[:n], s[n])
        greedy = chain.propose(4).tokens
        assert tree.tokens[0] == greedy[0]  # the best root child comes first
        assert len(p.propose(2)) <= 3 + 9 and max(p.propose(1).depths()) == 1


def test_linears_q4_cannot_hold_stay_in_q8_with_a_warning_and_speculation_stays_lossless(
        tiny_model_dir, tiny_runner, tmp_path):
    """The measured default shape may ask q4 of any drafter: a linear whose input features are not a multiple of
    the q4 group (here the MLP's down projection, 96 inputs) is kept in q8, said in a warning, and decoding still
    equals the target's own greedy output."""
    from eaglenest.speculative.draft import write_random_draft

    folder = write_random_draft(tiny_model_dir, tmp_path / "narrow", intermediate_size=96)
    draft = load_exported_drafter(folder, embed_weight=tiny_runner.model.get_input_embeddings().weight)
    with pytest.warns(UserWarning, match=r"\['down'\] cannot be q4"):
        fd = FastDrafter(draft, quant="q4")
    assert fd.q["down"].kind == "q8" and fd.q["head"].kind == "q4"
    prompt = random_prompts(1, seed=5)[0]
    with one_thread(), pytest.warns(UserWarning, match="cannot be q4"):
        dec = SpecDecoder.eagle3(tiny_runner, draft, shape=SpecShape.parse("chain3q4"))
        got = dec.generate(prompt, max_new_tokens=20, ignore_eos=True).output_ids
    assert got == plain_greedy(tiny_runner, prompt, max_new_tokens=20, ignore_eos=True).output_ids
