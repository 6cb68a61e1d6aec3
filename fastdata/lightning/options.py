"""`ShardDataModule`'s grouped options, and their normalization into the module's settings.

One public way per option: a group where an option carries several values, a flat keyword where
one value is all there is. Grouped the way MosaicML Streaming groups a `StreamingDataset`'s: a
dataset object per root (Streaming's `Stream`), and one settings object per concern::

    from fastdata import CacheSettings, ShardDataModule, ShardSet
    from fastdata.read import WorkerSettings

    dm = ShardDataModule(
        [ShardSet("shards/photos", weight=3.0), ShardSet("shards/sketches")],
        batch_size=64,
        workers=WorkerSettings(num_workers=4, prefetch_factor=2, decode_threads=2),
        cache=CacheSettings(dir="/scratch/cache", limit="200GB"),
    )

| group | what it holds |
|-------|---------------|
| `ShardSet(root, weight=)`, in a list `root` | a dataset of a mix and its weight |
| `workers=WorkerSettings(...)` (`fastdata.read.WorkerSettings`) | `num_workers`, `prefetch_factor`, `decode_threads` (each an int or "auto"), `pin_memory`, `persistent_workers`, `timeout`, `mp_context`; None: counts measured, the rest defaults |
| `cache=CacheSettings(dir, limit)` | a remote dataset's shard cache; None (or a field None): $FASTDATA_CACHE_DIR / $FASTDATA_CACHE_LIMIT, else the built-in defaults |

The environment variables are the cache's values where nothing is given (a node's admin sets them
once for every job), not a second way to pass them: a `CacheSettings` field given wins.
`CacheSettings` lives here, not in `fastdata.remote.config`: importing `fastdata.remote` imports
fsspec, an optional dependency the DataModule must not need.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from fastdata.format.carve import check_fraction
from fastdata.lightning.prepare import ShardSource
from fastdata.read.base import WorkerSettings
from fastdata.read.mix import mix_roots
from fastdata.read.schedule import Schedule, Weight, check_weight
from fastdata.write import ShardOptions

__all__ = [
    "AUTO_WORKERS",
    "CacheSettings",
    "RootSpec",
    "ShardSet",
    "check_cache_room",
    "resolve_groups",
    "resolve_roots",
    "resolve_val",
    "shard_cache",
]

#: `ShardDataModule(workers=None)`: worker and prefetch counts measured (`fastdata.tune`).
AUTO_WORKERS = WorkerSettings(num_workers="auto", prefetch_factor="auto")


@dataclass(frozen=True)
class ShardSet:
    """One shard folder (or URL prefix) of a `ShardDataModule`, with its weight in a mix.

    Like Streaming's `Stream`: ``ShardDataModule([ShardSet(a, weight=3), ShardSet(b)])`` draws
    three samples of `a` for each of `b` in every training epoch (`fastdata.read.mix`).

    Args:
        root: the shard folder (holding manifest.json), or a URL prefix of remote shards.
        weight: its share of a mix's training epochs, > 0 (relative to the others'); or a
            `fastdata.read.schedule.Schedule` / a function of the global sample position: a
            curriculum (plan rule 7). A lone ShardSet (not in a list) is no mix and keeps the
            default 1.0.

    Raises:
        ValueError: a fixed weight that is not a finite number > 0.
        TypeError: a root that is not a path or a string.
    """

    root: str
    _: KW_ONLY
    weight: Weight = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)):
            raise TypeError(f"ShardSet root must be a path or URL, got {self.root!r}")
        object.__setattr__(self, "root", os.fspath(self.root))
        object.__setattr__(
            self, "weight", check_weight(f"ShardSet({self.root!r}) weight", self.weight)
        )


@dataclass(frozen=True)
class CacheSettings:
    """Where a remote dataset's shards are cached on this node, and how much that cache holds.

    Args:
        dir: the node-local cache folder (give every rank of a node the same one); None:
            $FASTDATA_CACHE_DIR, else ~/.cache/fastdata/shards.
        limit: most bytes the cache may hold, as bytes or a size such as "50GB"; None: its
            default (`fastdata.remote.DEFAULT_LIMIT`, or $FASTDATA_CACHE_LIMIT).
    """

    dir: str | None = None
    limit: int | str | None = None

    def __post_init__(self) -> None:
        if self.dir is not None:
            if not isinstance(self.dir, (str, os.PathLike)):
                raise TypeError(f"CacheSettings dir must be a path, got {self.dir!r}")
            object.__setattr__(self, "dir", os.fspath(self.dir))
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, (int, str))
        ):
            raise TypeError(
                f"CacheSettings limit must be bytes or a size like '50GB', got {self.limit!r}"
            )


def _allow_in_checkpoints() -> None:
    """Let `torch.load(weights_only=True)` (the default since torch 2.6, used by Lightning's
    `load_from_checkpoint` and `fit(ckpt_path=)`) rebuild these settings when a DataModule's
    `save_hyperparameters()` put them into a checkpoint: plain data, no code runs."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:
        add_safe_globals(
            [ShardSet, CacheSettings, WorkerSettings, ShardSource, ShardOptions, Schedule]
        )


_allow_in_checkpoints()

#: What `ShardDataModule(root=...)` takes: a root, a `ShardSet`, or a list of either (a mix).
RootSpec = Sequence[ShardSet | str | os.PathLike[str]] | ShardSet | str | os.PathLike[str]


def resolve_roots(
    root: RootSpec, epoch_samples: int | None, val: float | None = None
) -> tuple[list[str], bool, list[Weight] | None, float | None]:
    """(the roots, whether they are a mix, the mix's weights, `val` checked) of the arguments.

    A list is a mix, even of one dataset; its `ShardSet`s carry their weights (plain roots in
    it weigh 1.0; a list of plain roots: None, equal weights). A lone `ShardSet` is its root.

    Raises:
        ValueError: a lone ShardSet with a weight, or what `fastdata.read.mix.mix_roots`
            refuses (`epoch_samples=` without a list); a bad `val` (`resolve_val`).
        TypeError: an entry that is neither a path, a string nor a `ShardSet`.
    """
    roots, mixed, weights = _roots(root, epoch_samples)
    return roots, mixed, weights, resolve_val(val, mixed)


def _roots(
    root: RootSpec, epoch_samples: int | None
) -> tuple[list[str], bool, list[Weight] | None]:
    if isinstance(root, ShardSet):
        if root.weight != 1.0:
            weight = f"{root.weight:g}" if isinstance(root.weight, float) else "..."
            raise ValueError(
                f"ShardSet({root.root!r}, weight={weight}) alone is no mix: a weight "
                "weighs a dataset against others, so pass a list, e.g. "
                f"[ShardSet({root.root!r}, weight={weight}), ShardSet(OTHER)]"
            )
        root = root.root
    if isinstance(root, (str, os.PathLike)):
        roots, mixed = mix_roots(root, None, epoch_samples)
        return roots, mixed, None
    if not isinstance(root, Sequence):
        raise TypeError(
            f"root must be a shard folder, a URL, a ShardSet or a list of them, got {root!r}"
        )
    items = list(root)
    for item in items:
        if not isinstance(item, (str, os.PathLike, ShardSet)):
            raise TypeError(f"a mix's entries are shard folders, URLs or ShardSets, got {item!r}")
    weights = None
    if any(isinstance(item, ShardSet) for item in items):
        weights = [item.weight if isinstance(item, ShardSet) else 1.0 for item in items]
    plain = [item.root if isinstance(item, ShardSet) else item for item in items]
    roots, mixed = mix_roots(plain, weights, epoch_samples)
    return roots, mixed, weights


def resolve_groups(
    workers: WorkerSettings | None, cache: CacheSettings | None
) -> tuple[WorkerSettings, CacheSettings]:
    """The `workers=` and `cache=` groups, type-checked, None replaced by their defaults
    (`AUTO_WORKERS`; a `CacheSettings()` of the environment's or built-in defaults).

    Raises:
        TypeError: a group of the wrong type (names the type it must be).
    """
    for name, group, kind in (
        ("workers", workers, WorkerSettings),
        ("cache", cache, CacheSettings),
    ):
        if group is not None and not isinstance(group, kind):
            raise TypeError(
                f"{name}= must be a {kind.__module__}.{kind.__name__} or None, got {group!r}"
            )
    return workers or AUTO_WORKERS, cache or CacheSettings()


def resolve_val(val: float | None, mixed: bool) -> float | None:
    """`val=` checked: None, or a fraction of the training split to carve out.

    Raises:
        TypeError: a split name (a split is named with ``splits={"val": NAME}``).
        ValueError: a fraction outside (0, 1), or a fraction with a mix (`mixed`).
    """
    if val is None:
        return val
    if isinstance(val, str):
        raise TypeError(
            f"val= is a fraction of the training split to carve out, got {val!r}; name a split "
            f"with splits={{'val': {val!r}}}"
        )
    fraction = check_fraction(val)
    if mixed:
        raise ValueError(
            f"val={val!r} cannot carve a mix of datasets; shard each with "
            "`fastdata shard ... --val-fraction F`, or pass val= a split name"
        )
    return fraction


def shard_cache(roots: Sequence[str], cache: CacheSettings) -> Any:
    """The `fastdata.remote.ShardCache` the settings ask for, or None: local roots, or no
    setting given (the reader then uses its default cache, `ShardCache.default()`, for a remote
    root). A field left None takes the same default as that cache: $FASTDATA_CACHE_DIR /
    $FASTDATA_CACHE_LIMIT, else ~/.cache/fastdata/shards / 50 GB. Imports `fastdata.remote`
    (fsspec) only for a remote root."""
    remote = any("://" in root for root in roots)
    if not remote or (cache.dir is None and cache.limit is None):
        return None
    from fastdata.remote import CACHE_LIMIT_ENV, DEFAULT_LIMIT, ShardCache, default_cache_dir

    limit = cache.limit or os.environ.get(CACHE_LIMIT_ENV, DEFAULT_LIMIT)
    return ShardCache(cache.dir or default_cache_dir(), limit)


_INDEX_LINE = 128  # bytes of a shard's index per sample, at most (a few components a line)


def check_cache_room(
    cache: Any,
    manifest: Any,
    splits: Sequence[str],
    ranks_per_node: int | None,
    workers: int | str,
    persistent: bool | None,
) -> None:
    """Refuse (at `setup()`) a remote dataset's cache limit below what the node's readers pin.

    Each shard reader keeps up to `fastdata.read.shardio.pins_needed` remote shards pinned; a
    rank reads through one reader per loader worker (one without workers), and a persistent
    training worker through a second one at each epoch's end (it reads the next epoch's first
    batch ahead). `workers="auto"` counts one worker: the tuner decides the count later.

    Args:
        cache: the `ShardCache` the settings make (None: the default one, for a remote root).
        manifest: the dataset (a mix's too: its remote shards are counted).
        splits: the split names the module reads.
        ranks_per_node: processes of the node that share the cache (the Trainer's devices);
            None: $LOCAL_WORLD_SIZE (torchrun sets it), else 1.
        workers: loader workers per rank (an int, or "auto").
        persistent: the `WorkerSettings.persistent_workers` given (None: when there are workers).

    Raises:
        ValueError: the limit is below the readers' need; names the size to set.
    """
    # Per split (a split's readers are done before the next split's start, but for a mid-epoch
    # validation); a pinned shard's index is cached beside it, and the manifest has no index
    # sizes: allow a line of a few components per sample.
    sizes = [
        [
            info.bytes + _INDEX_LINE * info.num_samples
            for info in manifest.split(name).shards
            if "://" in manifest.shard_url(info)
        ]
        for name in dict.fromkeys(splits)
    ]
    sizes = [split for split in sizes if split]
    if not sizes:
        return
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if cache is None:
        from fastdata.remote import ShardCache

        cache = ShardCache.default()
    from fastdata.read.shardio import pins_needed

    count = workers if isinstance(workers, int) else 1
    per_worker = 2 if count > 0 and persistent is not False else 1
    readers = ranks_per_node * max(1, count) * per_worker
    who = f"{ranks_per_node} rank(s) on the node x {max(1, count)} loader reader(s)"
    if per_worker == 2:
        who += " x 2 (each persistent worker reads the next epoch's first batch ahead)"
    pins = pins_needed(manifest)
    split = max(sizes, key=lambda split: min(readers * pins * max(split), sum(split)))
    cache.check_limit(max(split), readers, pins, who, whole=sum(split))
