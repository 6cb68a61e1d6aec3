"""Scheduled mixture weights (`fastdata.read.schedule`, plan rule 7): exact counts per batch on
every rank, exact and elastic resume, a changed schedule on resume applies from its position.

Plan-level tests draw from two datasets laid end to end (A: rows < 60 in 4 shards, B: the 100
rows after them in 7 shards) with epochs of E = 160 samples; DataModule tests use the same two
datasets as tests/read/test_mix.py, where a label < N_A names a sample of A.
"""

from __future__ import annotations

import logging
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata import ShardDataModule, ShardSet, WorkerSettings
from fastdata.read.plan import PlanConfig, plan_epoch, scheduled_order
from fastdata.read.resume import ResumeError, ResumeState
from fastdata.read.schedule import (
    MixResume,
    MixWeights,
    Schedule,
    ScheduledMix,
    resume_schedule,
    schedule_record,
    scheduled_owners,
    share_counts,
)
from tests.read.test_mix import LOCAL, N_A, N_B, _epochs, _write

SIZES = (16, 16, 16, 12, 16, 16, 16, 16, 16, 16, 4)
E = 160
EASY = Schedule([(0, 0.8), (100, 0.5), (250, 0.2)])
HARD = Schedule([(0, 0.2), (100, 0.5), (250, 0.8)])


def _mix(a=EASY, b=HARD, block=None, splice=None) -> ScheduledMix:
    return ScheduledMix((4, 7), E, MixWeights(("A", "B"), (a, b)), block, splice)


def _expected(n: int, position: int, a=EASY, b=HARD) -> tuple[int, int]:
    return share_counts(n, (a(position), b(position)))


def _from_a(rows: np.ndarray) -> int:
    return int((rows < N_A).sum())


def test_schedule_tables_step_and_linear():
    assert [EASY(p) for p in (0, 99, 100, 249, 250, 10**9)] == [0.8, 0.8, 0.5, 0.5, 0.2, 0.2]
    ramp = Schedule([(0, 1.0), (100, 0.0), (200, 3.0)], mode="linear")
    assert [ramp(p) for p in (0, 25, 100, 150, 200, 500)] == [1.0, 0.75, 0.0, 1.5, 3.0, 3.0]
    assert Schedule([(0, 1), (5, 2)]) == Schedule([(0, 1.0), (5, 2.0)])  # compared by value
    assert EASY.describe() == "step 0:0.8 100:0.5 250:0.2"
    for points, message in [
        ([], "pairs"),
        ([(5, 1.0)], "start at 0"),
        ([(0, 1.0), (10, 1.0), (10, 2.0)], "increase"),
        ([(0, -1.0)], ">= 0"),
        ([(0, float("nan"))], ">= 0"),
        ([(0.5, 1.0)], "ints"),
    ]:
        with pytest.raises(ValueError, match=message):
            Schedule(points)
    with pytest.raises(ValueError, match="mode"):
        Schedule([(0, 1.0)], mode="cosine")


@pytest.mark.parametrize("world,batch", [(1, 10), (2, 10), (3, 10), (4, 7)])
def test_every_batch_on_every_rank_holds_the_scheduled_counts(world, batch):
    for epoch in (0, 1, 2):
        plans = [
            plan_epoch(SIZES, PlanConfig(9, r, world, batch, True, mix=_mix()), epoch)
            for r in range(world)
        ]
        assert len({len(p) for p in plans}) == 1  # every rank the same number of batches
        for plan in plans:
            for rows, positions in zip(plan.rows, plan.positions, strict=True):
                if len(rows) < batch or positions.max() >= E:
                    continue  # the epoch's short last step (or its padding)
                first = epoch * E + int(positions[0])
                assert (_from_a(rows), len(rows) - _from_a(rows)) == _expected(batch, first)


def test_windows_of_batches_follow_the_schedule_exactly():
    """Over any run of whole blocks the realized counts are the sum of the blocks' shares."""
    order = np.concatenate([scheduled_order(SIZES, _mix(), 4, e, 10) for e in range(3)])
    for start in range(0, 3 * E, 40):  # windows of 4 batches of 10
        window = order[start : start + 40]
        wanted = [_expected(10, start + 10 * k) for k in range(4)]
        assert _from_a(window) == sum(a for a, _ in wanted)
    early, late = _from_a(order[:100]) / 100, _from_a(order[250:480]) / 230
    assert early == 0.8 and late == pytest.approx(0.2, abs=0.01)  # the curriculum, realized


def test_streams_are_whole_copies_first_and_the_order_is_seeded():
    order = scheduled_order(SIZES, _mix(), 4, 0, 10)
    a = Counter(order[order < N_A].tolist())
    assert max(a.values()) - min(a.values()) <= 1  # A's draws: copies end to end (up-sampled)
    b = order[order >= N_A]
    assert len(b) == len(set(b.tolist()))  # B down-sampled: each sample at most once
    assert np.array_equal(order, scheduled_order(SIZES, _mix(), 4, 0, 10))
    assert not np.array_equal(order, scheduled_order(SIZES, _mix(), 5, 0, 10))
    assert not np.array_equal(order, scheduled_order(SIZES, _mix(), 4, 1, 10))


def test_a_function_weight_equals_the_same_table():
    def linear(position: int) -> float:
        return max(0.0, 1.0 - position / 300)

    table = Schedule([(0, 1.0), (300, 0.0)], mode="linear")
    one = scheduled_order(SIZES, _mix(linear, 1.0), 4, 0, 10)
    assert np.array_equal(one, scheduled_order(SIZES, _mix(table, 1.0), 4, 0, 10))
    with pytest.raises(ValueError, match="every dataset's weight is 0 at global sample position"):
        scheduled_order(SIZES, _mix(Schedule([(0, 0.0)]), Schedule([(0, 0.0)])), 4, 0, 10)
    with pytest.raises(ValueError, match="the weight of A at sample position 0"):
        scheduled_order(SIZES, _mix(lambda p: -1.0, 1.0), 4, 0, 10)


@pytest.mark.parametrize("before,after", [(1, 2), (2, 3), (3, 1)])
def test_resume_mid_epoch_on_another_world_size_gives_the_same_remaining_samples(before, after):
    """The block stays the first run's batch size: the order, hence the remainder, is the same."""
    order = scheduled_order(SIZES, _mix(), 4, 1, 10)
    consumed = 3 * before * 10
    resumed = [
        plan_epoch(SIZES, PlanConfig(4, r, after, 10, True, mix=_mix(block=10)), 1, consumed)
        for r in range(after)
    ]
    rows = [b[~pad] for p in resumed for b, pad in zip(p.rows, p.padding, strict=True)]
    assert Counter(np.concatenate(rows).tolist()) == Counter(order[consumed:].tolist())
    other_batch = plan_epoch(SIZES, PlanConfig(4, 0, 1, 16, True, mix=_mix(block=10)), 1, consumed)
    assert np.array_equal(np.concatenate(other_batch.rows), order[consumed:])


def test_a_splice_keeps_what_was_taken_and_applies_the_new_weights_after_it():
    old = scheduled_owners(_mix(), 4, 0, 10)
    taken = tuple(int(n) for n in np.bincount(old[:70], minlength=2))
    flipped = _mix(HARD, EASY, 10, (0, 70, taken))
    new = scheduled_owners(flipped, 4, 0, 10)
    assert tuple(np.bincount(new[:70], minlength=2)) == taken
    for start in range(70, E, 10):
        block = new[start : start + 10]
        assert (int((block == 0).sum()), int((block == 1).sum())) == _expected(
            10, start, HARD, EASY
        )
    # Each dataset's stream continues after the samples it gave before the splice.
    before = scheduled_order(SIZES, _mix(), 4, 0, 10)[:70]
    after = scheduled_order(SIZES, flipped, 4, 0, 10)[70:]
    from_b = np.concatenate([before[before >= N_A], after[after >= N_A]])
    assert len(set(from_b.tolist())) == len(from_b)  # B's draws are one copy: no repeat
    assert np.array_equal(
        scheduled_owners(flipped, 4, 1, 10), scheduled_owners(_mix(HARD, EASY), 4, 1, 10)
    )


# ------------------------------------------------------------------ through the DataModule


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> list[Path]:
    base = tmp_path_factory.mktemp("sched")
    return [_write(base / "a", "a", N_A, 10, 1), _write(base / "b", "b", N_B, 10, 2)]


def _dm(roots, a=EASY, b=HARD, state=None, **kw) -> ShardDataModule:
    kw.setdefault("batch_size", 10)
    dm = ShardDataModule(
        [ShardSet(roots[0], weight=a), ShardSet(roots[1], weight=b)],
        backend=kw.pop("backend", "cpu"),
        seed=5,
        drop_last=False,
        workers=WorkerSettings(num_workers=0),
        **kw,
    )
    if state is not None:
        dm.load_state_dict(state)
    dm.setup("fit")
    return dm


def _batches(dm: ShardDataModule, limit: int | None = None) -> list[list[int]]:
    out = []
    for step, batch in enumerate(dm.train_dataloader()):
        if step == limit:
            break
        _, y = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, "cpu", 0), 0)
        out.append(y.tolist())
    return out


@pytest.mark.parametrize("backend", LOCAL)
def test_datamodule_batches_follow_the_schedule_across_epochs(roots, backend):
    dm = _dm(roots, backend=backend)
    for epoch in range(2):
        for k, labels in enumerate(_batches(dm)):
            a = sum(y < N_A for y in labels)
            assert (a, len(labels) - a) == _expected(len(labels), epoch * E + 10 * k)


@pytest.mark.parametrize("before,after", [((2, 10), (1, 20)), ((1, 10), (3, 10))])
def test_datamodule_resume_is_exact_and_elastic(roots, before, after):
    (whole,) = _epochs(_dm(roots))
    seen, state = [], None
    for r in range(before[0]):
        dm = _dm(roots, rank=r, world_size=before[0], batch_size=before[1])
        seen += [y for b in _batches(dm, limit=3) for y in b]
        state = state or dm.state_dict()
    record = state["schedule"]
    assert record["block"] == before[1] and sum(record["taken"]) == state["consumed"]
    resumed = []
    for r in range(after[0]):
        dm = _dm(roots, state=state, rank=r, world_size=after[0], batch_size=after[1])
        resumed += [y for b in _batches(dm) for y in b]
    pad = -(E - state["consumed"]) % after[0]
    assert Counter(seen + resumed) - Counter(whole) == Counter(resumed[-pad:] if pad else [])
    assert Counter(whole) - Counter(seen + resumed) == Counter()


def test_a_new_schedule_on_resume_changes_only_what_follows_and_says_so(roots, caplog):
    run = _dm(roots)
    first = _batches(run, limit=7)
    state = run.state_dict()
    assert state["consumed"] == 70
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        flipped = _dm(roots, HARD, EASY, state=state)
    assert "schedule changed at global sample position 70 " in caplog.text
    assert "step 0:0.8 100:0.5 250:0.2 | step 0:0.2" in caplog.text  # old, then new
    rest = _batches(flipped)
    for k, labels in enumerate(rest, start=7):
        a = sum(y < N_A for y in labels)
        assert (a, len(labels) - a) == _expected(10, 10 * k, HARD, EASY)
    from_b = [y for b in first + rest for y in b if y >= N_A]
    assert len(from_b) == len(set(from_b))  # B's stream continued: nothing drawn twice
    partway = _dm(roots, HARD, EASY, state=state)
    assert _batches(partway, limit=3) == rest[:3]
    again = partway.state_dict()  # the splice travels with the state
    assert again["schedule"]["splice"] == [70, state["schedule"]["taken"]]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        assert _batches(_dm(roots, HARD, EASY, state=again)) == rest[3:]
        assert _batches(_dm(roots, state=state)) == _batches(_dm(roots))[7:]  # no change
    assert "schedule changed" not in caplog.text


def test_state_serializes_and_malformed_records_are_refused(roots, tmp_path):
    dm = _dm(roots)
    _batches(dm, limit=4)
    state = dm.state_dict()
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert ResumeState.from_dict(loaded) == ResumeState.from_dict(state)
    assert ResumeState.from_dict(loaded).to_dict() == state
    for change, message in [
        ({"taken": [1, 2]}, "summing to 'consumed'"),
        ({"block": 0}, "'block' must be"),
        ({"splice": [5, [1, 1]]}, "'splice' must be"),
        ({"schedule": 3}, "'schedule' is malformed"),
    ]:
        bad = dict(state, schedule=dict(state["schedule"], **change))
        with pytest.raises(ResumeError, match=message):
            ResumeState.from_dict(bad)
    with pytest.raises(ResumeError, match="lacks its schedule record"):
        _dm(roots, state={k: v for k, v in state.items() if k != "schedule"})
    fixed = ShardDataModule([ShardSet(roots[0], weight=3), ShardSet(roots[1])], seed=5)
    with pytest.raises(ResumeError, match=r"scheduled weights .*reads a mix \(weights 3:1"):
        fixed.load_state_dict(state)


def test_record_and_resume_helpers_ignore_fixed_mixes():
    assert schedule_record(None, 0, 0, 0, 10) is None
    state = ResumeState(0, 0, 0, 0, 1, 10, 160, "0" * 16)
    assert resume_schedule(None, 0, state) is None
    assert MixResume(10).splice is None


def test_loader_workers_get_the_schedule(roots):
    """Workers (forked, and a spec pickled as spawn sends it) plan the same scheduled batches."""
    alone = _batches(_dm(roots))
    forked = ShardDataModule(
        [ShardSet(roots[0], weight=EASY), ShardSet(roots[1], weight=HARD)],
        batch_size=10,
        seed=5,
        backend="cpu",
        drop_last=False,
        workers=WorkerSettings(num_workers=2, prefetch_factor=2),
    )
    assert _batches(forked) == alone
    spec = _dm(roots).loader_spec("train", train=True)
    copy = pickle.loads(pickle.dumps(spec))
    assert np.array_equal(np.concatenate(copy.plan(1).rows), np.concatenate(spec.plan(1).rows))


def test_a_shardset_with_a_schedule_loads_from_a_weights_only_checkpoint(tmp_path):
    """Lightning's `save_hyperparameters` puts the DataModule's arguments into checkpoints."""
    import fastdata.lightning.options  # noqa: F401  (registers the safe globals)

    sets = [ShardSet("shards/a", weight=EASY), ShardSet("shards/b", weight=2)]
    torch.save({"root": sets}, tmp_path / "hparams.pt")
    assert torch.load(tmp_path / "hparams.pt", weights_only=True)["root"] == sets
