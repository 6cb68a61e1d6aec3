"""Mixed datasets (`fastdata.read.mix`): weighted epochs on the plan, exact resume, merged classes.

Two tiny datasets whose every sample is its own class ("a<i>" / "b<i>"), so after the merge by
name (first-seen order) a label names a sample: labels < N_A are dataset A's sample ids, the rest
are N_A + dataset B's. With weights 3:1 and the default epoch size N_A + N_B = 160, each epoch
draws 120 of A (two whole copies: up-sampling) and 40 of B (a subset: down-sampling).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from hashlib import sha256
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata import ShardDataModule, ShardSet, WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.read import BACKENDS
from fastdata.read.mix import epoch_mix, map_row_labels, mix_manifests, mix_roots, share_counts
from fastdata.read.resume import ResumeError
from fastdata.read.schedule import Schedule, ScheduledMix
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.arrays import ArraySource

N_A, N_B = 60, 100
CPU = torch.device("cpu")
LOCAL = ["cpu", "memory"] + (["dali"] if BACKENDS["dali"].check()[0] else [])


def _write(out: Path, prefix: str, n_train: int, n_test: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    splits = {
        "train": (rng.integers(0, 256, (n_train, 4, 4, 3), dtype=np.uint8), np.arange(n_train)),
        "test": (rng.integers(0, 256, (n_test, 4, 4, 3), dtype=np.uint8), np.arange(n_test)),
    }
    classes = [f"{prefix}{i}" for i in range(max(n_train, n_test))]
    options = ShardOptions(max_count=16, workers=1, progress=False)
    write_shards(ArraySource(splits, classes), out, options)
    return out


@pytest.fixture(scope="module")
def two_roots(tmp_path_factory) -> list[Path]:
    base = tmp_path_factory.mktemp("mix")
    return [_write(base / "a", "a", N_A, 10, 1), _write(base / "b", "b", N_B, 10, 2)]


def _weighted(roots, weights) -> list[ShardSet]:
    """The mix of `roots` weighted by `weights` (a `ShardSet` each)."""
    return [ShardSet(root, weight=w) for root, w in zip(roots, weights, strict=True)]


def _dm(roots, backend="cpu", weights=(3, 1), **kw) -> ShardDataModule:
    roots = _weighted(roots, weights)
    kw.setdefault("batch_size", 10)
    kw.setdefault("seed", 5)
    dm = ShardDataModule(
        roots, backend=backend, drop_last=False, workers=WorkerSettings(num_workers=0), **kw
    )
    dm.setup("fit")
    return dm


def _epochs(dm: ShardDataModule, count: int = 1, limit: int | None = None) -> list[list[int]]:
    """The label sequence of each of `count` epochs (at most `limit` batches each)."""
    loader, out = dm.train_dataloader(), []
    for _ in range(count):
        labels = []
        for step, batch in enumerate(loader):
            if step == limit:
                break
            _, y = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, CPU, 0), 0)
            labels += y.tolist()
        out.append(labels)
    return out


def test_weighted_epochs_are_exact_seeded_and_fresh_each_epoch(two_roots):
    first, second = _epochs(_dm(two_roots), count=2)
    for labels in (first, second):
        counts = Counter(labels)
        from_a = [y for y in labels if y < N_A]
        assert len(labels) == N_A + N_B and abs(len(from_a) / len(labels) - 0.75) <= 0.01
        assert all(counts[y] == 2 for y in range(N_A))  # up-sampled: two whole copies of A
        from_b = [y for y in labels if y >= N_A]
        assert len(from_b) == len(set(from_b)) == 40  # down-sampled: a subset of B, once each
    assert _epochs(_dm(two_roots))[0] == first  # the same seed: the same epoch
    assert first != second and {y for y in first if y >= N_A} != {y for y in second if y >= N_A}
    assert _epochs(_dm(two_roots, seed=6))[0] != first


def test_epoch_samples_adds_a_seeded_partial_copy(two_roots):
    (labels,) = _epochs(_dm(two_roots, epoch_samples=200))
    counts = Counter(y for y in labels if y < N_A)
    assert sum(counts.values()) == 150 and sorted(Counter(counts.values()).items()) == [
        (2, 30),
        (3, 30),
    ]
    assert sum(1 for y in labels if y >= N_A) == 50


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_cover_the_selection_and_backends_agree(two_roots, world):
    (selection,) = _epochs(_dm(two_roots))  # one rank: the epoch's selection in plan order
    per_backend = {
        backend: [
            _epochs(_dm(two_roots, backend, rank=r, world_size=world))[0] for r in range(world)
        ]
        for backend in LOCAL
    }
    for backend, ranks in per_backend.items():
        assert ranks == per_backend["cpu"], backend
    together = Counter(y for rank in per_backend["cpu"] for y in rank)
    padding = together - Counter(selection)
    assert Counter(selection) - together == Counter()  # every selected sample, as often
    assert sum(padding.values()) == -len(selection) % world  # plus only the padding repeats


@pytest.mark.parametrize("before,after", [((2, 10), (1, 20)), ((1, 20), (2, 10))])
@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_resume_mid_mixed_epoch_is_exact_and_elastic(two_roots, before, after, backend):
    (selection,) = _epochs(_dm(two_roots, backend))
    seen, state = [], None
    for r in range(before[0]):
        dm = _dm(two_roots, backend, rank=r, world_size=before[0], batch_size=before[1])
        seen += _epochs(dm, limit=3)[0]
        state = state or dm.state_dict()
    assert state["consumed"] == 3 * before[0] * before[1] and "weights 3:1" in state["mix"]
    resumed = []
    for r in range(after[0]):
        dm = ShardDataModule(
            _weighted(two_roots, [3, 1]),
            backend=backend,
            batch_size=after[1],
            seed=5,
            rank=r,
            world_size=after[0],
            drop_last=False,
            workers=WorkerSettings(num_workers=0),
        )
        dm.load_state_dict(state)
        dm.setup("fit")
        resumed += _epochs(dm)[0]
    assert Counter(seen + resumed) == Counter(selection)  # 160: no padding on 1 or 2 ranks


def test_state_from_another_weighting_or_dataset_is_refused(two_roots):
    dm = _dm(two_roots)
    _epochs(dm, limit=2)
    state = dm.state_dict()
    with pytest.raises(
        ResumeError, match=r"weights 3:1 .*this DataModule reads a mix \(weights 1:1"
    ):
        ShardDataModule(
            _weighted(two_roots, [1, 1]), seed=5, workers=WorkerSettings(num_workers=0)
        ).load_state_dict(state)
    with pytest.raises(ResumeError, match="epoch size 200"):
        ShardDataModule(_weighted(two_roots, [3, 1]), epoch_samples=200, seed=5).load_state_dict(
            state
        )
    with pytest.raises(ResumeError, match="reads a single dataset"):
        ShardDataModule(
            two_roots[0], seed=5, workers=WorkerSettings(num_workers=0)
        ).load_state_dict(state)
    ShardDataModule(_weighted(two_roots, [3.0, 1.0]), seed=5).load_state_dict(state)  # the same mix
    ShardDataModule(_weighted(two_roots, [3, 1]), epoch_samples=160, seed=5).load_state_dict(state)


def _test_labels(dm: ShardDataModule) -> list[int]:
    return [y for _, batch in dm.test_dataloader() for y in batch.tolist()]


def test_eval_splits_are_the_concatenation_once_each(two_roots):
    mixed = _test_labels(_dm(two_roots, weights=[1, 9]))  # weights do not apply to evaluation
    a, b = (
        _test_labels(ShardDataModule(r, backend="cpu", workers=WorkerSettings(num_workers=0)))
        for r in two_roots
    )
    assert mixed == a + [N_A + y for y in b]  # A's rows, then B's, each once, merged labels
    assert sorted(mixed) == list(range(10)) + list(range(N_A, N_A + 10))


def _named(out: Path, classes: list[str], labels: list[int]) -> Path:
    """A dataset whose image pixels all equal 10 * (the index of the sample's class name in
    NAMES), so a batch's pixels say which class name each sample was written under."""
    images = np.stack([np.full((4, 4, 3), 10 * NAMES.index(classes[y]), np.uint8) for y in labels])
    source = ArraySource({"train": (images, np.asarray(labels))}, classes)
    write_shards(source, out, ShardOptions(max_count=4, workers=1, progress=False))
    return out


NAMES = ["cat", "dog", "eel", "fox", "gnu"]


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_classes_are_merged_by_name_in_first_seen_order(tmp_path, backend):
    a = _named(tmp_path / "a", ["cat", "dog", "eel"], [0, 1, 2, 0, 1, 2])
    b = _named(tmp_path / "b", ["fox", "dog", "gnu"], [0, 1, 2, 1, 0])
    dm = _dm([a, b], backend, weights=[1, 1], batch_size=4, train_transforms="none")
    assert dm.manifest.classes == ["cat", "dog", "eel", "fox", "gnu"]
    assert dm.manifest.split("train").class_counts == [2, 4, 2, 2, 1]
    pairs = []
    for x, y in dm.train_dataloader():
        pairs += zip(x[:, 0, 0, 0].tolist(), y.tolist(), strict=True)
    assert len(pairs) == 11
    assert all(dm.manifest.classes[label] == NAMES[pixel // 10] for pixel, label in pairs)


def test_arguments_and_datasets_that_cannot_mix_are_refused(two_roots):
    with pytest.raises(ValueError, match="2 weights for 1 roots"):
        mix_roots([two_roots[0]], [1, 2])
    with pytest.raises(ValueError, match=f"the weight of {two_roots[1]} must be finite and > 0"):
        mix_roots(two_roots, [1, 0])
    with pytest.raises(ValueError, match="pass root as a list"):
        ShardDataModule(two_roots[0], epoch_samples=10)
    a, b = (load_manifest(r) for r in two_roots)
    with pytest.raises(ValueError, match="no class names"):
        mix_manifests([a, replace(b, classes=[])])
    jpeg = replace(b, splits={k: replace(v, encoding="jpeg") for k, v in b.splits.items()})
    with pytest.raises(ValueError, match="cannot mix raw-pixel and encoded"):
        mix_manifests([a, jpeg])


def test_share_counts_round_by_largest_remainder():
    assert share_counts(160, [3, 1]) == (120, 40)
    assert share_counts(10, [1, 1, 1]) == (4, 3, 3)  # ties: the earlier dataset
    assert share_counts(7, [0.5, 0.25, 0.25]) == (3, 2, 2)  # quotas 3.5, 1.75, 1.75
    counts = share_counts(101, [2.0, 3.0, 5.0])
    assert sum(counts) == 101 and all(
        abs(c / 101 - w) <= 1 / 101 for c, w in zip(counts, [0.2, 0.3, 0.5], strict=True)
    )


def test_row_labels_map_through_each_shards_dataset(two_roots):
    mixed = mix_manifests([load_manifest(r) for r in two_roots])
    with pytest.raises(ValueError, match="cannot be saved"):
        mixed.to_json()
    info = mixed.split("test")
    labels = torch.tensor(list(range(10)) * 2)
    assert map_row_labels(info, labels).tolist() == list(range(10)) + list(range(N_A, N_A + 10))
    with pytest.raises(ValueError, match="outside its dataset's"):
        map_row_labels(info, torch.full((20,), 500))


# Digests of plans and epochs made by the code before scheduled weights existed (fastdata at
# commit 8d286c3): fixed weights must keep drawing exactly those.
_PLANS_BEFORE_SCHEDULES = "26573a722070e7e2f0e7ff25bbf42b38f5fe823fe01020d2f1a1d13da9c94f16"
_EPOCHS_BEFORE_SCHEDULES = "708d39e40c2e947ad9ac7aa2e45d235ad1f8dffeeee0ac752a5a843acc8c4c26"


def test_fixed_weight_plans_are_byte_identical_to_before_schedules():
    from fastdata.read.plan import EpochMix, PlanConfig, mixed_order, plan_epoch

    sizes, mix, digest = (
        (16, 16, 16, 12, 16, 16, 16, 16, 16, 16, 4),
        EpochMix((4, 7), (120, 40)),
        sha256(),
    )
    for mode, window in (("shard", None), ("window", 24), ("full", None)):
        for epoch in (0, 3):
            digest.update(mixed_order(sizes, mix, 5, epoch, mode, window).tobytes())
            for world, batch, consumed in ((1, 10, 0), (2, 7, 30), (3, 10, 41)):
                for rank in range(world):
                    config = PlanConfig(5, rank, world, batch, True, False, mix, None, mode, window)
                    plan = plan_epoch(sizes, config, epoch, consumed)
                    for parts in zip(plan.rows, plan.positions, plan.padding, strict=True):
                        for part in parts:
                            digest.update(part.tobytes())
                    digest.update(np.asarray(plan.seeds, dtype=np.int64).tobytes())
    assert digest.hexdigest() == _PLANS_BEFORE_SCHEDULES


def test_fixed_weight_epochs_through_the_datamodule_are_unchanged(two_roots):
    digest = sha256()
    for labels in _epochs(_dm(two_roots), count=2):
        digest.update(repr(labels).encode())
    other = _dm(two_roots, weights=(1, 2), epoch_samples=90, rank=1, world_size=2, batch_size=7)
    for labels in _epochs(other, count=2):
        digest.update(repr(labels).encode())
    assert digest.hexdigest() == _EPOCHS_BEFORE_SCHEDULES
    state = _dm(two_roots).state_dict()
    assert "schedule" not in state and state["mix"].startswith("weights 3:1 over")


def test_shardset_takes_a_schedule_or_a_function(two_roots):
    table = Schedule([(0, 3.0), (80, 1.0)])
    dm = _dm(two_roots, weights=(table, 1))
    assert dm.weights == [table, 1.0] and isinstance(epoch_mix(dm.manifest, "train"), ScheduledMix)
    with pytest.raises(ValueError, match=r"alone is no mix"):
        ShardDataModule(ShardSet(two_roots[0], weight=table))
    with pytest.raises(ValueError, match=r"weight must be a number"):
        ShardSet(two_roots[0], weight=[1, 2])
