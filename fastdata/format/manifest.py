"""The manifest: everything a reader needs to know about a folder of shards.

A manifest is written once, last, by the shard writer (`fastdata.write`), so a folder that has a
`manifest.json` holds a complete dataset. Readers never list the folder: shard names, sample
counts, byte sizes, checksums, classes and the sample encoding all come from here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastdata.format.fields import FieldSpec, default_fields, fields_to_json

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "ManifestError",
    "ShardInfo",
    "SkippedSample",
    "SplitInfo",
    "resolve_splits",
]

log = logging.getLogger("fastdata")

FORMAT = "fastdata-shards"
# 2: shards carry `index_sha256` (and `sums` / `sums_sha256`); version 1 manifests still load.
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
VAL_SPLITS = ("val", "validation")  # the names a validation split is looked up under


class ManifestError(ValueError):
    """A manifest is missing, unreadable or of an unknown format."""


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard of a split.

    Args:
        name: file name of the tar, relative to the manifest's folder.
        index: file name of the DALI index file for this tar.
        num_samples: samples in the shard.
        bytes: size of the tar file.
        sha256: hex digest of the tar file.
        label_map: only in a mix of datasets (`fastdata.read.mix`, never saved): the mix's label
            of each label stored in this shard (classes merged by name); None: labels as stored.
        index_sha256: hex digest of the index file, checked whenever a reader loads it; None in
            manifests written before it existed (format_version 1).
        sums: file name of the per-sample digest list (`fastdata.format.integrity`) checked by
            `verify_samples=True`; None for shards written without one.
        sums_sha256: hex digest of the `sums` file.
    """

    name: str
    index: str
    num_samples: int
    bytes: int
    sha256: str
    label_map: tuple[int, ...] | None = None
    index_sha256: str | None = None
    sums: str | None = None
    sums_sha256: str | None = None

    def map_label(self, label: int) -> int:
        """The manifest's label of a label stored in this shard (unchanged outside a mix).

        Raises:
            ValueError: the stored label is not one of the shard's dataset's classes.
        """
        if self.label_map is None:
            return label
        if not 0 <= label < len(self.label_map):
            raise ValueError(
                f"label {label} is outside its dataset's {len(self.label_map)} classes; "
                "run `fastdata verify` on that shard folder"
            )
        return self.label_map[label]


@dataclass(frozen=True)
class SkippedSample:
    """A source sample that the writer could not encode and left out (named for the user)."""

    origin: str
    reason: str


@dataclass(frozen=True)
class SplitInfo:
    """One split (train / val / test) of a dataset.

    Args:
        shards: the split's shards, in file order.
        class_counts: samples per class index.
        encoding: how images are stored: "raw" (`rgb` component), "png", "jpeg" (kept or re-encoded
            JPEG, `jpg` component), or "mixed" (JPEG kept as is, other formats converted to PNG).
        raw_shape: (H, W, C) of every sample when all share one shape (always set for "raw").
        image_stats: min / max / mean height and width of the stored images.
        skipped: source samples left out because they could not be read or decoded.
        pixel_mean: per-channel (RGB) mean of the stored pixels, 0..255 scale, measured while
            writing; the default normalization. None in manifests written before it existed.
        pixel_std: per-channel standard deviation, as `pixel_mean`.
        fields: what each sample holds beyond the classification pair (`fastdata.format.fields`: name
            -> kind and tar components); None: an image and a label (every manifest written
            before fields existed, and every classification split). Read it as `field_specs`.
        source_ids: file name (beside the manifest) of the split's per-sample source ids
            (`fastdata.read.source_ids`: sample key -> COCO image id, or image path relative to
            the source folder); None: the source has none (CIFAR, `fastdata index`'d shards),
            and in manifests written before it existed.
        source_ids_sha256: hex digest of the `source_ids` file.
    """

    shards: list[ShardInfo]
    class_counts: list[int]
    encoding: str
    raw_shape: list[int] | None = None
    image_stats: dict[str, float] = field(default_factory=dict)
    skipped: list[SkippedSample] = field(default_factory=list)
    pixel_mean: list[float] | None = None
    pixel_std: list[float] | None = None
    fields: dict[str, FieldSpec] | None = None
    source_ids: str | None = None
    source_ids_sha256: str | None = None

    @property
    def field_specs(self) -> dict[str, FieldSpec]:
        """The split's fields: `fields`, or an image (this split's encoding) and a label."""
        if self.fields is not None:
            return dict(self.fields)
        from fastdata.format.schema import exts_of_encoding

        try:
            exts = exts_of_encoding(self.encoding)
        except ValueError:
            exts = ("jpg", "png", "rgb")
        return default_fields(exts)

    @property
    def num_samples(self) -> int:
        """Total samples in the split."""
        return sum(s.num_samples for s in self.shards)


@dataclass(frozen=True)
class Manifest:
    """A shard folder's description. Load with `load_manifest`, never build one by hand in user code.

    Args:
        root: folder holding the manifest and the shards (not serialized). A URL prefix
            ("http://host/path", "s3://bucket/path") is allowed for remote shards.
        classes: class names; label `i` is `classes[i]`.
        splits: split name -> `SplitInfo`.
        source: what the shards were made from (kind, path, parameters).
        seed: the seed of the cross-shard pre-shuffle.
        fastdata_version: version of the writer.
        format: always `FORMAT`.
        format_version: `FORMAT_VERSION` of the writer.
        data_root: where the tars are when they live elsewhere (`fastdata index` of another
            tool's read-only or remote shards): an absolute folder or a URL prefix that every
            shard's `name` is relative to; the index and digest files stay beside the manifest.
            None (every dataset `fastdata shard` writes): the tars are in `root`.
        class_ids: the source's own id behind each class index (COCO: the category id of
            `classes[i]`), so predictions map back; None: the class index is the only id.
    """

    root: str
    classes: list[str]
    splits: dict[str, SplitInfo]
    source: dict[str, Any]
    seed: int
    fastdata_version: str
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    data_root: str | None = None
    class_ids: list[int | str] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def split(self, name: str) -> SplitInfo:
        """The named split, or a ValueError that lists the splits there are."""
        if name not in self.splits:
            raise ValueError(
                f"split {name!r} is not in the manifest at {self.root}; it has {sorted(self.splits)}"
            )
        return self.splits[name]

    def shard_url(self, shard: ShardInfo) -> str:
        """Path or URL of a shard's tar file (under `data_root` when the manifest has one)."""
        return _join(self.data_root or self.root, shard.name)

    def index_url(self, shard: ShardInfo) -> str:
        """Path or URL of a shard's DALI index file."""
        return _join(self.root, shard.index)

    def sums_url(self, shard: ShardInfo) -> str | None:
        """Path or URL of a shard's per-sample digest file (None: the shard has none)."""
        return _join(self.root, shard.sums) if shard.sums else None

    def source_ids_url(self, split: str) -> str | None:
        """Path or URL of a split's source-id file (None: the split has none)."""
        name = self.split(split).source_ids
        return _join(self.root, name) if name else None

    def to_json(self) -> str:
        """Serialize (without `root`), with sorted keys so the file is deterministic.

        Raises:
            ValueError: for a mix (`fastdata.read.mix`): it is built from its roots, never saved.
        """
        if self.source.get("kind") == "mix":
            raise ValueError(
                "a mix of datasets is a virtual manifest built from its roots and weights "
                "(`fastdata.read.mix.load_mix`); it cannot be saved: save each dataset on its own"
            )
        data = asdict(self)
        data.pop("root")
        if data["data_root"] is None:
            del data["data_root"]  # the tars beside the manifest: the file is as it always was
        if data["class_ids"] is None:
            del data["class_ids"]  # optional fields: absent, an older manifest stays as it was
        for name, split in data["splits"].items():
            fields = self.splits[name].fields
            if fields is None:
                del split["fields"]  # classification splits stay as they were written before
            else:
                split["fields"] = fields_to_json(fields)
            if split["source_ids"] is None:
                del split["source_ids"], split["source_ids_sha256"]
            for shard in split["shards"]:
                del shard["label_map"]  # only a mix has one, and a mix is never saved
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write `manifest.json` into `folder` atomically (temporary name, then rename)."""
        path = Path(folder) / MANIFEST_NAME
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path


def resolve_splits(
    manifest: Manifest, given: Mapping[str, str] | None = None, val: str | float | None = None
) -> dict[str, str]:
    """Split role ("train", "val", "test") -> split name in `manifest`.

    Roles not in `given` get the split of their own name ("val": the first of `VAL_SPLITS`)
    when the manifest has one; a role it lacks is left out (never another role's split).

    Args:
        manifest: the dataset.
        given: roles named by the user (`ShardDataModule(splits=...)`).
        val: a split name for the "val" role (e.g. "test"), or a fraction carved from the
            training split (`fastdata.format.carve`): the "val" role then names the training split
            itself, and the caller reads each role's side of the carve. None: as above.

    Raises:
        ValueError: a split named in `given` or `val` is not in the manifest (names the root and
            lists the splits there are); `val` contradicts `given["val"]`; a fraction `val` with
            no training split.
    """
    names = dict(given or {})
    available = manifest.splits
    if "train" not in names and "train" in available:
        names["train"] = "train"
    if val is not None:
        if isinstance(val, str):
            wanted = val
        elif "train" not in names:
            raise ValueError(
                f"val={val!r} carves from the training split, but {manifest.root} has none "
                f"(splits: {sorted(available)}); pass splits={{'train': NAME}}"
            )
        else:
            wanted = names["train"]
        if names.get("val", wanted) != wanted:
            raise ValueError(
                f"val={val!r} and splits={{'val': {names['val']!r}}} disagree: pass only one"
            )
        names["val"] = wanted
    if "val" not in names:
        found = next((s for s in VAL_SPLITS if s in available), None)
        if found:
            names["val"] = found
    if "test" not in names and "test" in available:
        names["test"] = "test"
    for role, split in names.items():
        if split and split not in available:
            raise ValueError(
                f"{role} split {split!r} is not in {manifest.root} (splits: {sorted(available)})"
            )
    return {role: split for role, split in names.items() if split}


def _is_remote(root: str) -> bool:
    return "://" in root  # read through fsspec: http(s)://, s3://, gs://, ... where reachable


def _join(root: str, name: str) -> str:
    if _is_remote(name) or os.path.isabs(name):
        return name  # a mix names each shard by its full path or URL
    if _is_remote(root):
        return root.rstrip("/") + "/" + name
    return os.path.join(root, name)
