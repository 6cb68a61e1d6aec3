"""The per-rank plan: equal batches on every rank, nothing lost, reproducible, resumable."""

from __future__ import annotations

import numpy as np
import pytest

from fastdata.read.plan import (
    epoch_order,
    num_batches,
    rank_batches,
    rank_span,
    worker_batch_numbers,
)

SIZES = [64, 64, 64, 64, 44]  # 300 samples, a short last shard


def _ids(refs: np.ndarray) -> list[int]:
    offsets = np.cumsum([0, *SIZES])
    return [int(offsets[s] + i) for s, i in refs]


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_the_same_number_of_batches_and_the_union_is_whole(world, drop_last):
    order = epoch_order(SIZES, seed=3, epoch=0, shuffle=True)
    spans = [rank_span(order, r, world) for r in range(world)]
    batches = [rank_batches(span, 32, drop_last) for span in spans]
    assert len({len(b) for b in batches}) == 1
    assert len(batches[0]) == num_batches(300, world, 32, drop_last)
    if not drop_last:
        seen = [i for b in batches for batch in b for i in _ids(batch)]
        assert set(seen) == set(range(300))
        assert len(seen) - 300 <= world - 1  # padding by wrapping is at most world - 1 samples


def test_order_depends_on_seed_and_epoch_only():
    a = epoch_order(SIZES, seed=1, epoch=0, shuffle=True)
    assert np.array_equal(a, epoch_order(SIZES, seed=1, epoch=0, shuffle=True))
    assert not np.array_equal(a, epoch_order(SIZES, seed=1, epoch=1, shuffle=True))
    assert not np.array_equal(a, epoch_order(SIZES, seed=2, epoch=0, shuffle=True))
    assert sorted(_ids(a)) == list(range(300))
    assert _ids(epoch_order(SIZES, seed=1, epoch=0, shuffle=False)) == list(range(300))


def test_workers_partition_the_batches_and_resume_skips_exactly():
    for start in (0, 3):
        numbers = [n for w in range(3) for n in worker_batch_numbers(10, start, w, 3)]
        assert sorted(numbers) == list(range(start, 10))
    assert list(worker_batch_numbers(10, 0, 0, 0)) == list(range(10))


def test_bad_rank_and_batch_size_are_refused():
    with pytest.raises(ValueError, match="rank"):
        rank_span(epoch_order(SIZES, 0, 0, False), 2, 2)
    with pytest.raises(ValueError, match="batch_size"):
        num_batches(10, 1, 0, False)
