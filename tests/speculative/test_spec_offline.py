"""Offline accept length: the store simulation reproduces the live decoder where the data allows it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from spec_support import one_thread

from eaglenest.drafter.ttt import answer_turns
from eaglenest.speculative.draft import load_exported_drafter
from eaglenest.speculative.drafting import Eagle3Proposer, FastDrafter
from eaglenest.speculative.offline import (
    SampleChains,
    calibrate,
    chain_drafts,
    load_offline_draft,
    offline_accept_length,
    replay_cycles,
    replay_shapes,
    score_sample,
    simulate_depths,
    simulate_groups,
    summarize,
)
from eaglenest.speculative.serve import load_spec_decoder
from eaglenest.speculative.tree import SpecShape
from eaglenest.store import held_out


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@dataclass(frozen=True)
class FakeSample:  # the shape of eaglenest.store's StoreSample
    sample_id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux_hidden: torch.Tensor  # bf16 [T, 3H]
    final_hidden: torch.Tensor  # bf16 [T, H]


class FakeStore:
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def fp32_capture(runner, seq):
    """(aux [T, 3H], final [T, H]) in fp32, by the capture convention (aux = hidden_states[id + 1])."""
    with torch.inference_mode():
        hs = runner.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in runner.aux_layer_ids], dim=-1), hs[-1][0]


def make_store(runner, seqs, plens, *, prefix="s", exact=False):
    """Real captures of the tiny target: bf16 like the store (or fp32 with ``exact``, to compare bit for bit)."""
    caps = [fp32_capture(runner, s) for s in seqs] if exact else [(c.aux_hidden, c.final_hidden)
                                                                  for c in runner.capture(seqs)]
    out = []
    for i, (s, n, (aux, final)) in enumerate(zip(seqs, plens, caps, strict=True)):
        mask = torch.zeros(len(s), dtype=torch.bool)
        mask[n:] = True  # the "assistant" tokens
        out.append(FakeSample(f"{prefix}{i}", torch.tensor(s, dtype=torch.int32), mask, aux, final))
    return FakeStore(out)


def fp32_draft(runner, folder):
    return load_exported_drafter(folder, embed_weight=runner.model.get_input_embeddings().weight.float())


def test_parallel_chains_equal_the_live_drafter_at_every_start(spec_tiny):
    runner, _, fitted, seqs, _ = spec_tiny
    draft = fp32_draft(runner, fitted)
    s = seqs[5]
    aux = runner.capture([s])[0].aux_hidden.float()  # [T, 3H]
    chains = chain_drafts(draft, torch.tensor(s), aux, 4)  # [T-1, 4]
    assert chains.shape == (len(s) - 1, 4)
    with torch.inference_mode():
        for t in range(len(s) - 1):
            live = Eagle3Proposer(FastDrafter(draft), SpecShape(depth=4))
            live.begin(s[: t + 1], aux[: t + 1], s[t + 1])
            assert live.propose(4).tokens == chains[t].tolist(), t


def test_simulation_on_regenerated_data_matches_every_live_cycle(spec_tiny):
    """Data = the target's own greedy answers: nothing is censored and each live verify cycle's accepted
    count equals the simulated chain at that root (fp32 features; bf16 rounding can flip rare near-ties)."""
    runner, _, fitted, seqs, plens = spec_tiny
    draft = fp32_draft(runner, fitted)
    head = runner.model.lm_head.weight.float()
    store = make_store(runner, seqs, plens, exact=True)
    dec = load_spec_decoder(runner, fitted, num_steps=3)
    compared = 0
    for sample, s, n in zip(store.samples, seqs, plens, strict=True):
        out = dec.generate(s[:n], max_new_tokens=len(s) - n, ignore_eos=True)
        assert out.output_ids == s[n:]
        sim = score_sample(draft, head, sample, 3)
        assert not any(sim.censored) and sim.agree == sim.loss_tokens
        by_start = dict(zip([t for t in range(len(s) - 3) if sample.loss_mask[t + 1]], sim.accepted, strict=True))
        root = n  # position of the first root (the prefill's token)
        for a, d in zip(out.accepted, out.drafted, strict=True):
            if d == 3:  # full chains only (the decoder drafts fewer right at the token budget)
                assert by_start[root - 1] == a, (sample.sample_id, root)
                compared += 1
            root += a + 1
        full = [a for a, d in zip(out.accepted, out.drafted, strict=True) if d == 3]
        assert sim.cycles[: len(full)] == full  # the cycle walk IS the live decode, cycle by cycle
        assert abs(len(sim.cycles) - len(out.accepted)) <= 1  # (the decoder drafts less at its token budget)
    assert compared > 50
    res = offline_accept_length(store, draft, head, num_steps=3, heldout_fraction=1.0)
    assert res.censored_share == 0 and res.target_agreement == 1.0
    assert res.accept_length == pytest.approx(res.accept_length_lower)
    assert res.accept_length > 1.5 and res.samples == len(seqs)
    walked = [a for sample in store.samples for a in score_sample(draft, head, sample, 3).cycles]
    assert res.accept_length_cycles == pytest.approx(1 + sum(walked) / len(walked))
    bf16 = offline_accept_length(make_store(runner, seqs, plens), draft, head, num_steps=3, heldout_fraction=1.0)
    assert bf16.target_agreement > 0.95 and abs(bf16.accept_length - res.accept_length) < 0.1  # the store's dtype
    # overlapping groups (a prompt set and its kinds) from one simulation: each exactly as simulated alone
    groups = {"all": list(range(len(seqs))), "first": [0], "rest": list(range(1, len(seqs)))}
    together = simulate_groups(store, draft, head, groups, (1, 3))
    for name, idx in groups.items():
        assert together[name] == simulate_depths(store, draft, head, idx, (1, 3)), name


def test_replay_of_a_chain_is_the_cycle_walk(spec_tiny):
    """Replaying the live proposer cycle by cycle (any shape) gives, for a chain, exactly the batched
    simulation's cycle walk on the target's own greedy answers."""
    runner, _, fitted, seqs, plens = spec_tiny
    draft = fp32_draft(runner, fitted)
    head = runner.model.lm_head.weight.float()
    store = make_store(runner, seqs, plens, exact=True)
    fd = FastDrafter(draft)
    walked = replayed = 0
    for sample in store.samples:
        cycles = replay_cycles(lambda: Eagle3Proposer(fd, SpecShape(depth=3)), sample, 3)
        assert cycles == score_sample(draft, head, sample, 3).cycles, sample.sample_id
        walked, replayed = walked + len(cycles), replayed + sum(cycles)
    assert walked > 100 and replayed > walked  # more than one accepted draft a cycle: a real comparison
    # two answer turns in one sample (a fresh proposer per turn, the first answer inside the second's prompt)
    s, n = seqs[0], plens[0]
    two = FakeSample("two", store.samples[0].input_ids, torch.tensor([i >= n and not n + 12 <= i < n + 16
                                                                      for i in range(len(s))]),
                     store.samples[0].aux_hidden, store.samples[0].final_hidden)
    assert answer_turns(two.loss_mask.tolist()) == [(n, n + 11), (n + 16, len(s) - 1)]
    cycles = replay_cycles(lambda: Eagle3Proposer(fd, SpecShape(depth=3)), two, 3)
    assert cycles == score_sample(draft, head, two, 3).cycles and len(cycles) > 6
    res = replay_shapes(store, draft, range(len(seqs)), [SpecShape(depth=3)])["chain3"]
    assert res.cycles == walked and res.accept_length_cycles == pytest.approx(1 + replayed / walked)


def test_replayed_tree_equals_the_live_tree_decoder(spec_tiny):
    """A tree (EAGLE-2, topk 2) replayed on the captured answers accepts what the live tree decoder accepts on
    the same prompts, cycle by cycle, and beats the chain of the same depth."""
    runner, _, fitted, seqs, plens = spec_tiny
    shape = SpecShape(depth=3, topk=2, draft_tokens=5)
    draft = fp32_draft(runner, fitted)
    store = make_store(runner, seqs, plens, exact=True)
    dec = load_spec_decoder(runner, fitted, shape=shape)
    fd = FastDrafter(draft)
    compared = 0
    for sample, s, n in zip(store.samples, seqs, plens, strict=True):
        budget = len(s) - n
        out = dec.generate(s[:n], max_new_tokens=budget, ignore_eos=True)
        assert out.output_ids == s[n:]
        cycles = replay_cycles(lambda: Eagle3Proposer(fd, shape), sample, shape.depth)
        full, done = 0, 1  # cycles drafted at full depth: before the decoder's token budget cuts its depth
        for a in out.accepted:
            if min(shape.depth, budget - done - 1) < shape.depth:
                break
            full, done = full + 1, done + a + 1
        assert cycles[:full] == list(out.accepted[:full]), sample.sample_id
        compared += full
    assert compared > 100
    res = replay_shapes(store, draft, range(len(seqs)), [shape, SpecShape(depth=3)])
    assert res[shape.name].accept_length_cycles > res["chain3"].accept_length_cycles


def test_replay_turns_and_refusals():
    assert answer_turns([False, True, True, False, False, True]) == [(1, 2), (5, 5)]
    assert answer_turns([True, True, False, True]) == [(3, 3)]  # a run at token 0 has no prompt before it
    assert answer_turns([False, False]) == []


def test_off_policy_answers_are_censored_not_counted_as_failures(spec_tiny):
    runner, _, fitted, seqs, plens = spec_tiny
    g = torch.Generator().manual_seed(0)
    noisy = []
    for s, n in zip(seqs, plens, strict=True):  # replace every 5th answer token: the data leaves the greedy path
        s = list(s)
        for i in range(n + 4, len(s), 5):
            s[i] = int(torch.randint(3, 500, (1,), generator=g))
        noisy.append(s)
    draft = fp32_draft(runner, fitted)
    res = offline_accept_length(make_store(runner, noisy, plens), draft, runner.model.lm_head.weight.float(),
                                num_steps=3, heldout_fraction=1.0)
    assert 0 < res.censored_share < 1 and res.target_agreement < 1
    assert res.accept_length >= res.accept_length_lower


def test_survival_estimate_by_hand():
    chains = [SampleChains(accepted=[0, 1, 3, 1, 2], censored=[False, True, False, False, False], agree=0,
                           loss_tokens=0)]
    res = summarize(chains, 3, ["a"])
    # step 1: all 5 evaluated, 4 accepted; step 2: the censored a=1 chain drops out -> 2 of 3; step 3: 1 of 2
    assert res.conditional_at == pytest.approx((4 / 5, 2 / 3, 1 / 2))
    assert res.accept_length == pytest.approx(1 + 0.8 + 0.8 * 2 / 3 + 0.8 * 2 / 3 / 2)
    assert res.accept_length_lower == pytest.approx((0 + 1 + 3 + 1 + 2 + 5) / 5)
    assert res.censored_share == pytest.approx(0.2)


def test_heldout_split_and_refusals(spec_tiny, tiny_model_dir):
    runner, untrained, _, seqs, plens = spec_tiny
    store = make_store(runner, seqs, plens, prefix="sample-")
    draft, head = load_offline_draft(tiny_model_dir, untrained)
    held = [s.sample_id for s in store.samples if held_out(s.sample_id, 0.3)]  # the trainer's split
    assert 0 < len(held) < len(seqs)
    res = offline_accept_length(store, draft, head, num_steps=2, heldout_fraction=0.3)
    assert list(res.sample_ids) == held
    capped = offline_accept_length(store, draft, head, num_steps=2, heldout_fraction=0.3, max_samples=1)
    assert list(capped.sample_ids) == held[:1]  # the trainer's eval cap: the rest were trained on
    assert offline_accept_length(store, draft, head, sample_ids=["sample-1"]).sample_ids == ("sample-1",)
    with pytest.raises(ValueError, match="aux layers"):
        offline_accept_length(store, draft, head, heldout_fraction=1.0, aux_layer_ids=(0, 1, 2))
    with pytest.raises(ValueError, match="no held-out samples"):
        offline_accept_length(store, draft, head, sample_ids=["nope"])


def test_calibration():
    c = calibrate(2.4, 3.0)
    assert c.ratio == pytest.approx(0.8) and c.error == pytest.approx(-0.6)


def test_offline_estimate_is_calibrated_against_live_decoding(spec_tiny):
    """Same held-out prompts decoded live: the store simulation predicts the live accept length."""
    from eaglenest.speculative.cpu_bench import live_accept_on_samples

    runner, _, fitted, seqs, plens = spec_tiny
    store = make_store(runner, seqs, plens)
    res = offline_accept_length(store, fp32_draft(runner, fitted), runner.model.lm_head.weight.float(), num_steps=3,
                                heldout_fraction=1.0)
    live = live_accept_on_samples(load_spec_decoder(runner, fitted, num_steps=3), store.samples, max_new_tokens=40)
    cal = calibrate(res.accept_length_cycles, live.accept_length)
    assert live.cycles > 100 and 0.95 < cal.ratio < 1.05, cal


def test_per_cycle_mean_weighs_hard_stretches_like_live_decoding():
    """An answer half easy (every chain accepts 3) and half hard (none accepted): live decoding crosses
    the easy half in few cycles and the hard half one token per cycle, so its mean accept length is far
    below the per-start mean; the simulator must report the per-cycle one."""
    from eaglenest.drafter.ttt import cycle_walk

    mask = [False] * 4 + [True] * 24  # a 4-token prompt, then a 24-token answer (last token = end of turn)
    lead = [0] * 28
    for t in range(3, 15):
        lead[t] = 3  # roots 4..15 are easy
    walk = cycle_walk(mask, lead)
    # roots 4, 8, 12 accept 3 (12 -> 16 crosses into the hard half), then roots 16..26 accept 0 each
    assert walk == [3, 3, 3] + [0] * 11
    per_cycle = 1 + sum(walk) / len(walk)
    per_start = 1 + sum(lead[3:27]) / 24
    assert per_cycle == pytest.approx(1 + 9 / 14) and per_start == pytest.approx(2.5)
    # two turns are walked separately and a turn's end caps the accepted drafts
    assert cycle_walk([False, True, True, True, False, True, True], [3, 3, 3, 3, 3, 3, 3]) == [2, 1]
