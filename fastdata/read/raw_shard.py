"""Raw samples' pixels and labels in a few array operations: a whole shard (the memory backend's
store build, `read_raw_shard`) or one planned batch (the cpu backend, `gather_raw_batch`).

The per-sample path (`ShardReader.sample`) costs ~25 us of Python a sample with the GIL held;
`read_raw_shard` maps the tar once and gathers every sample's `rgb` and `lid` bytes by the
offsets of its DALI index (CIFAR-100 train, one thread: 0.4 s of CPU instead of 1.3 s). A shard
that does not fit that layout is left to the per-sample path, which names any bad sample.

The every-read checks of the per-sample path are made here as array operations: the index is
checked against the manifest's `index_sha256` (a mismatch is raised, naming the shard), and
every tar header (member name, size field) and label is compared at once; any mismatch hands
the shard to the per-sample path, whose error names the sample.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from fastdata.format import schema
from fastdata.format.integrity import (
    IntegrityError,
    open_regular,
    read_checked,
    scan_shard,
)
from fastdata.format.manifest import Manifest, SplitInfo
from fastdata.read.shard_index import parse_index
from fastdata.read.shardio import ShardReader, ShardReadError

__all__ = ["gather_raw_batch", "read_raw_shard"]


def read_raw_shard(
    manifest: Manifest, info: SplitInfo, shard: int, row: int, images: np.ndarray, meta: np.ndarray
) -> bool:
    """Copy a raw shard's pixels and labels into rows [row, row + n) in a few array operations.

    The per-sample path costs ~25 us of Python a sample (held GIL); this reads the tar in one
    call and gathers every sample's `rgb` and `lid` bytes by the index's offsets. Returns False,
    having written nothing, when the shard lacks the layout it needs (remote, no index, lines
    that differ, a component of another size, offsets past the end): the per-sample path then
    reads it and names any bad sample.
    """
    entry = info.shards[shard]
    if "://" in manifest.shard_url(entry) or info.raw_shape is None:
        return False
    try:
        text = read_checked(manifest.index_url(entry), entry.index_sha256, "index file").decode()
    except IntegrityError as exc:
        raise ShardReadError(entry.name, None, str(exc)) from exc
    except (OSError, ValueError):
        return False  # no index: the per-sample path scans the tar
    index = parse_index(text, entry.name)  # raises, naming the shard, for a malformed index
    layout = index.layout
    if len(index) != entry.num_samples:
        return False  # the per-sample path names the count mismatch
    if not layout or schema.RAW_EXT not in layout or schema.LABEL_EXT not in layout:
        return False
    try:
        with open(open_regular(manifest.shard_url(entry)), "rb") as f:
            data = np.memmap(f, dtype=np.uint8, mode="r")
    except (OSError, ValueError):
        return False  # the per-sample path says what is wrong with the file
    shape = tuple(int(v) for v in info.raw_shape)
    classes = len(entry.label_map) if entry.label_map is not None else manifest.num_classes
    bad = scan_shard(data, index.keys, layout, classes)
    if bad is None or bad.any():
        return False  # the per-sample path names each bad sample
    pixels = _gather(data, *layout[schema.RAW_EXT], math.prod(shape))
    ids = _gather(data, *layout[schema.LABEL_EXT], 16)
    if pixels is None or ids is None:
        return False
    n = entry.num_samples
    images[row : row + n] = pixels.reshape(n, *shape).transpose(0, 3, 1, 2)
    meta[row : row + n, :2] = ids.view("<i8")
    meta[row : row + n, 2] = 1
    return True


def _gather(
    data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, size: int
) -> np.ndarray | None:
    """The (n, size) bytes at `offsets`; None unless every component has `size` bytes in `data`."""
    if (sizes != size).any() or offsets.min() < 0 or offsets.max() + size > len(data):
        return None
    rows = as_strided(data, (len(data) - size + 1, size), (1, 1), writeable=False)  # a view
    return rows[offsets]


def gather_raw_batch(
    reader: ShardReader, refs: np.ndarray, shape: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray] | None:
    """Images (n, C, H, W) uint8 and manifest labels (n,) int64 of raw samples, gathered by the
    offsets of their shards' indexes: the per-sample path's result without its ~12 us of Python
    a sample (`ShardReader.sample`, label and pixel decoding, a transpose per image).

    Args:
        reader: the open shards.
        refs: (n, 2) int rows of (shard number, index in the shard).
        shape: the split's raw (H, W, C).

    Returns:
        None, having read nothing that counts, when any sample needs the per-sample path: its
        shard cannot be opened, has no uniform index, holds another image component first
        (`schema.image_component`), a component of another size, or the sample failed the
        checks made when the shard was opened (`ShardReader.uniform`). That path then reads the
        batch and names each bad sample.
    """
    height, width, channels = shape
    size = height * width * channels
    n = len(refs)
    images = np.empty((n, channels, height, width), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    shards = refs[:, 0]
    for shard in np.unique(shards).tolist():
        where = np.flatnonzero(shards == shard)
        rows = refs[where, 1]
        try:
            opened = reader.uniform(shard)
        except ShardReadError:
            return None  # the per-sample path raises or skips, naming the samples
        if opened is None:
            return None
        index, data, suspects = opened
        layout = index.layout
        assert layout is not None  # `uniform` returns only shards with one
        if schema.RAW_EXT not in layout or schema.LABEL_EXT not in layout:
            return None
        if any(
            ext in layout for ext in schema.IMAGE_EXTS[: schema.IMAGE_EXTS.index(schema.RAW_EXT)]
        ):
            return None  # `schema.image_component` would take another component
        if suspects and not suspects.isdisjoint(rows.tolist()):
            return None
        array = np.frombuffer(data, dtype=np.uint8) if len(data) else np.zeros(0, np.uint8)
        pixels = _gather(array, *(a[rows] for a in layout[schema.RAW_EXT]), size)
        ids = _gather(array, *(a[rows] for a in layout[schema.LABEL_EXT]), 16)
        if pixels is None or ids is None:
            return None
        images[where] = pixels.reshape(len(rows), height, width, channels).transpose(0, 3, 1, 2)
        stored = ids.view("<i8")[:, 0]  # within the shard's classes: checked by `scan_shard`
        label_map = reader.shards[shard].label_map
        labels[where] = stored if label_map is None else np.asarray(label_map)[stored]
    return images, labels
