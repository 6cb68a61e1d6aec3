"""The training shuffles of plan rule 1 (`fastdata.read.shuffle`): "window" and "full" keep every
rule of the plan (each sample once, resume, elastic resume, determinism), the window bounds the
shards a step reads, and class-ordered shards still give mixed batches. (~3 s)"""

from __future__ import annotations

import numpy as np
import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.read import shardio
from fastdata.read.plan import EpochMix, PlanConfig, epoch_order, plan_epoch, rows_to_refs
from fastdata.read.resume import ResumeError, ResumeState
from fastdata.read.shardio import ShardReader, open_limit
from fastdata.read.shuffle import check_shuffle, node_window, shuffle_rows, size_window

SIZES = [37, 50, 50, 13, 50, 49, 50, 1, 50, 50]  # uneven, one single-sample shard
MODES = [("window", 1), ("window", 20), ("window", 64), ("window", 10_000), ("full", None)]


def _config(mode, window, rank=0, world=1, batch=8, **kw) -> PlanConfig:
    return PlanConfig(
        seed=3, rank=rank, world_size=world, batch_size=batch, shuffle=True,
        shuffle_mode=mode, window=window, **kw,
    )  # fmt: skip


def _taken(config_of, world, epoch, consumed=0, steps=None):
    """Rows every rank takes from `consumed` on, ranks interleaved step by step."""
    plans = [plan_epoch(SIZES, config_of(r, world), epoch, consumed) for r in range(world)]
    steps = len(plans[0].rows) if steps is None else steps
    return [row for s in range(steps) for p in plans for row in p.rows[s].tolist()]


@pytest.mark.parametrize(("mode", "window"), MODES)
def test_every_sample_once_per_epoch(mode, window):
    for epoch in range(3):
        order = epoch_order(SIZES, 3, epoch, True, (), mode, window)
        assert sorted(order.tolist()) == list(range(sum(SIZES)))
        rows = _taken(lambda r, w: _config(mode, window, r, w), 1, epoch)
        assert sorted(rows) == list(range(sum(SIZES)))


@pytest.mark.parametrize(("mode", "window"), MODES)
def test_resumed_and_elastic_epochs_yield_every_sample_once(mode, window):
    total = sum(SIZES)

    # Resume on the same world: 5 steps of 2 ranks x 8, then the rest from consumed = 80.
    def two(r, w):
        return _config(mode, window, r, w, batch=8)

    first = _taken(two, 2, 1, steps=5)
    rest = _taken(two, 2, 1, consumed=len(first))
    assert sorted(first + rest) == list(range(total))
    # Elastic: 2 ranks x 8 for 5 steps, then 1 rank x 12 (another world and batch size).
    later = _taken(lambda r, w: _config(mode, window, r, w, batch=12), 1, 1, consumed=len(first))
    assert sorted(first + later) == list(range(total))
    assert first + later == epoch_order(SIZES, 3, 1, True, (), mode, window).tolist()


def test_orders_are_deterministic_and_change_with_epoch_seed_and_window():
    def order(seed=3, epoch=0, mode="window", window=40):
        return epoch_order(SIZES, seed, epoch, True, (), mode, window).tolist()

    assert order() == order()
    assert order(epoch=1) != order()
    assert order(seed=4) != order()
    assert order(window=41) != order()
    assert order(mode="full", window=None) != order()
    # "shard" is exactly the order the plan always made (the shard-by-shard order).
    assert order(mode="shard", window=None) == epoch_order(SIZES, 3, 0, True).tolist()


@pytest.mark.parametrize("window", [1, 7, 25, 64, 200])
def test_window_bounds_each_samples_move_and_each_steps_shards(window):
    base = epoch_order(SIZES, 3, 2, True, (), "shard")
    order = epoch_order(SIZES, 3, 2, True, (), "window", window)
    where = {row: i for i, row in enumerate(base.tolist())}
    moves = np.array([abs(where[row] - i) for i, row in enumerate(order.tolist())])
    assert moves.max() < window
    shard_of = rows_to_refs(base, SIZES)[:, 0]
    step = 16
    for lo in range(0, len(order), step):
        hi = min(lo + step, len(order))
        read = set(rows_to_refs(order[lo:hi], SIZES)[:, 0].tolist())
        reach = set(shard_of[max(0, lo - window + 1) : hi + window - 1].tolist())
        assert read <= reach  # only the shards within a window of the step
    if window >= 200:  # blocks span several shards: a step reads more than one or two
        spans = [
            len(set(rows_to_refs(order[i : i + step], SIZES)[:, 0])) for i in range(0, 400, step)
        ]
        assert np.mean(spans) > 2.5


def test_full_permutation_is_not_bounded():
    """The bound above can fail: a full permutation moves samples across the whole split."""
    base = epoch_order(SIZES, 3, 2, True, (), "shard").tolist()
    order = epoch_order(SIZES, 3, 2, True, (), "full").tolist()
    where = {row: i for i, row in enumerate(base)}
    assert max(abs(where[row] - i) for i, row in enumerate(order)) > 200


def _distinct_labels(order: np.ndarray, labels: np.ndarray, batch: int = 64) -> float:
    whole = len(order) // batch * batch
    return float(np.mean([len(set(labels[order[i : i + batch]])) for i in range(0, whole, batch)]))


def test_class_ordered_shards_give_mixed_batches():
    """100 shards of 100 written in class order (10 classes of 10 shards): a window of half the
    split gives nearly a full permutation's classes per batch of 64 (a window of the whole
    split, as the node-sized default gives a split that fits, is a full permutation); the shard
    order gives one or two."""
    sizes = [100] * 100
    labels = np.repeat(np.arange(10), 1000)
    per = {
        name: np.mean([
            _distinct_labels(epoch_order(sizes, 0, e, True, (), mode, window), labels)
            for e in range(3)
        ])
        for name, mode, window in (
            ("shard", "shard", None), ("window", "window", 5000), ("full", "full", None)
        )
    }  # fmt: skip
    assert per["full"] > 9.9
    assert per["window"] >= 0.9 * per["full"]
    assert per["shard"] < 0.3 * per["full"]


def test_a_mix_is_shuffled_by_the_window_in_each_dataset():
    mix = EpochMix(shards=(4, 6), samples=(150, 300))
    config = _config("window", 30, batch=10, mix=mix)
    rows = [r for b in plan_epoch(SIZES, config, 0).rows for r in b.tolist()]
    assert len(rows) == 450
    assert rows != [
        r
        for b in plan_epoch(SIZES, _config("shard", None, batch=10, mix=mix), 0).rows
        for r in b.tolist()
    ]
    first = sum(SIZES[:4])
    assert sum(r < first for r in rows) == 150  # each dataset's share is kept


def test_size_window_from_memory_cache_and_backend():
    sizes, nbytes = [100] * 50, [100 * 1000] * 50  # 1000 bytes per sample, 5000 samples

    def size(available, **kw):
        return size_window(sizes, nbytes, available, **({"open_shards": None} | kw))

    assert size(10_000_000, share=0.2) == 2000  # local: a share of the free memory
    # Never below a shard (the shard order's reach), never above the split.
    assert size(1000) == 100
    assert size(10**12) == 5000
    # Remote: the cache limit bounds it (and the free memory still does).
    assert size(10**12, cache_limit=1_000_000, share=0.2) == 200
    # The memory backend holds the split: the whole split (a full permutation).
    assert size(1000, resident=True) == 5000


def test_size_window_keeps_a_steps_shards_open_in_one_reader():
    """More shards than a reader keeps open: blocks of at most (open / 2 - 1) shards, so the
    two blocks a step touches stay open; a split whose shards all stay open is not bounded."""
    many, few = [100] * 50, [100] * 8
    assert size_window(many, [10**5] * 50, 10**12, open_shards=8) == 300  # 8 open: 3 shards
    assert size_window(many, [10**5] * 50, 10**12, open_shards=2) == 100  # remote: 2 pinned
    assert size_window(many, [10**5] * 50, 10**12, open_shards=50) == 5000  # all open
    assert size_window(few, [10**5] * 8, 10**12, open_shards=8) == 800


def test_a_reader_keeps_every_local_shard_of_the_split_open(tmp_path, monkeypatch):
    """Class-ordered foreign splits need a window over all their shards: the reader keeps them
    all open (up to LOCAL_OPEN_LIMIT), so the default window is the split's, not 3 shards'
    (a reader kept 8 open: a split of 19 shards got a window of 48 samples)."""
    from fastdata.write import ShardOptions, write_shards
    from tests.conftest import unique_label_source

    root = tmp_path / "many"
    write_shards(unique_label_source(), root, ShardOptions(max_count=16, workers=1, progress=False))
    manifest = load_manifest(root)
    shards = len(manifest.split("train").shards)
    assert shards == 19 and open_limit(manifest, "train") == shards
    reader = ShardReader(manifest, "train")
    assert reader.max_open == shards
    for number in range(shards):  # every shard read once: none closed
        reader.key(number, 0)
    assert len(reader._open) == shards
    reader.close()
    assert node_window(manifest, "train") == 300  # the whole split, with free memory to spare
    # Past the limit, the window shrinks to what stays open.
    monkeypatch.setattr(shardio, "LOCAL_OPEN_LIMIT", 2)
    assert open_limit(manifest, "train") == 2
    assert node_window(manifest, "train") == 16  # never below a shard


def test_shuffle_option_is_checked():
    assert check_shuffle("window") == ("window", None)
    assert check_shuffle(512) == ("window", 512)
    assert check_shuffle("shard") == ("shard", None)
    for bad, error in (
        ("random", ValueError),
        (0, ValueError),
        (True, TypeError),
        (1.5, TypeError),
    ):
        with pytest.raises(error, match="shuffle"):
            check_shuffle(bad)
    with pytest.raises(ValueError, match="shuffle_mode"):
        _config("blocks", None)
    with pytest.raises(ValueError, match="at least 1"):
        _config("window", 0)


def test_shuffle_rows_window_of_two_moves_by_at_most_one():
    base = np.arange(1000)
    out = shuffle_rows(base, "window", 2, np.random.default_rng(0))
    assert np.abs(out - base).max() <= 1 and (out != base).any()


def test_resume_state_records_and_checks_the_shuffle():
    fields = dict(epoch=1, consumed=16, steps=2, seed=0, world_size=1, batch_size=8,
                  num_samples=400, dataset="0123456789abcdef")  # fmt: skip
    state = ResumeState(**fields, shuffle="window:123")
    back = ResumeState.from_dict(state.to_dict())
    assert back == state
    assert back.resumed_window("window", None) == 123  # the node's size is not measured again
    assert back.resumed_window("window", 123) == 123
    for mode, window in (("window", 99), ("shard", None), ("full", None)):
        with pytest.raises(ResumeError, match="shuffle"):
            back.resumed_window(mode, window)
    # A state from before shuffles were recorded: nothing to check, nothing imposed.
    old = ResumeState.from_dict({k: v for k, v in state.to_dict().items() if k != "shuffle"})
    assert old.shuffle == "" and old.resumed_window("window", None) is None
    with pytest.raises(ResumeError, match="'shuffle'"):
        ResumeState.from_dict({**state.to_dict(), "shuffle": "window:0"})
