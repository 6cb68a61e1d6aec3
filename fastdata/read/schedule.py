"""Mixture weights that change with the position in training (plan rule 7): curricula.

    from fastdata import Schedule, ShardDataModule, ShardSet

    dm = ShardDataModule(
        [
            ShardSet("shards/easy", weight=Schedule([(0, 0.8), (10_000, 0.5), (50_000, 0.2)])),
            ShardSet("shards/hard", weight=Schedule([(0, 0.2), (10_000, 0.5), (50_000, 0.8)])),
        ],
        batch_size=64,
    )

A `ShardSet` weight may be a number (fixed: plan rule 0, as before), a `Schedule` (a piecewise
table, "step" or "linear") or a function ``f(position) -> weight``. Positions count samples over
the whole run: the p-th sample of epoch e's order is at *global sample position* ``e * E + p``,
E the mix's epoch size (`epoch_samples`, else the sum of the datasets' training sizes), whatever
the world size or batch size. A mix with any scheduled weight is a *scheduled mix*: its plain
numbers are constant schedules.

- Exact per batch: the epoch order is cut into blocks of the per-rank batch size the run started
  with (kept on resume); each block draws from dataset i exactly its `share_counts` share of the
  weights in force at the block's first global position (`ScheduledMix`, `scheduled_owners`).
- Resume: `ShardDataModule.state_dict` records the block, each weight's description and the
  samples of the epoch taken from each dataset (`fastdata.read.resume.ScheduleState`). A run
  resumed with another schedule continues from its position with the new weights (the old ones
  up to it: the epoch's samples taken so far stay taken, each dataset's stream continues after
  them) and logs a warning naming the position (`resume_schedule`). A changed table is always
  seen; a function is known by its qualified name and by the draws it made this epoch, so give
  a changed function a new name (or use a `Schedule`).
- A function must be picklable (defined at module level, not a lambda) for workers started by
  spawn and for checkpoints that hold the DataModule's arguments.
"""

from __future__ import annotations

import logging
import math
import numbers
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from operator import itemgetter
from typing import Literal

import numpy as np

from fastdata.read.resume import ResumeError, ResumeState, ScheduleState

__all__ = [
    "MixResume",
    "MixWeights",
    "Schedule",
    "ScheduledMix",
    "Weight",
    "check_weight",
    "describe_weight",
    "resume_schedule",
    "schedule_record",
    "scheduled_owners",
    "share_counts",
]

log = logging.getLogger("fastdata")

SCHEDULE_MODES = ("step", "linear")


@dataclass(frozen=True)
class Schedule:
    """A weight as a piecewise table over global sample positions.

    Args:
        points: (global sample position, weight) pairs; positions are ints, the first 0, then
            increasing; weights finite and >= 0 (0: the dataset is left out there).
        mode: "step": a point's weight holds from its position up to the next point's;
            "linear": the weight moves linearly from each point to the next. After the last
            point its weight holds in both modes.

    Raises:
        ValueError: no points, a first position other than 0, positions not increasing, a
            weight that is not a finite number >= 0, or an unknown mode.
    """

    points: tuple[tuple[int, float], ...]
    mode: Literal["step", "linear"] = "step"

    def __init__(self, points: Sequence[tuple[int, float]], mode: str = "step") -> None:
        if mode not in SCHEDULE_MODES:
            raise ValueError(f"Schedule mode must be one of {SCHEDULE_MODES}, got {mode!r}")
        pairs = [tuple(p) for p in points]
        if not pairs or any(len(p) != 2 for p in pairs):
            raise ValueError(f"a Schedule needs (position, weight) pairs, got {points!r}")
        positions = [p for p, _ in pairs]
        if any(isinstance(p, bool) or not isinstance(p, numbers.Integral) for p in positions):
            raise ValueError(f"Schedule positions must be ints (samples), got {positions}")
        increasing = all(a < b for a, b in zip(positions, positions[1:], strict=False))
        if positions[0] != 0 or not increasing:
            raise ValueError(
                f"Schedule positions must start at 0 and increase, got {positions}: the table "
                "says which weight holds from each global sample position on"
            )
        for _, weight in pairs:
            _check_value(weight, f"a Schedule weight ({pairs})")
        object.__setattr__(self, "points", tuple((int(p), float(w)) for p, w in pairs))
        object.__setattr__(self, "mode", mode)

    def __call__(self, position: int) -> float:
        """The weight in force at global sample `position` (>= 0)."""
        i = max(0, bisect_right(self.points, position, key=itemgetter(0)) - 1)
        start, weight = self.points[i]
        if self.mode == "step" or i + 1 == len(self.points):
            return weight
        end, following = self.points[i + 1]
        return weight + (following - weight) * (position - start) / (end - start)

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The weights at many positions (float64), the same numbers as `__call__` gives."""
        starts = np.array([p for p, _ in self.points], dtype=np.int64)
        values = np.array([w for _, w in self.points], dtype=np.float64)
        i = np.maximum(0, np.searchsorted(starts, positions, side="right") - 1)
        if self.mode == "step" or len(starts) == 1:
            return values[i]
        j = np.minimum(i + 1, len(starts) - 1)
        span = np.where(j > i, starts[j] - starts[i], 1).astype(np.float64)
        moved = values[i] + (values[j] - values[i]) * (positions - starts[i]) / span
        return np.where(j > i, moved, values[i])

    def describe(self) -> str:
        """The table as text, e.g. "step 0:0.8 10000:0.5" (compared on resume)."""
        return f"{self.mode} " + " ".join(f"{p}:{w!r}" for p, w in self.points)


#: A `ShardSet` weight: a fixed number, a `Schedule`, or a function of the global sample position.
Weight = float | Schedule | Callable[[int], float]


def _check_value(weight: object, what: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise ValueError(f"{what} must be a number, got {weight!r}")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{what} must be finite and >= 0, got {weight!r}")
    return float(weight)


def check_weight(what: str, weight: object) -> Weight:
    """A fixed weight as a float (finite, > 0), or a `Schedule` or function unchanged.

    Args:
        what: the weight's name in messages, e.g. "the weight of shards/a".
        weight: the weight given.

    Raises:
        ValueError: a fixed weight that is not a finite number > 0 (names `what`).
    """
    if isinstance(weight, Schedule) or (callable(weight) and not isinstance(weight, type)):
        return weight
    value = _check_value(weight, what)
    if value <= 0:
        raise ValueError(f"{what} must be finite and > 0, got {weight!r}")
    return value


def describe_weight(weight: Weight) -> str:
    """A weight as text: the number, the table, or the function's qualified name."""
    if isinstance(weight, Schedule):
        return weight.describe()
    if callable(weight):
        module = getattr(weight, "__module__", None) or "?"
        name = getattr(weight, "__qualname__", None) or type(weight).__qualname__
        return f"function {module}.{name}"
    return f"{weight!r}"


@dataclass(frozen=True)
class MixWeights:
    """The weights of a mix's datasets at a global sample position (`__call__`).

    Attributes:
        roots: the datasets, in mix order (for messages).
        weights: each one's `Weight`.
    """

    roots: tuple[str, ...]
    weights: tuple[Weight, ...]

    def __call__(self, position: int) -> tuple[float, ...]:
        """Every dataset's weight at `position` (ValueError naming the dataset and position)."""
        return tuple(self.many(np.array([position], dtype=np.int64))[0].tolist())

    def many(self, positions: np.ndarray) -> np.ndarray:
        """Every dataset's weight at each of `positions`: an (n, datasets) float64 array.

        Raises:
            ValueError: a weight that is not a finite number >= 0, or all weights 0, naming
                the dataset and the first such position.
        """
        columns = []
        for root, weight in zip(self.roots, self.weights, strict=True):
            if isinstance(weight, Schedule):
                column = weight.at(positions)
            elif callable(weight):
                column = np.array(
                    [_check_value(weight(int(p)), self._what(root, int(p))) for p in positions],
                    dtype=np.float64,
                )
            else:
                column = np.full(len(positions), float(weight))
            columns.append(column)
        out = np.stack(columns, axis=1).reshape(len(positions), len(self.weights))
        bad = ~(np.isfinite(out) & (out >= 0))
        if bad.any():
            row, col = np.argwhere(bad)[0]
            _check_value(float(out[row, col]), self._what(self.roots[col], int(positions[row])))
        off = out.sum(axis=1) <= 0
        if off.any():
            raise ValueError(
                f"every dataset's weight is 0 at global sample position "
                f"{int(positions[np.argmax(off)])} ({', '.join(self.roots)}): at least one must be "
                "> 0 everywhere"
            )
        return out

    @staticmethod
    def _what(root: str, position: int) -> str:
        return f"the weight of {root} at sample position {position}"

    def describe(self) -> str:
        """Each dataset's weight as text (`describe_weight`), in mix order."""
        return " | ".join(describe_weight(w) for w in self.weights)


@dataclass(frozen=True)
class ScheduledMix:
    """How a training epoch of a scheduled mix draws from its datasets (plan rule 7).

    Attributes:
        shards: shards of each dataset, in split order.
        total: samples in every epoch (E).
        weights: the datasets' weights at a global sample position (`MixWeights`).
        block: samples per block (the per-rank batch size the run started with); None: the
            plan's batch size.
        splice: (epoch, position, taken): in that epoch the first `position` samples took
            `taken[i]` of dataset i and the weights apply from `position` on (a resume with a
            changed schedule); None: none.
    """

    shards: tuple[int, ...]
    total: int
    weights: MixWeights
    block: int | None = None
    splice: tuple[int, int, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if len(self.shards) != len(self.weights.weights) or not self.shards:
            raise ValueError(f"need one weight per dataset, got {self.shards}, {self.weights}")
        if self.total < 0 or (self.block is not None and self.block < 1):
            raise ValueError(f"need total >= 0 and block >= 1, got {self.total}, {self.block}")


def share_counts(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """`total` split in proportion to `weights` by largest remainder (exact sum; ties: first).

    Each count is the floor of its exact quota ``total * w_i / sum(w)`` or one more, so every
    share is within ``1 / total`` of its weight's share.
    """
    shares = tuple(float(w) for w in weights)
    if not shares or min(shares) < 0 or not sum(shares) > 0:
        raise ValueError(f"share_counts needs weights >= 0 with a sum > 0, got {list(weights)}")
    return _share_counts(int(total), shares)


@lru_cache(maxsize=4096)
def _share_counts(total: int, weights: tuple[float, ...]) -> tuple[int, ...]:
    # Exact in integers: a float is m / 2**e, so all weights share the largest denominator.
    ratios = [w.as_integer_ratio() for w in weights]
    den = max(d for _, d in ratios)
    ints = [n * (den // d) for n, d in ratios]
    whole = sum(ints)
    floors, remainders = zip(*(divmod(total * w, whole) for w in ints), strict=True)
    counts = list(floors)
    by_remainder = sorted(range(len(ints)), key=lambda i: (-remainders[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


# The blocks' arrangement draw: plan rule 0's stream tags (_MIX), then its own (non-zero) tag.
_MIX, _BLOCKS = 0x313, 4


def scheduled_owners(mix: ScheduledMix, seed: int, epoch: int, block: int) -> np.ndarray:
    """The dataset each sample of the epoch order comes from (int64, rule 7).

    Blocks start at every multiple of `block` (and at the splice's position): block b draws
    `share_counts(len, weights at epoch * total + its start)`, arranged by a permutation drawn
    from (seed, epoch). Before a splice's position: `taken` of each dataset, in dataset order
    (consumed before the resume: never read).
    """
    total, k = mix.total, len(mix.shards)
    start, taken = 0, (0,) * k
    if mix.splice is not None and mix.splice[0] == epoch:
        _, start, taken = mix.splice
        if len(taken) != k or sum(taken) != start or not 0 <= start <= total:
            raise ValueError(f"the splice {mix.splice} does not fit {k} datasets, {total} samples")
    grid = np.arange(-(-start // block) * block, total, block, dtype=np.int64)
    cuts = np.unique(np.concatenate([[start], grid]))
    cuts = cuts[cuts < total]
    lengths = np.diff(np.append(cuts, total))
    weights = mix.weights.many(epoch * total + cuts).tolist()
    counts = np.array(
        [_share_counts(int(n), tuple(w)) for n, w in zip(lengths, weights, strict=True)],
        dtype=np.int64,
    ).reshape(-1, k)
    owners = np.empty(total, dtype=np.int64)
    owners[:start] = np.repeat(np.arange(k), taken)
    rng = np.random.default_rng([seed, epoch, 0x5EED, _MIX, _BLOCKS])
    keys = rng.integers(0, 1 << 31, total, dtype=np.int64)[start:]
    # Sorted by block, then by key (exact in int64): a seeded permutation inside each block.
    blocks = np.repeat(np.arange(len(cuts), dtype=np.int64), lengths)
    arranged = np.argsort((blocks << 31) | keys, kind="stable")
    owners[start + arranged] = np.repeat(np.tile(np.arange(k), len(cuts)), counts.ravel())
    return owners


def _taken(mix: ScheduledMix, seed: int, epoch: int, consumed: int, block: int) -> tuple[int, ...]:
    owners = scheduled_owners(mix, seed, epoch, block)[:consumed]
    return tuple(int(n) for n in np.bincount(owners, minlength=len(mix.shards)))


def schedule_record(
    mix: object, seed: int, epoch: int, consumed: int, batch_size: int
) -> ScheduleState | None:
    """What a resume state records of a scheduled mix at (epoch, consumed); None otherwise.

    Args:
        mix: the training split's mix (`fastdata.read.mix.epoch_mix`).
        seed: the base seed.
        epoch: the epoch.
        consumed: samples of the epoch consumed (all ranks together).
        batch_size: the per-rank batch size (the block, unless `mix` has one).
    """
    if not isinstance(mix, ScheduledMix):
        return None
    block = mix.block or batch_size
    splice = mix.splice[1:] if mix.splice is not None and mix.splice[0] == epoch else None
    return ScheduleState(
        block=block,
        schedule=mix.weights.describe(),
        taken=_taken(mix, seed, epoch, consumed, block),
        splice=splice,
    )


@dataclass(frozen=True)
class MixResume:
    """What a resumed scheduled mix keeps from its state: the block and a splice (or None)."""

    block: int
    splice: tuple[int, int, tuple[int, ...]] | None = None


def resume_schedule(mix: object, seed: int, state: ResumeState) -> MixResume | None:
    """The resumed run's block and splice; a warning when the schedule changed.

    The schedule changed when a weight's description differs from the recorded one, or when
    the new weights would have drawn other counts before the recorded position. Then the
    epoch is spliced at the position: the samples taken so far stay, the new weights apply
    from there on.

    Raises:
        ResumeError: a state of a scheduled mix without its schedule record.
    """
    if not isinstance(mix, ScheduledMix):
        return None
    record = state.schedule
    if record is None:
        raise ResumeError(
            "the checkpoint's data position of this scheduled mix lacks its schedule record "
            "('schedule'): it was not saved by ShardDataModule.state_dict of a scheduled mix"
        )
    if len(record.taken) != len(mix.shards):
        raise ResumeError(
            f"the checkpoint's schedule record counts {len(record.taken)} datasets, this mix "
            f"has {len(mix.shards)}"
        )
    splice = (state.epoch, *record.splice) if record.splice is not None else None
    now = mix.weights.describe()
    try:
        again = _taken(replace(mix, splice=splice), seed, state.epoch, state.consumed, record.block)
    except ValueError:  # the new weights are not valid before the position: changed
        again = None
    if now == record.schedule and again == record.taken:
        return MixResume(record.block, splice)
    log.warning(
        "the mix's schedule changed at global sample position %d (epoch %d after %d of its %d "
        "samples, %s taken from each dataset): the samples before it were drawn with the old "
        "weights (%s), from it on the new ones apply (%s)",
        state.epoch * mix.total + state.consumed,
        state.epoch,
        state.consumed,
        mix.total,
        list(record.taken),
        record.schedule,
        now,
    )
    return MixResume(record.block, (state.epoch, state.consumed, record.taken))
