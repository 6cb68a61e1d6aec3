"""`ShardDataModule`'s grouped options, and their normalization into the module's settings.

Grouped the way MosaicML Streaming groups a `StreamingDataset`'s: a dataset object per root
(Streaming's `Stream`), and one settings object per concern, accepted beside the flat keywords
(which keep working: many scripts and Lightning configs use them)::

    from fastdata import CacheSettings, ShardDataModule, ShardSet
    from fastdata.read import WorkerSettings

    dm = ShardDataModule(
        [ShardSet("shards/photos", weight=3.0), ShardSet("shards/sketches")],
        batch_size=64,
        workers=WorkerSettings(num_workers=4, prefetch_factor=2, decode_threads=2),
        cache=CacheSettings(dir="/scratch/cache", limit="200GB"),
    )

| group | flat keywords it replaces |
|-------|---------------------------|
| `ShardSet(root, weight=)` in a list `root` | `weights=` |
| `workers=WorkerSettings(...)` (`fastdata.read.WorkerSettings`) | `num_workers`, `prefetch_factor`, `decode_threads`, `loader_timeout`, `mp_context` (and it adds `pin_memory`, `persistent_workers`) |
| `cache=CacheSettings(dir, limit)` | `cache_dir`, `cache_limit` |

A group and one of its flat keywords set to other than its default is an error naming both
(a flat keyword left at its default is not "given": Lightning's CLI and `save_hyperparameters`
pass every default back). `CacheSettings` lives here, not in `fastdata.remote.config`: importing
`fastdata.remote` imports fsspec, an optional dependency the DataModule must not need.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from fastdata.format.carve import check_fraction
from fastdata.read.base import WorkerSettings
from fastdata.read.mix import mix_roots

__all__ = [
    "CACHE_KEYWORDS",
    "WORKER_KEYWORDS",
    "CacheSettings",
    "RootSpec",
    "ShardSet",
    "apply_groups",
    "check_cache_room",
    "resolve_roots",
    "resolve_val",
    "shard_cache",
]

#: flat `ShardDataModule` keyword -> the `WorkerSettings` field it is.
WORKER_KEYWORDS: dict[str, str] = {
    "num_workers": "num_workers",
    "prefetch_factor": "prefetch_factor",
    "decode_threads": "decode_threads",
    "loader_timeout": "timeout",
    "mp_context": "mp_context",
}
#: flat `ShardDataModule` keyword -> the `CacheSettings` field it is.
CACHE_KEYWORDS: dict[str, str] = {"cache_dir": "dir", "cache_limit": "limit"}


@dataclass(frozen=True)
class ShardSet:
    """One shard folder (or URL prefix) of a `ShardDataModule`, with its weight in a mix.

    Like Streaming's `Stream`: ``ShardDataModule([ShardSet(a, weight=3), ShardSet(b)])`` draws
    three samples of `a` for each of `b` in every training epoch (`fastdata.read.mix`).

    Args:
        root: the shard folder (holding manifest.json), or a URL prefix of remote shards.
        weight: its share of a mix's training epochs, > 0 (relative to the others'); a lone
            ShardSet (not in a list) is no mix and keeps the default 1.0.

    Raises:
        ValueError: a weight that is not a finite number > 0.
        TypeError: a root that is not a path or a string.
    """

    root: str
    _: KW_ONLY
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)):
            raise TypeError(f"ShardSet root must be a path or URL, got {self.root!r}")
        object.__setattr__(self, "root", os.fspath(self.root))
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)):
            raise ValueError(
                f"ShardSet({self.root!r}) weight must be a number, got {self.weight!r}"
            )
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"ShardSet({self.root!r}) weight must be > 0, got {self.weight!r}")
        object.__setattr__(self, "weight", float(self.weight))


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
        add_safe_globals([ShardSet, CacheSettings, WorkerSettings])


_allow_in_checkpoints()

#: What `ShardDataModule(root=...)` takes: a root, a `ShardSet`, or a list of either (a mix).
RootSpec = Sequence[ShardSet | str | os.PathLike[str]] | ShardSet | str | os.PathLike[str]


def resolve_roots(
    root: RootSpec,
    weights: Sequence[float] | None,
    epoch_samples: int | None,
    val: str | float | None = None,
) -> tuple[list[str], bool, list[float] | None, str | float | None]:
    """(the roots, whether they are a mix, the mix's weights, `val` checked) of the arguments.

    A list is a mix, even of one dataset; its `ShardSet`s carry their weights (plain roots in
    it weigh 1.0). A lone `ShardSet` is its root.

    Raises:
        ValueError: `weights=` together with ShardSets (both weigh the mix), a lone ShardSet
            with a weight, or what `fastdata.read.mix.mix_roots` refuses (bad weights,
            `weights=`/`epoch_samples=` without a list).
        TypeError: an entry that is neither a path, a string nor a `ShardSet`.
        ValueError: a bad `val` (`resolve_val`).
    """
    roots, mixed, weights = _roots(root, weights, epoch_samples)
    return roots, mixed, weights, resolve_val(val, mixed)


def _roots(
    root: RootSpec, weights: Sequence[float] | None, epoch_samples: int | None
) -> tuple[list[str], bool, list[float] | None]:
    if isinstance(root, ShardSet):
        if root.weight != 1.0:
            raise ValueError(
                f"ShardSet({root.root!r}, weight={root.weight:g}) alone is no mix: a weight "
                "weighs a dataset against others, so pass a list, e.g. "
                f"[ShardSet({root.root!r}, weight={root.weight:g}), ShardSet(OTHER)]"
            )
        root = root.root
    if isinstance(root, (str, os.PathLike)):
        roots, mixed = mix_roots(root, weights, epoch_samples)
        return roots, mixed, None if weights is None else list(weights)
    if not isinstance(root, Sequence):
        raise TypeError(
            f"root must be a shard folder, a URL, a ShardSet or a list of them, got {root!r}"
        )
    items = list(root)
    for item in items:
        if not isinstance(item, (str, os.PathLike, ShardSet)):
            raise TypeError(f"a mix's entries are shard folders, URLs or ShardSets, got {item!r}")
    sets = [item for item in items if isinstance(item, ShardSet)]
    if sets and weights is not None:
        raise ValueError(
            f"weights={list(weights)!r} and the ShardSets' weights both weigh the mix: pass "
            "each dataset's weight as ShardSet(root, weight=W) and drop weights="
        )
    if sets:
        weights = [item.weight if isinstance(item, ShardSet) else 1.0 for item in items]
    plain = [item.root if isinstance(item, ShardSet) else item for item in items]
    roots, mixed = mix_roots(plain, weights, epoch_samples)
    return roots, mixed, None if weights is None else [float(w) for w in weights]


def apply_groups(
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
    workers: WorkerSettings | None,
    cache: CacheSettings | None,
) -> dict[str, Any]:
    """The flat keyword values (`given`), with each group given spread over its keywords.

    Args:
        given: the keyword arguments as passed (the constructor's `locals()`); only those of
            `WORKER_KEYWORDS` and `CACHE_KEYWORDS` are read.
        defaults: their defaults (a value equal to its default counts as not given).
        workers: the `workers=` group, or None.
        cache: the `cache=` group, or None.

    Raises:
        TypeError: a group of the wrong type (names the type it must be).
        ValueError: a group and one of its flat keywords both given (names both).
    """
    out = {keyword: given[keyword] for keyword in (*WORKER_KEYWORDS, *CACHE_KEYWORDS)}
    groups = (
        ("workers", workers, WorkerSettings, WORKER_KEYWORDS),
        ("cache", cache, CacheSettings, CACHE_KEYWORDS),
    )
    for name, group, kind, keywords in groups:
        if group is None:
            continue
        if not isinstance(group, kind):
            raise TypeError(f"{name}= must be a {kind.__module__}.{kind.__name__}, got {group!r}")
        for keyword, field in keywords.items():
            if given[keyword] != defaults[keyword]:
                raise ValueError(
                    f"{name}={group!r} and {keyword}={given[keyword]!r} both set "
                    f"{kind.__name__}.{field}: pass one of them (e.g. "
                    f"{name}={kind.__name__}(..., {field}={given[keyword]!r}))"
                )
            out[keyword] = getattr(group, field)
    return out


def resolve_val(val: str | float | None, mixed: bool) -> str | float | None:
    """`val=` checked: None, a split name, or a fraction of the training split to carve out.

    Raises:
        ValueError: a fraction outside (0, 1), or a fraction with a mix (`mixed`).
    """
    if val is None or isinstance(val, str):
        return val
    fraction = check_fraction(val)
    if mixed:
        raise ValueError(
            f"val={val!r} cannot carve a mix of datasets; shard each with "
            "`fastdata shard ... --val-fraction F`, or pass val= a split name"
        )
    return fraction


def shard_cache(
    roots: Sequence[str], cache_dir: str | os.PathLike[str] | None, cache_limit: int | str | None
) -> Any:
    """The `fastdata.remote.ShardCache` the settings ask for, or None: local roots, or no
    setting given (the reader then uses its default cache for a remote root). Imports
    `fastdata.remote` (fsspec) only for a remote root."""
    remote = any("://" in root for root in roots)
    if not remote or (cache_dir is None and cache_limit is None):
        return None
    from fastdata.remote import DEFAULT_LIMIT, ShardCache, default_cache_dir

    return ShardCache(cache_dir or default_cache_dir(), cache_limit or DEFAULT_LIMIT)


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
