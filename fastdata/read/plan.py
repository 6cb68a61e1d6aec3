"""The epoch plan: which samples, in which order, in which batches, on which rank, with which seeds.

Every backend (cpu, memory, dali, nvjpeg) consumes this one plan, so for the same arguments they
yield the same samples in the same order, and a resumed run (even with another world size or batch
size) continues with exactly the samples not yet consumed. Everything is a pure function of
(shard sizes, seed, epoch, rank, world size, batch size, samples consumed, and for a mix the
datasets' shard counts and draws, or a scheduled mix's weights, block and splice), so ranks and
workers compute it without talking to each other.

A sample is named by its *row*: its position in the split when the shards are laid end to end in
manifest order (row = first row of its shard + its index in the shard). A mix of datasets
(`fastdata.read.mix`) is one such split: every dataset's shards end to end, in the order given.

The rules:

0. Selection (a training mix, `EpochMix`, only). Each epoch takes exactly ``samples[i]`` rows of
   dataset i: whole copies of the dataset, each in its own rule-1 order, then a uniformly drawn
   subset of one more copy (kept in that copy's order), all from (seed, epoch, i), so the subset
   differs every epoch. The datasets' streams are then interleaved by a random permutation of
   their dataset numbers (also from (seed, epoch)), so every batch holds the shares of the mix
   up to sampling noise while each stream still reads its shards one or two at a time. The
   result is the epoch order; rules 2-6 apply to it unchanged. A mix whose weights change with
   the position (a schedule) is selected by rule 7 instead.
1. Epoch order. Training (no mix): the shards are put in a random order and the rows inside each
   shard permuted, both drawn from (seed, epoch): the shard-by-shard order. `PlanConfig.shuffle_mode`
   then picks (`fastdata.read.shuffle`): "shard" keeps it (a batch stays within one or two
   shards: right for fastdata's own shards, shuffled when written); "window" permutes it within
   consecutive blocks of at most `PlanConfig.window` samples spanning many shards (a batch draws
   from all of them, so shards written in class order still give mixed batches, while the shards
   read at once stay bounded); "full" permutes the whole split. All from (seed, epoch, window).
   Evaluation: row order (a mix's evaluation too: every row once).
   Carve (`PlanConfig.carve`, `fastdata.format.carve`): the order keeps only the rows of the
   carve's side (training: the rows not carved; val: the carved ones), in the same order; the
   carved rows are a pure function of the carve's seed, so rules 2-6 apply unchanged.
2. Consumption. The epoch is consumed from the front of its order, one *step* at a time: a step
   takes the next ``world_size * batch_size`` samples, rank r the r-th block of ``batch_size``.
   After k steps the first ``k * world_size * batch_size`` samples are consumed, whatever ranks
   took them, which is what a resume records (`consumed`), so it survives a change of world size
   or batch size.
3. Padding. The samples not yet consumed (all of them at the start of an epoch) are padded to a
   multiple of `world_size` by repeating their first ones (at most ``world_size - 1`` repeats),
   so every rank gets the same number of samples and batches and no rank waits at epoch end. The
   last step may be short: each rank then takes an equal block of it. Training: padding samples
   are ordinary repeats. Evaluation: they carry the label `PAD_LABEL` (-100, the ``ignore_index``
   of ``torch.nn.functional.cross_entropy``) so metrics exclude them and every sample counts once.
4. drop_last (training only): a short last step is dropped on every rank.
5. Seeds. The random augmentation of batch b uses the seed `batch_seed(seed, epoch, position)`,
   position = the index in the epoch order of the batch's first sample; per-sample draws (decode-
   time crops) use `sample_seed(seed, epoch, position)` of each sample. A sample's crop therefore
   depends on where it sits in the epoch, not on which rank or worker decodes it.
6. Workers. DataLoader worker w of W produces the rank's batches w, w + W, ... which the
   DataLoader returns in order, so batches do not depend on the number of workers.
7. Scheduled selection (a training mix with a scheduled weight, `ScheduledMix`,
   `fastdata.read.schedule`), in place of rule 0. The p-th sample of epoch e's order is at
   global sample position ``e * E + p`` (E: the epoch size, the same every epoch). The order is
   cut into blocks of `ScheduledMix.block` samples (the per-rank batch size the run started
   with) from the epoch's start; block b takes from dataset i exactly
   ``share_counts(len(b), weights at its first global position)[i]`` samples, arranged in the
   block by a permutation drawn from (seed, epoch). With rule 2 every rank's batch is a block
   (until the epoch's short last step), so every batch on every rank holds its block's exact
   counts. Dataset i's stream is its rule-1 copies (the same draws as rule 0's) end to end, cut
   after the samples its blocks take: a stream's first samples do not depend on how many it
   gives, so a down-sampled dataset gives the first samples of a copy ("shard" shuffle: whole
   shards in random order). A splice (a resume with a changed schedule at position P of the
   epoch) keeps the recorded counts taken before P, starts a block at P, and continues each
   stream after its taken samples. Rules 2-6 apply unchanged.

The orders of rules 0, 1 and 7 are drawn in `fastdata.read.order` (re-exported here); this
module cuts them into each rank's batches.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from fastdata.format.carve import Carve
from fastdata.read.order import EpochMix, epoch_order, mixed_order, scheduled_order
from fastdata.read.schedule import ScheduledMix
from fastdata.read.shuffle import SHUFFLES, ShuffleMode, check_shuffle

__all__ = [
    "PAD_LABEL",
    "EpochMix",
    "EpochPlan",
    "PlanConfig",
    "batch_seed",
    "epoch_order",
    "mixed_order",
    "plan_epoch",
    "rows_to_refs",
    "sample_seed",
    "scheduled_order",
    "worker_batch_numbers",
]

#: Label of an evaluation padding sample (ignored by cross_entropy's default ignore_index).
PAD_LABEL = -100


def _mix(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # non-negative int64


def batch_seed(seed: int, epoch: int, position: int) -> int:
    """Seed of the device augmentation of the batch starting at `position` of the epoch order."""
    return _mix("fastdata-batch", seed, epoch, position)


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """Seed of the decode-time draws (crop box, flip) of the sample at `position`."""
    return _mix("fastdata-sample", seed, epoch, position)


def rows_to_refs(rows: np.ndarray, shard_sizes: list[int] | tuple[int, ...]) -> np.ndarray:
    """(shard number, index in shard) of each row, as an (n, 2) int64 array."""
    ends = np.cumsum(np.asarray(shard_sizes, dtype=np.int64))
    shards = np.searchsorted(ends, rows, side="right")
    starts = ends[shards] - np.asarray(shard_sizes, dtype=np.int64)[shards]
    return np.stack([shards, rows - starts], axis=1).astype(np.int64)


@dataclass(frozen=True)
class EpochPlan:
    """One rank's batches of one epoch (rules in the module docstring).

    Attributes:
        rows: per batch, the rows of its samples (int64).
        positions: per batch, the position of each sample in the epoch order (int64); a padding
            sample has the position of the sample it repeats plus the epoch's length.
        padding: per batch, True where the sample is padding (rule 3).
        seeds: per batch, its augmentation seed (rule 5).
        epoch: the epoch.
        consumed: samples of the epoch consumed before this plan starts (resume).
        steps_before: steps taken before this plan starts (each rank had that many batches).
        world_size: number of ranks sharing the epoch.
        total: samples in the epoch.
    """

    rows: tuple[np.ndarray, ...]
    positions: tuple[np.ndarray, ...]
    padding: tuple[np.ndarray, ...]
    seeds: tuple[int, ...]
    epoch: int
    consumed: int
    steps_before: int
    world_size: int
    total: int

    def __len__(self) -> int:
        """Batches of this rank in the epoch, counting the `steps_before` already taken."""
        return self.steps_before + len(self.rows)

    def consumed_after(self, batches: int) -> int:
        """Samples of the epoch consumed once every rank has taken `batches` of this plan."""
        taken = self.world_size * sum(len(b) for b in self.rows[:batches])
        return min(self.total, self.consumed + taken)


@dataclass(frozen=True)
class PlanConfig:
    """What fixes a rank's epoch plans, besides the epoch and the position in it.

    Attributes:
        seed: base seed.
        rank: this process's global rank.
        world_size: number of ranks.
        batch_size: samples per batch on each rank.
        shuffle: training order (rule 1) or row order (evaluation; padding is then marked).
        drop_last: drop a short last step (rule 4).
        mix: the datasets of a training mix and the rows each epoch takes from each (rule 0),
            or a scheduled mix (rule 7); None: every row once.
        carve: keep only one side of a carved val split (rule 1); None: every row.
        shuffle_mode: the training shuffle (rule 1, `fastdata.read.shuffle`): "shard",
            "window" or "full".
        window: the "window" shuffle's block size in samples (None: the whole split). Every rank
            must use the same one: it is part of the epoch order.

    Raises:
        ValueError: a batch size below 1, a rank outside [0, world_size), a carve with a mix, an
            unknown shuffle mode or a window below 1.
    """

    seed: int
    rank: int
    world_size: int
    batch_size: int
    shuffle: bool
    drop_last: bool = False
    mix: EpochMix | ScheduledMix | None = None
    carve: Carve | None = None
    shuffle_mode: ShuffleMode = "shard"
    window: int | None = None

    def __post_init__(self) -> None:
        if self.shuffle_mode not in SHUFFLES:
            raise ValueError(f"shuffle_mode must be one of {SHUFFLES}, got {self.shuffle_mode!r}")
        if self.window is not None:
            check_shuffle(self.window)
        if self.mix is not None and self.carve is not None:
            raise ValueError("a carved val split and a mix cannot be combined")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                "need world_size >= 1 and 0 <= rank < world_size, "
                f"got {self.rank}, {self.world_size}"
            )


def plan_epoch(
    shard_sizes: list[int] | tuple[int, ...],
    config: PlanConfig,
    epoch: int,
    consumed: int = 0,
    steps_before: int = 0,
) -> EpochPlan:
    """This rank's plan of an epoch, starting after `consumed` samples (rules 0-5, 7).

    Args:
        shard_sizes: samples per shard, in manifest order.
        config: seed, rank, world size, batch size, order and mix (`PlanConfig`).
        epoch: epoch number.
        consumed: samples of this epoch already consumed (rule 2), for a resume.
        steps_before: batches each rank already took this epoch (only counted by `len`).
    """
    seed, rank, world_size = config.seed, config.rank, config.world_size
    batch_size, drop_last = config.batch_size, config.drop_last
    order = _order(shard_sizes, config, epoch)
    total = len(order)
    if not 0 <= consumed <= total:
        raise ValueError(f"consumed must be in [0, {total}] (samples in the epoch), got {consumed}")
    remaining = total - consumed
    padded = world_size * math.ceil(remaining / world_size)
    # Positions in the epoch order of the rank-interleaved, padded remainder (rules 2 and 3).
    positions = consumed + np.arange(padded, dtype=np.int64) % max(1, remaining)
    is_pad = np.arange(padded) >= remaining
    step = world_size * batch_size
    rows, pos, pads, seeds = [], [], [], []
    for start in range(0, padded, step):
        block = min(step, padded - start) // world_size  # this step's batch size on every rank
        if drop_last and block < batch_size:
            break
        lo = start + rank * block
        where = positions[lo : lo + block]
        rows.append(order[where])
        pos.append(where + is_pad[lo : lo + block] * total)
        pads.append(is_pad[lo : lo + block])
        seeds.append(batch_seed(seed, epoch, int(where[0])))
    return EpochPlan(
        tuple(rows),
        tuple(pos),
        tuple(pads),
        tuple(seeds),
        epoch,
        consumed,
        steps_before,
        world_size,
        total,
    )


def _order(shard_sizes: list[int] | tuple[int, ...], config: PlanConfig, epoch: int) -> np.ndarray:
    """The epoch's order of rows (rules 0, 1 and 7), carved (rule 1)."""
    seed, mix, shuffle = config.seed, config.mix, config.shuffle
    mode, window = config.shuffle_mode, config.window
    if isinstance(mix, ScheduledMix) and shuffle:
        block = mix.block or config.batch_size
        order = scheduled_order(shard_sizes, mix, seed, epoch, block, mode, window)
    elif mix is not None and shuffle:
        order = mixed_order(shard_sizes, mix, seed, epoch, mode, window)
    else:
        order = epoch_order(shard_sizes, seed, epoch, shuffle, (), mode, window)
    if config.carve is not None:
        order = config.carve.select(order, int(sum(shard_sizes)))
    return order


def worker_batch_numbers(total_batches: int, start: int, worker: int, num_workers: int) -> range:
    """The batch numbers worker `worker` produces from batch `start` on (rule 6)."""
    return range(start + worker, total_batches, max(1, num_workers))
