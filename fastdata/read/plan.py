"""The per-rank plan of an epoch: which samples of which shards go into which batch.

Everything here is a pure function of (split sizes, seed, epoch, rank, world size, batch size), so
every rank and every worker computes the same plan without talking to each other, and a resumed
run recomputes exactly the batches it has not consumed yet.

The rules:

1. Epoch order. Training: the shards are put in a random order and the samples inside each shard
   are permuted, both drawn from (seed, epoch). Shards were already pre-shuffled across at write
   time, so this gives a fresh order every epoch while a batch stays within one or two shards
   (local reads). Evaluation: file order.
2. Ranks. The epoch order is cut into `world_size` contiguous spans of `ceil(N / world_size)`
   samples. The last span is padded by wrapping around to the start of the epoch order (at most
   `world_size - 1` samples are seen twice in an epoch), so no sample is lost and every rank has
   the same number of samples, hence the same number of batches: no rank waits at epoch end.
3. Batches. Each span is cut into batches of `batch_size`; with `drop_last` the partial batch at
   the end of every rank is dropped (the same on every rank).
4. Workers. DataLoader worker `w` of `W` produces the rank's batches `start + w`, `start + w + W`,
   ... which the DataLoader returns in order; `start` is the number of batches already consumed
   (mid-epoch resume).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["epoch_order", "num_batches", "rank_batches", "rank_span", "worker_batch_numbers"]


def epoch_order(shard_sizes: list[int], seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's sample order as an (N, 2) int64 array of (shard number, index in shard)."""
    parts = []
    if shuffle:
        rng = np.random.default_rng([seed, epoch, 0x5EED])
        shards = rng.permutation(len(shard_sizes))
    else:
        rng = None
        shards = np.arange(len(shard_sizes))
    for shard in shards:
        size = shard_sizes[shard]
        inner = rng.permutation(size) if rng is not None else np.arange(size)
        parts.append(np.stack([np.full(size, shard), inner], axis=1))
    if not parts:
        return np.zeros((0, 2), dtype=np.int64)
    return np.concatenate(parts).astype(np.int64)


def rank_span(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's contiguous share of `order`, padded by wrapping (rule 2)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
    total = len(order)
    if total == 0:
        return order
    per_rank = math.ceil(total / world_size)
    positions = np.arange(rank * per_rank, (rank + 1) * per_rank) % total
    return order[positions]


def num_batches(total: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches every rank yields in one epoch of a split of `total` samples."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    per_rank = math.ceil(total / world_size) if total else 0
    return per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)


def rank_batches(span: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """Cut a rank's span into batches (rule 3)."""
    count = num_batches(len(span), 1, batch_size, drop_last)
    return [span[i * batch_size : (i + 1) * batch_size] for i in range(count)]


def worker_batch_numbers(total_batches: int, start: int, worker: int, num_workers: int) -> range:
    """The batch numbers worker `worker` produces (rule 4)."""
    workers = max(1, num_workers)
    return range(start + worker, total_batches, workers)
