"""How a training epoch is shuffled (plan rule 1): by shard, within a window, or fully.

Shards written by other tools are often in class order (a `webdataset.ShardWriter` loop over
sorted class folders), so an order that keeps a batch within one or two shards sees one or two
classes per step. The *window* shuffle, after MosaicML Streaming's ``py1br`` block shuffle and
WebDataset's shuffle buffer, fixes that while keeping reads local: the shard-by-shard order
(shards in random order, rows permuted inside each) is cut into consecutive blocks of random
sizes between ``3 * window // 4`` and ``window`` samples, and each block is permuted. A sample
therefore lands less than ``window`` positions from its place in the shard-by-shard order, so a
step reads only the shards within ``window`` samples of it: the shards "open" at once stay
bounded (about ``(step + 2 * window) / shard size + 1``) while a batch draws from every shard of
its block. Random block sizes keep block edges off shard edges (Streaming's lesson).

Choices (`SHUFFLES`):

- ``"window"``: the above. Its size in samples is given, or sized from what the node can hold
  (`size_window`): a share of the free memory (page cache) for local shards, of the cache limit
  for remote ones, the whole split for the memory backend (a full permutation); for a split of
  more shards than a reader keeps open (`fastdata.read.shardio.open_limit`: every local shard
  up to 256; 2 remote pinned), at most what keeps a step's shards open, since re-opening a
  shard per batch costs far more.
- ``"shard"``: the shard-by-shard order alone (fastdata's own shards are shuffled when written,
  so a batch from one or two shards is already a fair sample; the cheapest reads).
- ``"full"``: a uniform permutation of the split (where random reads are cheap: the memory
  backend, or a local split of at most 256 shards, all kept open; on more, batches re-open
  shards).

Everything is a pure function of (shard sizes, seed, epoch, window), so the plan's other rules
(consumption, padding, elastic resume, seeds, workers) hold unchanged for every backend.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import psutil

from fastdata.read.shardio import open_limit, pins_needed

__all__ = [
    "SHUFFLES",
    "WINDOW_SHARE",
    "ShuffleMode",
    "check_shuffle",
    "node_window",
    "shuffle_rows",
    "size_window",
]

ShuffleMode = Literal["window", "shard", "full"]

#: The training shuffles a plan knows (`fastdata.read.plan`, rule 1).
SHUFFLES: tuple[str, ...] = ("window", "shard", "full")

#: Share of the free memory (local shards) or of the cache limit (remote shards) one window may
#: fill. A step reads the shards within a window either side of it, so about twice this share is
#: in use at once; the rest is left to the process, the decoded batches and other ranks.
WINDOW_SHARE = 0.2


def check_shuffle(shuffle: object) -> tuple[ShuffleMode, int | None]:
    """(mode, window) of a user's `shuffle=` value; window None: sized from the node.

    Args:
        shuffle: "window", "shard", "full", or a window size in samples (an int >= 1).

    Raises:
        ValueError: another string, or a window below 1.
        TypeError: neither a string nor an int.
    """
    if isinstance(shuffle, bool) or not isinstance(shuffle, (str, int)):
        raise TypeError(
            f"shuffle must be one of {', '.join(map(repr, SHUFFLES))} or a window size in "
            f"samples (an int), got {shuffle!r}"
        )
    if isinstance(shuffle, int):
        if shuffle < 1:
            raise ValueError(f"a shuffle window holds at least 1 sample, got shuffle={shuffle}")
        return "window", shuffle
    if shuffle not in SHUFFLES:
        raise ValueError(
            f"shuffle must be one of {', '.join(map(repr, SHUFFLES))} or a window size in "
            f"samples (an int), got {shuffle!r}"
        )
    return shuffle, None  # type: ignore[return-value]  # checked against SHUFFLES


def size_window(
    shard_sizes: Sequence[int],
    shard_bytes: Sequence[int],
    available_bytes: int,
    cache_limit: int | None = None,
    resident: bool = False,
    share: float = WINDOW_SHARE,
    open_shards: int | None = None,
) -> int:
    """The default window of a split, in samples: what the node can hold of its shards.

    Args:
        shard_sizes: samples per shard.
        shard_bytes: bytes per shard (the manifest's), giving the mean bytes per sample.
        available_bytes: the node's free memory (``psutil.virtual_memory().available``): local
            shards stay in the page cache while their window is read.
        cache_limit: remote shards: the shard cache's limit in bytes, which bounds the window
            instead of the free memory; None for local shards.
        resident: the split is held decoded in memory (the memory backend): the whole split,
            i.e. a full permutation.
        share: the share of the room one window may fill (`WINDOW_SHARE`).
        open_shards: shards a reader keeps open at once (`fastdata.read.shardio.open_limit`:
            local, every shard up to `LOCAL_OPEN_LIMIT`; remote, the shards it pins in the
            cache). A split of more shards gets a window of at most
            ``(open_shards / 2 - 1)`` median shards, so the two blocks a step can touch stay
            open together: a larger window re-opens (and re-scans) shards for nearly every
            batch (CIFAR-100 in 10 shards: an epoch of 7 s took over a minute). None: no
            such bound.

    Returns:
        A window between the largest shard's size (the "shard" order's reach: never less) and
        the split's size (a full permutation).
    """
    total = int(sum(shard_sizes))
    if resident or total == 0:
        return max(total, 1)
    per_sample = max(1.0, sum(shard_bytes) / total)
    room = available_bytes if cache_limit is None else min(cache_limit, available_bytes)
    window = int(share * room / per_sample)
    if open_shards is not None and len(shard_sizes) > open_shards:
        window = min(window, int((open_shards // 2 - 1) * float(np.median(shard_sizes))))
    return max(1, min(total, max(window, max(shard_sizes))))


def node_window(manifest: Any, split: str, cache: Any = None, resident: bool = False) -> int:
    """`size_window` of a split on this node: its free memory now, or for remote shards the
    shard cache's limit (`cache.limit_bytes`, else $FASTDATA_CACHE_LIMIT, else the default),
    bounded by the shards a reader keeps open (remote: those it pins, `pins_needed`).

    Args:
        manifest: the `fastdata.format.manifest.Manifest` holding the split.
        split: the split's name.
        cache: the remote shard cache (`fastdata.remote.ShardCache`) or None.
        resident: the split is held decoded in memory (the memory backend).
    """
    shards = manifest.split(split).shards
    limit, open_shards = None, open_limit(manifest, split)
    if any("://" in manifest.shard_url(s) for s in shards):
        from fastdata.remote.config import CACHE_LIMIT_ENV, DEFAULT_LIMIT, parse_size

        given = getattr(cache, "limit_bytes", None)
        limit = given or parse_size(os.environ.get(CACHE_LIMIT_ENV, DEFAULT_LIMIT))
        open_shards = pins_needed(manifest)  # remote shards a reader keeps open (pinned)
    return size_window(
        [s.num_samples for s in shards],
        [s.bytes for s in shards],
        psutil.virtual_memory().available,
        limit,
        resident,
        open_shards=open_shards,
    )


def shuffle_rows(
    base: np.ndarray, mode: ShuffleMode, window: int | None, rng: np.random.Generator
) -> np.ndarray:
    """The training order of `base` (the shard-by-shard order) under `mode`.

    "shard" returns `base`; "full" a uniform permutation; "window" permutes consecutive blocks
    of `base` of random sizes in [ceil(3 * window / 4), window] (the first block: in [1, window], a
    random stagger), so every row moves less than `window` positions.
    """
    n = len(base)
    if mode == "shard" or n < 2:
        return base
    if mode == "full" or window is None or window >= n:
        return base[rng.permutation(n)]
    if mode != "window":
        raise ValueError(f"unknown shuffle {mode!r}; use one of {SHUFFLES}")
    low = math.ceil(3 * window / 4)
    sizes = rng.integers(low, window + 1, size=n // low + 2)
    sizes[0] = rng.integers(1, window + 1)  # stagger: block edges differ every epoch
    blocks = np.repeat(np.arange(len(sizes)), sizes)[:n]
    return base[np.lexsort((rng.random(n), blocks))]
