"""An epoch's order of rows: plan rules 0, 1 and 7 of `fastdata.read.plan`.

`epoch_order` is rule 1 (the shard-by-shard order, shuffled by `fastdata.read.shuffle`), and
`mixed_order` / `scheduled_order` are rules 0 and 7 (several datasets in one split, drawn by
fixed counts or by a schedule of weights). Every draw comes from a generator seeded by (seed,
epoch, stream), so each rank draws the same order without talking to the others.
`fastdata.read.plan` cuts the order into each rank's batches and re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdata.read.schedule import ScheduledMix, scheduled_owners
from fastdata.read.shuffle import ShuffleMode, shuffle_rows

__all__ = ["EpochMix", "epoch_order", "mixed_order", "scheduled_order"]


def _rng(seed: int, epoch: int, *stream: int) -> np.random.Generator:
    """The generator of one random choice of the epoch; `stream` names the choice."""
    return np.random.default_rng([seed, epoch, 0x5EED, *stream])


def epoch_order(
    shard_sizes: list[int] | tuple[int, ...],
    seed: int,
    epoch: int,
    shuffle: bool,
    stream: tuple[int, ...] = (),
    mode: ShuffleMode = "shard",
    window: int | None = None,
) -> np.ndarray:
    """The epoch's order of rows (int64, rule 1); `stream` draws an independent order (rule 0).

    `mode` and `window` pick the training shuffle (`fastdata.read.shuffle.shuffle_rows`); the
    shard-by-shard order is drawn first in every mode, so "shard" is the order it always was.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else sizes
    if not shuffle:
        return np.arange(int(sizes.sum()), dtype=np.int64)
    rng = _rng(seed, epoch, *stream)
    parts = [starts[s] + rng.permutation(sizes[s]) for s in rng.permutation(len(sizes))]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return shuffle_rows(np.concatenate(parts).astype(np.int64), mode, window, rng)


@dataclass(frozen=True)
class EpochMix:
    """How a training epoch draws from datasets laid end to end in one split (rule 0).

    Attributes:
        shards: shards of each dataset, in split order (they sum to the split's shards).
        samples: rows each epoch takes from each dataset (more than it holds: up-sampling).
    """

    shards: tuple[int, ...]
    samples: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shards) != len(self.samples) or not self.shards:
            raise ValueError(
                f"need one sample count per dataset, got {self.shards}, {self.samples}"
            )
        if min(self.samples) < 0:
            raise ValueError(f"sample counts must be >= 0, got {self.samples}")

    @property
    def total(self) -> int:
        """Samples in every epoch."""
        return sum(self.samples)


# Rule 0's draws: streams (_MIX, dataset, copy, _ORDER | _SUBSET) and (_MIX, _OWNER). Each ends
# in a non-zero tag: numpy's SeedSequence ignores trailing zeros ([s, e, 0] seeds as [s, e]).
_MIX, _ORDER, _SUBSET, _OWNER = 0x313, 1, 2, 3


def mixed_order(
    shard_sizes: list[int] | tuple[int, ...],
    mix: EpochMix,
    seed: int,
    epoch: int,
    mode: ShuffleMode = "shard",
    window: int | None = None,
) -> np.ndarray:
    """The epoch's rows of a mix (int64, rule 0): `sum(mix.samples)` rows, repeats allowed.

    Each dataset's copies are shuffled by `mode` and `window` (rule 1) before the interleave.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    bounds = np.cumsum((0, *mix.shards))
    if bounds[-1] != len(sizes):
        raise ValueError(f"the mix names {bounds[-1]} shards, the split has {len(sizes)}")
    streams = []
    for i, wanted in enumerate(mix.samples):
        own = sizes[bounds[i] : bounds[i + 1]]
        first, held = int(sizes[: bounds[i]].sum()), int(own.sum())
        if wanted and not held:
            raise ValueError(f"dataset {i} of the mix has no samples to draw {wanted} from")
        copies, extra = divmod(wanted, held) if held else (0, 0)
        parts = [
            epoch_order(own, seed, epoch, True, (_MIX, i, c, _ORDER), mode, window)
            for c in range(copies)
        ]
        if extra:
            order = epoch_order(own, seed, epoch, True, (_MIX, i, copies, _ORDER), mode, window)
            chosen = _rng(seed, epoch, _MIX, i, copies, _SUBSET).choice(held, extra, replace=False)
            parts.append(order[np.sort(chosen)])  # a uniform subset, read in shard order
        streams.append(first + np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    owner = np.repeat(np.arange(len(streams)), mix.samples)
    owner = _rng(seed, epoch, _MIX, _OWNER).permutation(owner)
    out = np.empty(len(owner), dtype=np.int64)
    for i, stream in enumerate(streams):
        out[owner == i] = stream
    return out


def scheduled_order(
    shard_sizes: list[int] | tuple[int, ...],
    mix: ScheduledMix,
    seed: int,
    epoch: int,
    block: int,
    mode: ShuffleMode = "shard",
    window: int | None = None,
) -> np.ndarray:
    """The epoch's rows of a scheduled mix (int64, rule 7): `mix.total` rows, repeats allowed.

    Raises:
        ValueError: the shard counts do not fit the split, a dataset without samples has to
            give some, or a weight is not valid (`fastdata.read.schedule.MixWeights`).
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    bounds = np.cumsum((0, *mix.shards))
    if bounds[-1] != len(sizes):
        raise ValueError(f"the mix names {bounds[-1]} shards, the split has {len(sizes)}")
    owners = scheduled_owners(mix, seed, epoch, block)
    out = np.empty(len(owners), dtype=np.int64)
    for i in range(len(mix.shards)):
        where = np.flatnonzero(owners == i)
        own = sizes[bounds[i] : bounds[i + 1]]
        held = int(own.sum())
        if len(where) and not held:
            raise ValueError(f"dataset {i} of the mix has no samples to draw {len(where)} from")
        copies = -(-len(where) // held) if held else 0
        parts = [
            epoch_order(own, seed, epoch, True, (_MIX, i, c, _ORDER), mode, window)
            for c in range(copies)
        ]
        if parts:
            out[where] = int(sizes[: bounds[i]].sum()) + np.concatenate(parts)[: len(where)]
    return out
