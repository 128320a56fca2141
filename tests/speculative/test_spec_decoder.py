"""The embedded EAGLE-3 decoder is lossless: greedy speculative output == target-only greedy output."""

from __future__ import annotations

import os
import random

import pytest
import torch
from spec_support import one_thread, random_prompts

from eaglenest.speculative.decoder import AcceptStats, SpecDecoder, plain_greedy
from eaglenest.speculative.draft import DraftLoadError, load_exported_drafter, write_random_draft
from eaglenest.speculative.drafting import Eagle3Proposer, FastDrafter
from eaglenest.speculative.onednn import OneDNN
from eaglenest.speculative.serve import load_spec_decoder
from eaglenest.speculative.tree import DraftTree, SpecShape


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def test_plain_greedy_is_the_runner_greedy(tiny_runner):
    for ids in random_prompts(4, seed=1):
        ref = tiny_runner.generate(ids, max_new_tokens=12, ignore_eos=True).output_ids
        assert plain_greedy(tiny_runner, ids, max_new_tokens=12, ignore_eos=True).output_ids == ref
        hf = tiny_runner.model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert ref == hf[0, len(ids):].tolist()


@pytest.mark.parametrize(("which", "steps"), [("untrained", 3), ("fitted", 1), ("fitted", 3), ("fitted", 5)])
def test_speculative_equals_target_only_on_many_prompts(spec_tiny, which, steps):
    runner, untrained, fitted, _, _ = spec_tiny
    dec = load_spec_decoder(runner, untrained if which == "untrained" else fitted, num_steps=steps)
    accepted = []
    for ids in random_prompts(8, seed=100 + steps):
        ref = plain_greedy(runner, ids, max_new_tokens=33, ignore_eos=True).output_ids
        out = dec.generate(ids, max_new_tokens=33, ignore_eos=True)
        assert out.output_ids == ref
        assert sum(out.accepted) + out.verify_ct + 1 == len(ref)  # every token came from prefill or a verify
        accepted += out.accepted
    if which == "fitted":  # the real EAGLE-3 path accepted drafts, including whole chains
        assert max(accepted) == steps and min(accepted) == 0


def test_confidence_stopped_chains_are_lossless_and_draft_fewer_where_unsure(spec_tiny):
    """``chainDpP``: a cycle drafts 1..D tokens, stopping where the product of draft probabilities falls
    below P; the output is still the target's own greedy decoding (fp32)."""
    runner, untrained, fitted, seqs, plens = spec_tiny
    for path, min_prob in ((fitted, 0.5), (fitted, 0.9), (untrained, 0.5)):
        dec = load_spec_decoder(runner, path, shape=SpecShape(depth=5, min_prob=min_prob))
        drafted, accepted = [], []
        prompts = [s[:n] for s, n in zip(seqs, plens, strict=True)] + random_prompts(4, seed=7)
        for ids in prompts:
            ref = plain_greedy(runner, ids, max_new_tokens=30, ignore_eos=True).output_ids
            out = dec.generate(ids, max_new_tokens=30, ignore_eos=True)
            assert out.output_ids == ref, (path, min_prob)
            assert sum(out.accepted) + out.verify_ct + 1 == len(ref)
            drafted += out.drafted
            accepted += out.accepted
        assert all(d <= 5 for d in drafted) and all(a <= d for a, d in zip(accepted, drafted, strict=True))
        if path == untrained:  # a random drafter is never sure: one draft (the free one) per cycle (0: at the budget)
            assert set(drafted) - {0} == {1}
        else:  # the fitted drafter is sure on its own sequences and unsure on random prompts
            assert 5 in drafted and min(drafted) < 5, (min_prob, sorted(set(drafted)))
    fixed = load_spec_decoder(runner, fitted, shape=SpecShape(depth=5))
    out = fixed.generate(random_prompts(1, seed=7)[0], max_new_tokens=30, ignore_eos=True)
    assert out.drafted[:3] == (5, 5, 5)  # without min_prob a cycle drafts 5 (fewer only near the token budget)


def test_speculative_on_the_fitted_sequences_accepts_every_length(spec_tiny):
    runner, _, fitted, seqs, plens = spec_tiny
    dec = load_spec_decoder(runner, fitted, num_steps=3)
    acc, drafted = [], []
    for s, n in zip(seqs, plens, strict=True):
        out = dec.generate(s[:n], max_new_tokens=len(s) - n, ignore_eos=True)
        assert out.output_ids == s[n:]
        acc += out.accepted
        drafted += out.drafted
    stats = AcceptStats.from_cycles(acc, drafted, 3)
    assert all(h > 0 for h in stats.histogram), stats  # 0, 1, 2 and 3 accepted drafts all occur
    assert stats.accept_length > 1.5


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_a_quantized_drafter_is_lossless_and_still_accepts(spec_tiny, quant):
    """The drafter's weights in int8 or int4 change only the drafts: the target's verification keeps the output its
    own greedy decoding (fp32: the dequantized weights), and the fitted drafter still gets whole chains accepted."""
    runner, _, fitted, seqs, plens = spec_tiny
    dec = load_spec_decoder(runner, fitted, shape=f"chain3{quant}")
    assert dec.make_proposer().fd.quant == quant
    acc = []
    for s, n in list(zip(seqs, plens, strict=True))[:8]:
        out = dec.generate(s[:n], max_new_tokens=len(s) - n, ignore_eos=True)
        assert out.output_ids == s[n:]
        acc += out.accepted
    for ids in random_prompts(3, seed=41):
        ref = plain_greedy(runner, ids, max_new_tokens=25, ignore_eos=True).output_ids
        assert dec.generate(ids, max_new_tokens=25, ignore_eos=True).output_ids == ref
    assert max(acc) == 3


def test_stop_tokens_and_budgets_match_plain(spec_tiny):
    runner, _, fitted, seqs, plens = spec_tiny
    dec = load_spec_decoder(runner, fitted, num_steps=4)
    for s, n in list(zip(seqs, plens, strict=True))[:6]:
        stop = s[n + 7]  # a token the greedy continuation emits
        for budget in (0, 1, 2, 5, 40):
            ref = plain_greedy(runner, s[:n], max_new_tokens=budget, stop_token_ids=[stop])
            out = dec.generate(s[:n], max_new_tokens=budget, stop_token_ids=[stop])
            assert (out.output_ids, out.finish_reason) == (ref.output_ids, ref.finish_reason)
            assert len(out.output_ids) <= budget


def test_onednn_policies_do_not_change_fp32_output(spec_tiny):
    runner, _, fitted, seqs, plens = spec_tiny
    for name, policy in OneDNN.candidates().items():
        dec = load_spec_decoder(runner, fitted, num_steps=3, onednn=policy)
        ids = seqs[0][: plens[0]]
        assert dec.generate(ids, max_new_tokens=20).output_ids == plain_greedy(
            runner, ids, max_new_tokens=20, onednn=policy).output_ids, name


class OracleProposer:
    """Knows the greedy continuation; corrupts the drafts at chosen absolute output positions."""

    def __init__(self, continuation: list[int], corrupt: set[int], vocab: int) -> None:
        self.cont, self.corrupt, self.vocab = continuation, corrupt, vocab
        self.pos = 0  # index in the continuation of the current root

    def begin(self, prompt_ids, aux_hidden, root):
        assert root == self.cont[0] and aux_hidden.shape[0] == len(prompt_ids)
        self.pos = 0

    def propose(self, k):
        out = []
        for j in range(1, k + 1):
            i = self.pos + j
            tok = self.cont[i] if i < len(self.cont) else 0
            out.append((tok + 1) % self.vocab if i in self.corrupt else tok)
        return DraftTree.chain(out)

    def advance(self, tokens, aux_hidden):
        assert aux_hidden.shape[0] == len(tokens)
        assert list(tokens) == self.cont[self.pos + 1: self.pos + 1 + len(tokens)]
        self.pos += len(tokens)


@pytest.mark.parametrize("seed", range(4))
def test_verify_and_rollback_with_an_oracle_proposer(tiny_runner, seed):
    rng = random.Random(seed)
    ids = random_prompts(1, seed=200 + seed)[0]
    cont = plain_greedy(tiny_runner, ids, max_new_tokens=60, ignore_eos=True).output_ids
    corrupt = {i for i in range(1, 60) if rng.random() < 0.3}
    k = rng.randint(1, 6)
    dec = SpecDecoder(tiny_runner, lambda: OracleProposer(cont, corrupt, 512), shape=SpecShape(depth=k))
    out = dec.generate(ids, max_new_tokens=60, ignore_eos=True)
    assert out.output_ids == cont
    # expected accepts: from each root, drafts run until the first corrupted position
    pos, expected = 0, []
    while pos < 59:
        kk = min(k, 58 - pos)  # the decoder never drafts past the token budget
        a = next((j - 1 for j in range(1, kk + 1) if pos + j in corrupt), kk)
        expected.append(a)
        pos += a + 1
    assert list(out.accepted) == expected


def test_accept_stats_by_hand():
    s = AcceptStats.from_cycles([0, 3, 1, 2], [3, 3, 3, 2], 3)
    assert s.accept_length == pytest.approx((0 + 3 + 1 + 2 + 4) / 4)
    assert s.histogram == (1, 1, 1, 1)
    assert s.acceptance_at == pytest.approx((3 / 4, 2 / 4, 1 / 3))
    assert s.conditional_at == pytest.approx((3 / 4, 2 / 3, 1 / 1))  # the a=2 cycle never offered position 3


def test_drafter_rollback_equals_a_fresh_start(spec_tiny):
    """After propose/advance cycles, the drafter's cache state equals one built from scratch."""
    runner, _, fitted, seqs, plens = spec_tiny
    draft = FastDrafter(load_exported_drafter(fitted, embed_weight=runner.model.get_input_embeddings().weight))
    s, n = seqs[3], plens[3]
    aux = runner.capture([s])[0].aux_hidden.float()  # [T, 3H]
    for shape in (SpecShape(depth=3), SpecShape(depth=3, topk=3, draft_tokens=8)):
        live = Eagle3Proposer(draft, shape, capacity=4)  # tiny capacity: the cache grows on the way
        live.begin(s[:n], aux[:n], s[n])
        pos = n
        for step in (2, 0, 3, 1):
            live.propose(3)
            live.advance(s[pos + 1: pos + 2 + step], aux[pos: pos + 1 + step])
            pos += step + 1
            fresh = Eagle3Proposer(draft, shape)
            fresh.begin(s[:pos], aux[:pos], s[pos])
            assert live.state.length == fresh.state.length == pos
            assert live.propose(3) == fresh.propose(3)
            live.state.length = pos
            torch.testing.assert_close(live.last_logits, fresh.last_logits, rtol=1e-4, atol=1e-4)


def test_loader_refuses_a_wrong_target_or_folder(spec_tiny, tmp_path):
    runner, untrained, _, _, _ = spec_tiny
    emb = runner.model.get_input_embeddings().weight
    with pytest.raises(DraftLoadError, match="aux layers"):
        load_exported_drafter(untrained, embed_weight=emb, target_aux_layer_ids=(0, 2, 5))
    other = write_random_draft(runner.model_dir, tmp_path / "d", aux_layer_ids=(0, 2, 5))
    with pytest.raises(DraftLoadError, match="aux layers"):
        load_spec_decoder(runner, other)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(DraftLoadError, match="EAGLE-3"):
        load_exported_drafter(tmp_path / "x", embed_weight=emb)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_smollm2_with_trained_drafter_is_lossless():
    """Real SmolLM2 (fp32) + a trained drafter, chains and trees: EAGLENEST_TRAINED_DRAFTER=<exported folder>."""
    path = os.environ.get("EAGLENEST_TRAINED_DRAFTER")
    if not path:
        pytest.skip("set EAGLENEST_TRAINED_DRAFTER to an exported SmolLM2 drafter folder")
    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.models import ensure_default_model
    from eaglenest.speculative import prompts as P
    from eaglenest.speculative.draft import draft_aux_layer_ids

    torch.set_num_threads(2)
    runner = TargetRunner(ensure_default_model(), dtype="float32", aux_layer_ids=draft_aux_layer_ids(path))
    ids = P.tokenize(P.load_prompt_set("mt-bench", limit=6), runner.tokenizer)
    refs = [plain_greedy(runner, x, max_new_tokens=40).output_ids for x in ids]
    for shape in ("chain3", "chain5", "tree3x4n12", "tree5x4n16", "tree4x8n24"):
        dec = load_spec_decoder(runner, path, shape=shape)
        acc, drafted = [], []
        for x, ref in zip(ids, refs, strict=True):
            out = dec.generate(x, max_new_tokens=40)
            assert out.output_ids == ref, shape
            acc += out.accepted
            drafted += out.drafted
        stats = AcceptStats.from_cycles(acc, drafted, dec.shape.depth)
        print(f"SmolLM2 fp32 {shape}: accept length {stats.accept_length:.3f}, histogram {stats.histogram}")
        assert max(acc) > 1, shape  # the drafter's drafts were accepted, so the tree paths were exercised


def test_reads_the_drafter_packages_sglang_export(spec_tiny, tmp_path, tiny_model_dir):
    """eaglenest.drafter's export -> this loader gives the model its own loader gives; other targets refused."""
    from eaglenest.drafter.export import TrainedDrafter, export_drafter, load_drafter
    from eaglenest.drafter.model import DrafterConfig, Eagle3Drafter
    from eaglenest.models import load_config
    from eaglenest.speculative.draft import check_export_matches
    from eaglenest.testing.tiny_model import build_tiny_llama

    runner = spec_tiny[0]
    cfg = DrafterConfig.from_target(load_config(tiny_model_dir), aux_layer_ids=runner.aux_layer_ids,
                                    draft_vocab_size=300)
    torch.manual_seed(3)
    model = Eagle3Drafter(cfg)
    model.load_vocab(torch.arange(300) * 0 + 5, torch.arange(512).ge(5) & torch.arange(512).lt(305))
    out = export_drafter(TrainedDrafter(weights=model.state_dict(), config=cfg, provenance=runner.provenance(),
                                        training={}), tmp_path / "export")
    mine = load_exported_drafter(out, embed_weight=runner.model.get_input_embeddings().weight,
                                 target_aux_layer_ids=runner.aux_layer_ids)
    theirs = load_drafter(out, target_dir=tiny_model_dir).model
    ids, hid, pos = torch.randint(0, 512, (1, 7)), torch.randn(1, 7, 3 * 64), torch.arange(7).view(1, 7)
    a, b = mine.extend(ids, hid, pos), theirs.extend(ids, hid, pos)
    torch.testing.assert_close(a.logits, b.logits)
    assert torch.equal(mine.to_target_ids(a.logits.argmax(-1)), theirs.to_target_ids(b.logits.argmax(-1)))
    check_export_matches(out, tiny_model_dir)
    other = build_tiny_llama(tmp_path / "other", hidden=32)
    with pytest.raises(DraftLoadError, match="hidden_size"):
        check_export_matches(out, other)


def test_outputs_are_judged_against_the_plain_greedy_of_their_own_kernels():
    """bf16 on AMX rounds differently from AVX-512: the fastest plain (here AVX-512) may write other tokens than
    the plain run on the decoder's own kernels. The mismatch is the closest plain's, named; all are kept."""
    from eaglenest.speculative.cpu_bench import MethodTotals, SideBySide

    def totals(method, policy, outputs, decode_s):
        spec = method == "eagle3"
        return MethodTotals(method=method, policy=policy, tokens=6, decode_s=decode_s, cycles=4, outputs=outputs,
                            accepted=[1] * 4 if spec else [], drafted=[3] * 4 if spec else [])

    avx, on_amx = [[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]]
    res = SideBySide(model="m", draft="d", dtype="bfloat16", prompts=2, rounds=1, max_new_tokens=3, totals=[
        totals("plain", "prefill-only", avx, 1.0), totals("plain", "prefill-only/amx", on_amx, 1.1),
        totals("eagle3", "prefill+verify", on_amx, 0.5)])
    eagle = res.best("eagle3")
    assert res.best("plain").policy == "prefill-only"
    assert res.mismatch_rates(eagle) == {"prefill-only": 0.5, "prefill-only/amx": 0.0}
    assert res.closest_plain(eagle) == "prefill-only/amx" and res.mismatch_rate(eagle) == 0.0
    assert res.to_json()["mismatch_against"] == "prefill-only/amx"
    assert "on its kernels (prefill-only/amx) 0.0% of prompts" in res.lines()[-1]
    res.totals[1].outputs = [[7, 7, 7], [4, 5, 6]]  # no plain run agrees: the closest one's rate, ties to the fastest
    assert res.closest_plain(eagle) == "prefill-only" and res.mismatch_rate(eagle) == 0.5


def test_side_by_side_benchmark_accounts_every_variant(spec_tiny, tmp_path):
    from eaglenest.speculative.cpu_bench import run_record, save_measured_shape, side_by_side
    from eaglenest.speculative.kernels import amx_available
    from eaglenest.speculative.tree import measured_best_shape

    runner, _, fitted, seqs, plens = spec_tiny
    prompts = [s[:n] for s, n in zip(seqs, plens, strict=True)][:3]
    shapes = [SpecShape(depth=3), SpecShape.parse("tree3x2n5")]
    res = side_by_side(runner, lambda pol, shape: load_spec_decoder(runner, fitted, shape=shape, onednn=pol), prompts,
                       max_new_tokens=12, shapes=shapes, plain_policies=["onednn", "prefill-only"],
                       spec_policies=["prefill-only"], rounds=2, ignore_eos=True)
    on_amx = {"plain onednn/amx", "plain prefill-only/amx"} if amx_available() else set()  # both kernel paths
    assert {t.label for t in res.totals} == {"plain onednn", "plain prefill-only", "eagle3 prefill-only chain3",
                                             "eagle3 prefill-only tree3x2n5"} | on_amx
    assert all(t.tokens == 72 and len(t.outputs) == 3 for t in res.totals)  # 2 rounds x 3 prompts x 12 tokens
    eagle = [t for t in res.totals if t.method == "eagle3"]
    assert all(res.mismatch_rate(t) == 0 for t in eagle)  # fp32: lossless
    assert all(sum(t.accepted) + t.cycles + 6 == 72 for t in eagle)  # every token from the prefill or a verify
    assert res.best("plain").cycles == 66
    assert res.speedup == pytest.approx(res.best("eagle3").tok_s / res.best("plain").tok_s)
    c = res.cycle_cost(eagle[0])
    assert c["total"] == pytest.approx(c["draft"] + c["verify"] + c["other"]) and c["total"] > 0
    text = "\n".join(res.lines())
    assert "SPEEDUP" in text and "cycle" in text and "mismatch 0.0%" in text
    record = run_record(res, argv=["bench"], load_before=(0.0, 0.0, 0.0))
    assert {"command", "commit", "date", "machine", "result"} <= set(record)
    assert record["result"]["best_eagle3"]["shape"] in ("chain3", "tree3x2n5")
    saved = save_measured_shape(res, tmp_path / "r.json", record, path=tmp_path / "shape.json")
    assert measured_best_shape(saved).name == res.best("eagle3").shape
