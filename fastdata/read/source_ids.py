"""Batch keys: which samples a batch holds, by sample key and by the source's own id.

With ``keys=True`` (`ShardDataModule(..., keys=True)`, `LoaderSpec.keys`) every backend hands
each batch's sample keys over with it (the shard's ``__key__``, e.g. ``val_00000012``; ``None``
for an evaluation padding row), and `EpochLoader` adds the source's own id of each key, read
from the split's source-id file (`fastdata.write.source_ids`: a COCO image id, a folder's or
list's image path relative to its root; ``None`` where the source has none, e.g. CIFAR or a
`fastdata index`'d foreign dataset, whose batches carry their keys only):

- a dict batch gains ``batch["key"]`` and ``batch["source_id"]`` (lists, one per row);
- a classification batch is ``(images, labels, ids)`` with ``ids = {"key": [...],
  "source_id": [...]}`` instead of ``(images, labels)``.

A mix of datasets (`fastdata.read.mix`) carries keys only (its source ids are None), and two of
its datasets may have equal keys. Lists and dicts travel through Lightning's `transfer_batch_to_device` and the DataModule's
`on_after_batch_transfer` unchanged. Keys are a function of the epoch plan, so they are the same
for every backend, and after a resume or on another number of ranks each sample keeps its key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastdata.format.manifest import Manifest

__all__ = [
    "BATCH_IDS",
    "SourceIdError",
    "SourceIds",
    "batch_keys",
    "load_source_ids",
    "row_keys",
]

#: The entries `keys=True` adds to a dict batch (and names in a classification batch's ids).
BATCH_IDS = ("key", "source_id")


class SourceIdError(ValueError):
    """A split's source-id file is unreadable, altered, or not one (names the file)."""


class SourceIds:
    """Sample key -> the source's own id, for one split (empty: the source has none).

    Args:
        ids: key -> id.
    """

    def __init__(self, ids: Mapping[str, int | str]) -> None:
        self.ids = dict(ids)

    def __call__(self, keys: list[str | None]) -> list[int | str | None]:
        """The source id of each key (None for a padding row, or a key without one)."""
        get = self.ids.get
        return [None if key is None else get(key) for key in keys]

    def attach(self, batch: Any) -> Any:
        """`batch` as `keys=True` hands it out (see the module docstring): a dict batch with a
        ``source_id`` list beside its ``key`` list; a backend's ``(images, labels, keys)``
        classification batch as ``(images, labels, {"key": keys, "source_id": ids})``."""
        if isinstance(batch, Mapping):
            batch["source_id"] = self(batch["key"])
            return batch
        images, labels, keys = batch
        if isinstance(keys, Mapping):  # a clip batch's {"key": ..., "start": ...}
            return images, labels, {**keys, "source_id": self(keys["key"])}
        return images, labels, {"key": keys, "source_id": self(keys)}


def load_source_ids(manifest: Manifest, split: str, cache: Any = None) -> SourceIds:
    """The source ids of `split` (empty when its manifest names no source-id file).

    Args:
        manifest: the dataset's manifest.
        split: the split's name.
        cache: a remote dataset's `ShardCache` (storage options, retries); None: defaults.

    Raises:
        SourceIdError: the file cannot be read, differs from the manifest's sha256, or is not
            a source-id file of this split (names the file; re-run `fastdata shard`).
    """
    info = manifest.split(split)
    url = manifest.source_ids_url(split)
    if url is None:
        return SourceIds({})
    from fastdata.format.integrity import IntegrityError, check_digest, read_checked

    try:
        if "://" in url:
            from fastdata.remote.fs import read_bytes

            options = cache.storage_options if cache is not None else None
            data = read_bytes(url, options)
            check_digest(data, info.source_ids_sha256, "source-id file", url)
        else:
            data = read_checked(url, info.source_ids_sha256, "source-id file")
        parsed = json.loads(data)
    except (OSError, ValueError, IntegrityError) as exc:
        raise SourceIdError(
            f"source-id file {url} of split {split!r} cannot be used ({exc}); re-run "
            "`fastdata shard`, or pass keys=False"
        ) from exc
    ids = parsed.get("ids") if isinstance(parsed, dict) else None
    if not isinstance(ids, dict) or parsed.get("split") != split:
        raise SourceIdError(
            f"{url} is not the source-id file of split {split!r}; re-run `fastdata shard`"
        )
    return SourceIds(ids)


def row_keys(spec: Any) -> list[str]:
    """The key of every row of a loader's split, in row order (shard by shard): for the
    backends that gather rows from a resident store (memory) instead of reading samples.

    Args:
        spec: the `LoaderSpec` (its manifest, split, shard sizes and cache).
    """
    from fastdata.read.shardio import ShardReader

    reader = ShardReader(spec.manifest, spec.split, cache=spec.cache)
    try:
        return [reader.key(s, i) for s, n in enumerate(spec.shard_sizes) for i in range(n)]
    finally:
        reader.close()


def batch_keys(table: list[str], rows: list[int], padded: list[bool] | None) -> list[str | None]:
    """The keys of a batch gathered from `rows` of a split (`row_keys`); None for padding."""
    if padded is None:
        return [table[r] for r in rows]
    return [None if p else table[r] for r, p in zip(rows, padded, strict=True)]
