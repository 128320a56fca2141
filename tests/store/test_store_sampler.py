"""LengthBucketSampler (budget, determinism, exact resume, rank split), StoreDataset and splits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from eaglenest.store import LengthBucketSampler, StoreDataset, convert, open_store, split_indices
from eaglenest.testing.fake_store import make_extraction

LENGTHS = np.random.default_rng(0).integers(1, 300, size=500).tolist()


def epoch(sampler, e):
    sampler.set_epoch(e)
    return list(sampler)


def test_batches_cover_every_sample_once_under_the_token_budget():
    lengths = [*LENGTHS, 1000]  # one longer than the budget travels alone
    s = LengthBucketSampler(lengths, max_tokens=1024, seed=3, pool_size=64)
    batches = epoch(s, 0)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 1024 or len(b) == 1
    assert len(s) == len(batches)
    sizes = [len(b) for b in batches]
    assert max(sizes) > 3 * min(sizes)  # short samples are packed densely


def test_deterministic_per_seed_and_epoch():
    a = LengthBucketSampler(LENGTHS, max_tokens=2048, seed=1)
    b = LengthBucketSampler(LENGTHS, max_tokens=2048, seed=1)
    assert epoch(a, 0) == epoch(b, 0) and epoch(a, 1) == epoch(b, 1)
    assert epoch(a, 0) != epoch(a, 1)
    assert epoch(a, 2) != epoch(LengthBucketSampler(LENGTHS, max_tokens=2048, seed=2), 2)
    ordered = list(LengthBucketSampler(LENGTHS, max_tokens=2048, shuffle=False))
    flat = [LENGTHS[i] for b in ordered for i in b]
    assert flat == sorted(flat)


@pytest.mark.parametrize("cut", [0, 1, 7, 20])
def test_resume_continues_with_exactly_the_next_batch(cut):
    full = LengthBucketSampler(LENGTHS, max_tokens=1500, seed=9)
    full.set_epoch(2)
    expected = list(full)

    first = LengthBucketSampler(LENGTHS, max_tokens=1500, seed=9)
    first.set_epoch(2)
    got = list(itertools.islice(iter(first), cut))
    state = first.state_dict()
    resumed = LengthBucketSampler(LENGTHS, max_tokens=1500, seed=9)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # a trainer calls set_epoch again at the start of the resumed epoch
    got += list(resumed)
    assert got == expected
    assert resumed.state_dict()["position"] == len(resumed)  # the state says: epoch 2 finished
    assert list(resumed) == expected  # iterating a finished epoch again starts it over
    resumed.set_epoch(3)
    assert list(resumed) == epoch(full, 3)


def test_state_with_consumed_count_and_changed_config_refused():
    s = LengthBucketSampler(LENGTHS, max_tokens=1500, seed=9)
    it = iter(s)
    batches = [next(it) for _ in range(5)]  # a prefetching loader pulled 5, the trainer used 3
    r = LengthBucketSampler(LENGTHS, max_tokens=1500, seed=9)
    r.load_state_dict(s.state_dict(consumed=3))
    assert next(iter(r)) == batches[3]
    with pytest.raises(ValueError, match="max_tokens"):
        LengthBucketSampler(LENGTHS, max_tokens=1000, seed=9).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed"):
        LengthBucketSampler(LENGTHS, max_tokens=1500, seed=8).load_state_dict(s.state_dict())


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_split_one_batch_list_evenly(drop_last):
    ws = 3
    ranks = [LengthBucketSampler(LENGTHS, max_tokens=1200, seed=4, rank=r, world_size=ws, drop_last=drop_last)
             for r in range(ws)]
    per_rank = [epoch(s, 1) for s in ranks]
    assert len({len(p) for p in per_rank}) == 1 and all(len(s) == len(per_rank[0]) for s in ranks)
    all_batches = LengthBucketSampler(LENGTHS, max_tokens=1200, seed=4).epoch_batches(1)
    interleaved = [b for group in zip(*per_rank, strict=True) for b in group]
    n = len(all_batches)
    if drop_last:
        assert interleaved == all_batches[: n - n % ws]
    else:
        assert interleaved[:n] == all_batches and len(interleaved) == -(-n // ws) * ws
    with pytest.raises(ValueError, match="rank"):
        LengthBucketSampler(LENGTHS, max_tokens=10, rank=3, world_size=3)


def test_split_is_stable_by_id_and_dataset_reads_the_store(tmp_path):
    ids = [f"id{i}" for i in range(2000)]
    train, held = split_indices(ids, 0.05)
    assert sorted(train + held) == list(range(2000)) and 60 <= len(held) <= 140
    train2, held2 = split_indices(ids + [f"new{i}" for i in range(100)], 0.05)
    assert set(held) <= set(held2) and set(train) <= set(train2)  # growing never moves a sample

    make_extraction(tmp_path / "ex", [5, 50, 7, 30, 12])
    convert(tmp_path / "ex", str(tmp_path / "store"))
    store = open_store(str(tmp_path / "store"))
    ds = StoreDataset(store, [4, 1, 2])
    assert len(ds) == 3 and ds[1].sample_id == store.sample_ids[1] and ds.lengths.tolist() == [12, 50, 7]
    assert [s.sample_id for s in ds.__getitems__([2, 0])] == [store.sample_ids[2], store.sample_ids[4]]
    sampler = LengthBucketSampler(ds.lengths, max_tokens=64, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=list)
    seen = sorted(s.sample_id for batch in loader for s in batch)
    assert seen == sorted(store.sample_ids[i] for i in (4, 1, 2))
