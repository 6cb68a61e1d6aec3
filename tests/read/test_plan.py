"""The epoch plan: order, interleaved consumption, padding, drop_last, seeds, elastic resume."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fastdata.read.plan import (
    PAD_LABEL,
    EpochMix,
    PlanConfig,
    batch_seed,
    epoch_order,
    mixed_order,
    plan_epoch,
    rows_to_refs,
    worker_batch_numbers,
)

SIZES = [5, 7, 3, 9]  # 24 samples in 4 shards


def make_plan(sizes, *, epoch, consumed=0, steps_before=0, **config):
    """`plan_epoch` with the `PlanConfig` fields as keywords."""
    return plan_epoch(sizes, PlanConfig(**config), epoch, consumed, steps_before)


def _plan(rank=0, world=1, batch=4, **kw):
    kw.setdefault("shuffle", True)
    return make_plan(SIZES, seed=3, epoch=1, rank=rank, world_size=world, batch_size=batch, **kw)


def _rows(plan):
    return [int(r) for b in plan.rows for r in b]


def test_epoch_order_is_a_permutation_with_shards_kept_together():
    order = epoch_order(SIZES, seed=3, epoch=1, shuffle=True)
    assert sorted(order.tolist()) == list(range(24))
    shards = rows_to_refs(order, SIZES)[:, 0]
    assert len([s for i, s in enumerate(shards) if i == 0 or s != shards[i - 1]]) == len(SIZES)
    assert not np.array_equal(order, epoch_order(SIZES, seed=3, epoch=2, shuffle=True))
    assert epoch_order(SIZES, 3, 1, shuffle=False).tolist() == list(range(24))


def test_rows_to_refs():
    assert rows_to_refs(np.array([0, 4, 5, 11, 12, 15, 23]), SIZES).tolist() == [
        [0, 0], [0, 4], [1, 0], [1, 6], [2, 0], [3, 0], [3, 8],
    ]  # fmt: skip


@pytest.mark.parametrize("world,batch", [(1, 4), (2, 4), (3, 5), (5, 2), (7, 3)])
def test_ranks_cover_the_epoch_once_with_equal_batches(world, batch):
    plans = [_plan(r, world, batch) for r in range(world)]
    assert len({len(p) for p in plans}) == 1  # no rank waits at epoch end
    counts = Counter(r for p in plans for r in _rows(p))
    assert set(counts) == set(range(24))
    assert sum(counts.values()) - 24 == (-24) % world  # at most world - 1 repeats
    for b in range(len(plans[0].rows)):  # each step's batches have one size on every rank
        assert len({len(p.rows[b]) for p in plans}) == 1


def test_consumption_is_a_prefix_of_the_order():
    order = epoch_order(SIZES, 3, 1, shuffle=True)
    plans = [_plan(r, 2, 4) for r in range(2)]
    taken = [int(r) for b in range(2) for p in plans for r in p.rows[b]]
    assert taken == order[:16].tolist()
    assert plans[0].consumed_after(2) == 16


@pytest.mark.parametrize("before,after", [((2, 10), (1, 20)), ((1, 20), (2, 10)), ((3, 4), (2, 7))])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_elastic_resume_continues_with_exactly_the_rest(before, after, k):
    (w0, b0), (w1, b1) = before, after
    sizes = [40, 17, 30]  # 87 samples
    first = [
        make_plan(sizes, seed=1, epoch=0, rank=r, world_size=w0, batch_size=b0, shuffle=True)
        for r in range(w0)
    ]
    done = [int(x) for p in first for b in p.rows[:k] for x in b]
    consumed = first[0].consumed_after(k)
    rest = [
        make_plan(sizes, seed=1, epoch=0, rank=r, world_size=w1, batch_size=b1, shuffle=True,
                   consumed=consumed, steps_before=k)
        for r in range(w1)
    ]  # fmt: skip
    resumed = [int(x) for p in rest for b in p.rows for x in b]
    counts = Counter(done + resumed)
    assert set(counts) == set(range(87))
    repeats = sum(counts.values()) - 87
    assert repeats == (-(87 - consumed)) % w1  # only the padding rule's repeats
    assert all(len(p) == k + len(p.rows) for p in rest)


def test_drop_last_drops_the_short_step_on_every_rank():
    plans = [_plan(r, 2, 5, drop_last=True) for r in range(2)]
    assert [len(p) for p in plans] == [2, 2]  # 24 = 2 steps of 10 + a short one of 4
    assert all(len(b) == 5 for p in plans for b in p.rows)


def test_eval_padding_is_marked():
    plans = [_plan(r, 5, 4, shuffle=False) for r in range(5)]
    pads = np.concatenate([pad for p in plans for pad in p.padding])
    assert pads.sum() == 1  # 24 samples on 5 ranks: one padding sample
    assert PAD_LABEL == -100


def test_seeds_follow_positions_not_ranks():
    one = _plan(0, 1, 4)
    two = [_plan(r, 2, 4) for r in range(2)]
    assert one.seeds[0] == two[0].seeds[0] == batch_seed(3, 1, 0)
    assert two[1].seeds[0] == one.seeds[1]  # the batch at position 4 of the order
    assert len(set(one.seeds)) == len(one.seeds)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="batch_size"):
        _plan(batch=0)
    with pytest.raises(ValueError, match="rank"):
        _plan(rank=2, world=2)
    with pytest.raises(ValueError, match="consumed"):
        _plan(consumed=25)


def test_worker_batches_interleave():
    assert list(worker_batch_numbers(7, 0, 1, 3)) == [1, 4]
    assert list(worker_batch_numbers(7, 2, 0, 2)) == [2, 4, 6]


# ---- rule 0: a mix of datasets (SIZES = dataset 0: shards 0-1, 12 rows; dataset 1: shards 2-3, 12)

MIX = EpochMix(shards=(2, 2), samples=(30, 5))  # dataset 0 up-sampled 2.5x, dataset 1 down


def test_mixed_order_draws_exact_counts_copies_and_fresh_subsets():
    order = mixed_order(SIZES, MIX, seed=3, epoch=1)
    counts = Counter(order.tolist())
    assert len(order) == 35 and sum(counts[r] for r in range(12)) == 30
    assert sorted(Counter(counts[r] for r in range(12)).items()) == [(2, 6), (3, 6)]
    ones = sorted(r for r in counts if r >= 12)
    assert len(ones) == 5 and all(counts[r] == 1 for r in ones)  # a subset, each once
    assert np.array_equal(order, mixed_order(SIZES, MIX, seed=3, epoch=1))
    other = mixed_order(SIZES, MIX, seed=3, epoch=2)
    assert sorted(r for r in set(other.tolist()) if r >= 12) != ones  # another subset
    dataset0 = [r for r in order.tolist() if r < 12][:12]  # its first copy: rule 1's order
    shards = rows_to_refs(np.array(dataset0), SIZES)[:, 0]
    assert sorted(dataset0) == list(range(12)) and np.count_nonzero(np.diff(shards)) == 1


def test_mixed_order_interleaves_the_datasets():
    mix = EpochMix(shards=(2, 2), samples=(120, 120))
    owner = mixed_order(SIZES, mix, seed=0, epoch=0) >= 12
    halves = owner[:120].sum(), owner[120:].sum()
    assert 40 < halves[0] < 80 and 40 < halves[1] < 80  # not one dataset after the other


@pytest.mark.parametrize("k", [0, 2, 3])
def test_a_mixed_epoch_resumes_elastically_on_the_plan(k):
    args = dict(seed=3, epoch=1, shuffle=True, mix=MIX)
    order = mixed_order(SIZES, MIX, seed=3, epoch=1).tolist()
    first = [make_plan(SIZES, rank=r, world_size=2, batch_size=3, **args) for r in range(2)]
    done = [int(x) for p in first for b in p.rows[:k] for x in b]
    consumed = first[0].consumed_after(k)
    assert sorted(done) == sorted(order[:consumed])
    rest = make_plan(SIZES, rank=0, world_size=1, batch_size=6, consumed=consumed, **args)
    assert Counter(done + _rows(rest)) == Counter(order)
    assert rest.total == 35


def test_a_mix_applies_to_training_only_and_must_name_every_shard():
    evaluation = make_plan(SIZES, seed=3, epoch=1, rank=0, world_size=1, batch_size=50,
                            shuffle=False, mix=MIX)  # fmt: skip
    assert _rows(evaluation) == list(range(24))
    with pytest.raises(ValueError, match="the mix names 3 shards"):
        mixed_order(SIZES, EpochMix((1, 2), (3, 3)), seed=0, epoch=0)
    with pytest.raises(ValueError, match="one sample count per dataset"):
        EpochMix((2, 2), (3,))


def test_a_loader_spec_keeps_its_last_plan_but_never_pickles_it(tiny_shards):
    import pickle

    from fastdata.format.manifest_io import load_manifest
    from fastdata.read.base import LoaderSpec

    spec = LoaderSpec(load_manifest(tiny_shards), "train", train=True, batch_size=8, seed=2)
    plan = spec.plan(1, 16, 2)
    assert spec.plan(1, 16, 2) is plan and spec.plan(1, 24, 3) is not plan
    copy = pickle.loads(pickle.dumps(spec))
    assert "_last_plan" not in copy.__dict__ and copy == spec
    assert _rows(copy.plan(1, 24, 3)) == _rows(spec.plan(1, 24, 3))
