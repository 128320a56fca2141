"""Drafter data: the batch stream resumes exactly (also across epochs) with the store's sampler contract."""

from __future__ import annotations

import importlib.util

import pytest

from eaglenest.drafter import data
from eaglenest.drafter.data import BatchStream, held_out, split_indices
from eaglenest.drafter.fallback_store import LengthBucketSampler as FallbackSampler

SAMPLERS = [FallbackSampler]
if importlib.util.find_spec("eaglenest.store") is not None:  # after the merge: the real store's sampler too
    from eaglenest.store import LengthBucketSampler as StoreSampler

    SAMPLERS.append(StoreSampler)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: s.__module__)
def test_batch_stream_resumes_exactly_across_epochs(monkeypatch, sampler):
    monkeypatch.setattr(data, "LengthBucketSampler", sampler)
    lengths = [(i * 37) % 50 + 5 for i in range(60)]
    ref = BatchStream(lengths, max_tokens=120, seed=7)
    per_epoch = ref.batches_per_epoch()
    expected = ref.take(3 * per_epoch + 2)
    assert sorted(i for b in expected[:per_epoch] for i in b) == list(range(60))  # an epoch covers all samples
    assert expected[:per_epoch] != expected[per_epoch : 2 * per_epoch]  # reshuffled per epoch
    for cut in (1, per_epoch - 1, per_epoch, per_epoch + 3):
        a = BatchStream(lengths, max_tokens=120, seed=7)
        head = a.take(cut)
        b = BatchStream(lengths, max_tokens=120, seed=7)
        b.load_state_dict(a.state_dict())
        assert head + b.take(len(expected) - cut) == expected, cut


def test_held_out_split_is_stable_and_capped():
    ids = [f"s{i}" for i in range(1000)]
    train, evals = split_indices(ids, 0.1)
    assert 60 < len(evals) < 140 and sorted(train + evals) == list(range(1000))
    assert [held_out(ids[i], 0.1) for i in evals] == [True] * len(evals)
    shuffled = list(reversed(ids))  # membership depends on the id, not its position
    _, ev2 = split_indices(shuffled, 0.1)
    assert sorted(shuffled[i] for i in ev2) == sorted(ids[i] for i in evals)
    train3, ev3 = split_indices(ids, 0.1, max_eval=10)
    assert len(ev3) == 10 and len(train3) == 990
