"""Shard validation: every check, quarantine with the reason, bounded wait; a wrong or short capture is a
terminal error and NaN/Inf hidden states are never accepted. (Checks in worker processes and the Validator's
rounds: test_validate_processes.py.)"""

import json

import pytest
import torch

from eaglenest import contract
from eaglenest.extraction.lm_head import argmax_agreement, argmax_agreements
from eaglenest.extraction.validate import Expectation, ValidateConfig, validate_batch
from tests.validate_helpers import AUX, EXPECT, H, check, prov, put, sample, shard_bytes


def test_valid_shard_becomes_a_ledger_entry(tmp_path):
    s = sample("good")
    data = shard_bytes(s)
    res = check(tmp_path, [(s, data)])
    (e,) = res.entries
    assert (e.sample_id, e.num_tokens, e.loss_tokens, e.loss_spans) == ("good", 6, 4, ((2, 6),))
    assert e.sha256 == contract.sha256_bytes(data) and e.bytes == len(data)
    assert len(e.stats["norms"]) == len(AUX) + 1 and not res.invalid


CASES = [
    ("nan", lambda s: shard_bytes(s, raw_nan=True), "nonfinite", True, "non-finite value in aux_hidden"),
    ("short", lambda s: shard_bytes(s, ids=s.input_ids.tolist()[:-1]), "tokens", True, "T=5 rows"),
    ("ids", lambda s: shard_bytes(s, ids=[9, *s.input_ids.tolist()[1:]]), "tokens", True, "position 0"),
    ("aux", lambda s: shard_bytes(s, p=prov(aux_layer_ids=(1, 2, 4))), "provenance", False, "aux_layer_ids"),
    ("dtype", lambda s: shard_bytes(s, p=prov(dtype="float16")), "provenance", False, "dtype"),
    ("junk", lambda s: b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}", "unreadable", True, "garbage header"),
    ("v2", lambda s: shard_bytes(s).replace(b'"schema_version":"1"', b'"schema_version":"2"'), "unreadable",
     True, "schema_version"),
]


@pytest.mark.parametrize(("name", "make", "kind", "requeue", "match"), CASES, ids=[c[0] for c in CASES])
def test_invalid_shards_are_quarantined_with_their_reason(tmp_path, name, make, kind, requeue, match):
    good, bad = sample("fine"), sample(f"bad-{name}")
    res = check(tmp_path, [(good, shard_bytes(good)), (bad, make(bad))])
    assert [e.sample_id for e in res.entries] == ["fine"]  # the rest of the batch is unaffected
    (inv,) = res.invalid
    assert (inv.sample_id, inv.kind, inv.requeue) == (bad.sample_id, kind, requeue) and match in inv.reason
    name_ = contract.shard_filename(bad.sample_id)
    assert not (tmp_path / "capture" / name_).exists()  # never stays under its capture name
    note = json.loads((tmp_path / "quarantine" / f"{inv.quarantined}.reason.json").read_text())
    assert note["sample_id"] == bad.sample_id and note["kind"] == kind and match in note["reason"]
    assert (tmp_path / "quarantine" / inv.quarantined).is_file()


def test_quarantining_twice_keeps_both(tmp_path):
    s = sample("twice")
    for _ in range(2):
        check(tmp_path, [(s, shard_bytes(s, raw_nan=True))])
    assert len(list((tmp_path / "quarantine").glob("*.reason.json"))) == 2


class FakeClock:
    def __init__(self, on_sleep=None):
        self.now, self.sleeps, self.on_sleep = 0.0, 0, on_sleep

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s
        self.sleeps += 1
        if self.on_sleep:
            self.on_sleep(self.sleeps)


def test_missing_shard_waits_bounded_then_is_terminal(tmp_path):
    s = sample("late")
    clock = FakeClock(lambda n: put(tmp_path, s, shard_bytes(s)) if n == 3 else None)  # SGLang: appears late
    res = check(tmp_path, [(s, None)], config=ValidateConfig(shard_wait_s=5, poll_s=0.5), clock=clock,
                sleep=clock.sleep)
    assert [e.sample_id for e in res.entries] == ["late"] and clock.sleeps == 3
    gone = sample("never")
    clock = FakeClock()
    res = check(tmp_path, [(gone, None)], config=ValidateConfig(shard_wait_s=5, poll_s=0.5), clock=clock,
                sleep=clock.sleep)
    (inv,) = res.invalid
    assert inv.kind == "missing" and not inv.requeue and "capture missing" in inv.reason
    assert clock.now == pytest.approx(5.0)  # bounded


def test_unknown_provenance_is_pinned_by_the_first_valid_shard(tmp_path):
    partial = Expectation(aux_layer_ids=AUX, hidden_size=H, num_layers=8, model_hash="mh", tokenizer_hash="th",
                          chat_template_hash="ch")
    a, b, c = sample("a"), sample("b"), sample("c")
    res = check(tmp_path, [(a, shard_bytes(a, p=prov(engine="sglang"))), (b, shard_bytes(b, p=prov(model_hash="x"))),
                           (c, shard_bytes(c, p=prov(engine="sglang", dtype="float16")))], expect=partial)
    assert res.pinned == prov(engine="sglang")
    assert [e.sample_id for e in res.entries] == ["a"]
    assert {i.sample_id: i.kind for i in res.invalid} == {"b": "provenance", "c": "provenance"}


def test_shard_in_a_server_capture_dir_is_moved_into_the_extraction(tmp_path):
    s = sample("remote")
    server_dir = tmp_path / "server-capture"
    server_dir.mkdir()
    (server_dir / contract.shard_filename("remote")).write_bytes(shard_bytes(s))
    res = validate_batch([s], extraction_dir=tmp_path / "x", expect=EXPECT, server_capture_dirs=[server_dir],
                         config=ValidateConfig(shard_wait_s=0))
    assert res.entries and (tmp_path / "x" / "capture" / "remote.safetensors").is_file()
    assert not (server_dir / "remote.safetensors").exists()


def test_argmax_agreement_on_regenerated_assistant_spans(tmp_path):
    g = torch.Generator().manual_seed(0)
    lm_head = torch.eye(H) + 0.01 * torch.randn(H, H, generator=g)  # [V, H]: row v scores token v
    s = sample("regen", t=8, regenerated=True)
    ids = torch.tensor(s.input_ids.tolist())
    final = torch.zeros(8, H)
    final[:-1] = lm_head[ids[1:]]  # final[t] predicts token t + 1
    final[4] = lm_head[0]  # one wrong prediction inside the loss span
    hits, n = argmax_agreement(final.to(torch.bfloat16), ids, s.loss_spans, lm_head)
    assert (hits, n) == (5, 6)  # tokens 2..7 are in the span [2, 8): predicted from positions 1..6
    res = check(tmp_path, [(s, shard_bytes(s, final=final))], lm_head=lm_head)
    assert res.entries[0].stats["argmax_agreement"] == round(5 / 6, 4)
    strict = ValidateConfig(shard_wait_s=0, min_argmax_agreement=0.9)
    res = check(tmp_path, [(s, shard_bytes(s, final=final))], lm_head=lm_head, config=strict)
    assert res.invalid[0].kind == "argmax"


def test_argmax_of_many_samples_in_one_pass_equals_each_alone():
    """The batched check (one copy to the LM head's device per group of rows) counts what each sample alone does,
    whatever the grouping; a sample without loss positions counts (0, 0)."""
    g = torch.Generator().manual_seed(1)
    lm_head = torch.randn(40, H, generator=g)  # [V, H]
    items = []
    for t, spans in ((9, ((2, 9),)), (5, ()), (12, ((1, 4), (6, 12))), (3, ((0, 3),))):
        ids = torch.randint(0, 40, (t,), generator=g)
        final = torch.randn(t, H, generator=g).to(torch.bfloat16)
        final[: t // 2] = lm_head[ids[1 : t // 2 + 1]].to(torch.bfloat16)  # the first half predicts its next token
        items.append((final, ids, spans))
    alone = [argmax_agreement(*item, lm_head) for item in items]
    assert alone[1] == (0, 0) and all(n > 0 for _, n in alone[:1] + alone[2:]) and any(0 < h < n for h, n in alone)
    for group_rows, chunk in ((1 << 16, 1024), (4, 3), (1, 1)):
        assert argmax_agreements(items, lm_head, chunk=chunk, group_rows=group_rows) == alone


def test_validation_checks_the_argmax_group_by_group_as_the_pool_checks_on(tmp_path, monkeypatch):
    """The argmax of checked regenerated samples runs in groups while the pool checks the rest: every sample gets
    the agreement it gets alone, and one below the floor is refused, whichever group it falls in."""
    import eaglenest.extraction.validate as v

    monkeypatch.setattr(v, "ARGMAX_GROUP_ROWS", 7)  # 6 positions per sample: a group every 2 samples
    g = torch.Generator().manual_seed(2)
    lm_head = torch.eye(H) + 0.01 * torch.randn(H, H, generator=g)
    items, expected = [], {}
    for i in range(7):
        s = sample(f"r{i}x" + "y" * i, t=8, regenerated=i != 3)  # one plain capture among them
        ids = torch.tensor(s.input_ids.tolist())
        final = torch.zeros(8, H)
        final[:-1] = lm_head[ids[1:]]
        final[2 : 2 + i % 3] = lm_head[0]  # 0, 1 or 2 wrong predictions
        items.append((s, shard_bytes(s, final=final)))
        if s.regenerated:
            expected[s.sample_id] = round(argmax_agreement(final.to(torch.bfloat16), ids, s.loss_spans, lm_head)[0]
                                          / 6, 4)
    res = check(tmp_path, items, lm_head=lm_head, config=ValidateConfig(shard_wait_s=0, min_argmax_agreement=0.7))
    got = {e.sample_id: e.stats.get("argmax_agreement") for e in res.entries}
    refused = {x.sample_id for x in res.invalid}
    assert refused == {sid for sid, a in expected.items() if a < 0.7} and refused
    assert got == {**{sid: a for sid, a in expected.items() if a >= 0.7}, "r3xyyy": None}


def test_norm_outliers_are_flagged_not_rejected(tmp_path):
    items = [(s, shard_bytes(s)) for s in (sample(f"n{i}") for i in range(6))]
    odd = sample("loud")
    items.append((odd, shard_bytes(odd, scale=50.0)))
    res = check(tmp_path, items)
    assert len(res.entries) == 7 and res.outliers == 1
    flagged = {e.sample_id: e.stats.get("outliers") for e in res.entries if e.stats.get("outliers")}
    assert flagged == {"loud": [0, 1, 2]}


def test_hidden_checks_norms_equal_the_float64_reference_and_find_every_nonfinite_value():
    """The per-layer mean token norms of the stats (bf16 bits squared in a reused float32 buffer) and the
    non-finite check that rides on them: a NaN/Inf anywhere is found with its place; a finite value whose square
    overflows float32 is no error, and its norms come out right."""
    import numpy as np

    from eaglenest.extraction.validate import InvalidShard, _bits, _hidden_checks
    from eaglenest.testing.fake_store import fake_shard

    p = prov(aux_layer_ids=(1, 2, 3), hidden_size=24)

    def reference(sh):
        t = sh.num_tokens
        aux = sh.aux_hidden.double().view(t, 3, 24).norm(dim=-1).mean(0).tolist()
        return [*aux, sh.final_hidden.double().norm(dim=-1).mean().item()]

    for seed, t in ((0, 37), (1, 5), (2, 300)):  # the buffer is reused across shapes and grown
        sh = fake_shard("s", t, p, seed=seed)
        before = _bits(sh.aux_hidden).copy()
        assert _hidden_checks(sh) == pytest.approx(reference(sh), rel=1e-5)
        assert np.array_equal(_bits(sh.aux_hidden), before)  # the shard's own buffer is not touched
    big = fake_shard("s", 9, p, seed=3)
    big.aux_hidden[4, 30] = 3e30  # finite in bf16, its square is not in float32
    assert _hidden_checks(big) == pytest.approx(reference(big), rel=1e-5)
    for name, where, value in (("aux_hidden", (7, 50), float("nan")), ("final_hidden", (2, 3), float("-inf"))):
        bad = fake_shard("s", 9, p, seed=4)
        getattr(bad, name)[where] = value
        with pytest.raises(InvalidShard, match=rf"non-finite value in {name} at \[token {where[0]}, col {where[1]}\]"):
            _hidden_checks(bad)
