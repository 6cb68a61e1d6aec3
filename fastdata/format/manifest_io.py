"""Reading a manifest (`load_manifest`, `manifest_from_dict`) and checking it: untrusted input.

Apart from the dataclasses (`fastdata.format.manifest`), which the writer builds without reading
anything, so that the classes and the checks that build them do not import each other.
`manifest_from_dict` checks every field a reader relies on (counts are positive integers,
checksums are hex digests, a split counts no more classes than the manifest lists), and
`fastdata.format.manifest_paths` holds the one rule for paths (every file a manifest names
resolves inside the dataset root), which `load_manifest` applies. Each error names the shard
entry and says what to do.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from fastdata.format.fields import FieldError, FieldSpec, fields_from_json
from fastdata.format.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    ShardInfo,
    SkippedSample,
    SplitInfo,
    _is_remote,
    _join,
    log,
)
from fastdata.format.manifest_paths import check_data_root, check_files, check_name

__all__ = [
    "load_manifest",
    "manifest_from_dict",
    "split_from_dict",
]

#: Largest image side a manifest's raw_shape may give (JPEG's own limit); the writer's is lower.
MAX_SIDE = 65_535
#: Largest shard a manifest may list (1 TiB; the writer's shards are a few hundred MB).
MAX_SHARD_BYTES = 2**40
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SHARD_KEYS = {f for f in ShardInfo.__dataclass_fields__ if f != "label_map"}


def split_from_dict(root: str, name: str, sp: Any, num_classes: int) -> SplitInfo:
    """One split of `manifest_from_dict`, every shard entry checked (errors name the shard)."""
    if not isinstance(sp, dict) or not isinstance(sp.get("shards"), list):
        raise ManifestError(f"{root}: split {name!r} is malformed (needs a 'shards' list)")
    shards = [_shard_from_dict(root, name, number, s) for number, s in enumerate(sp["shards"])]
    counts = sp["class_counts"]
    if not isinstance(counts, list) or not all(_is_int(c) and c >= 0 for c in counts):
        raise ManifestError(f"{root}: split {name!r} class_counts must be counts (ints >= 0)")
    if len(counts) > num_classes:
        raise ManifestError(
            f"{root}: split {name!r} counts {len(counts)} classes, the manifest lists "
            f"{num_classes}; re-run `fastdata shard`"
        )
    fields = _fields(root, name, sp.get("fields"))
    listed = sum(shard.num_samples for shard in shards)
    # One label per sample: the counts add up to the samples. A split with boxes, masks or
    # multi-labels counts each class once per sample that holds it (any sum); a split without
    # labels (captions, other tools' shards) has no counts to check.
    kinds = [f.kind for f in fields.values()] if fields is not None else ["label"]
    one_label = "label" in kinds and not {"labels", "boxes", "mask"} & set(kinds)
    if one_label and sum(counts) != listed:  # a shard entry lost (or added) leaves the counts
        raise ManifestError(
            f"{root}: split {name!r} class_counts add up to {sum(counts)} samples, its shards "
            f"list {listed}; a tampered or broken manifest: re-run `fastdata shard`"
        )
    raw_shape = sp.get("raw_shape")
    if raw_shape is not None and (
        not isinstance(raw_shape, list)
        or len(raw_shape) != 3
        or not all(_is_int(v) and 0 < v <= MAX_SIDE for v in raw_shape[:2])
        or not (_is_int(raw_shape[2]) and raw_shape[2] == 3)
    ):
        raise ManifestError(
            f"{root}: split {name!r} raw_shape {raw_shape!r} is not [H, W, 3] with sides of 1 to "
            f"{MAX_SIDE} pixels; a tampered or broken manifest: re-run `fastdata shard`"
        )
    if not isinstance(sp["encoding"], str):
        raise ManifestError(f"{root}: split {name!r} encoding must be a string")
    if sp["encoding"] == "raw" and raw_shape is None:
        raise ManifestError(
            f"{root}: split {name!r} is raw but has no raw_shape (the pixels cannot be placed "
            "without it); a tampered or broken manifest: re-run `fastdata shard`"
        )
    return SplitInfo(
        shards=shards,
        class_counts=list(counts),
        encoding=sp["encoding"],
        raw_shape=sp.get("raw_shape"),
        image_stats=dict(sp.get("image_stats", {})),
        skipped=[SkippedSample(**s) for s in sp.get("skipped", [])],
        pixel_mean=sp.get("pixel_mean"),  # absent from older manifests: None
        pixel_std=sp.get("pixel_std"),
        fields=fields,
        source_ids=_source_ids_name(root, name, sp),
        source_ids_sha256=sp.get("source_ids_sha256"),
    )


def _source_ids_name(root: str, split: str, sp: dict[str, Any]) -> str | None:
    """A split's `source_ids` file name (None: absent), refused when it leaves the dataset or
    comes without a hex sha256."""
    name, digest = sp.get("source_ids"), sp.get("source_ids_sha256")
    if name is None:
        return None
    check_name(root, name, f"{root}: split {split!r} source_ids")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise ManifestError(
            f"{root}: split {split!r} has a source_ids file but its source_ids_sha256 "
            f"{digest!r} is not a hex sha256; a tampered or broken manifest: re-run `fastdata shard`"
        )
    return name


def check_class_ids(root: str, ids: Any, num_classes: int) -> list[int | str] | None:
    """The manifest's `class_ids` (None: absent): one int or str per class.

    Raises:
        ManifestError: not a list of ints or strings, one per class.
    """
    if ids is None:
        return None
    if (
        not isinstance(ids, list)
        or len(ids) != num_classes
        or not all(_is_int(i) or isinstance(i, str) for i in ids)
    ):
        raise ManifestError(
            f"{root}: class_ids must list one int or string id per class ({num_classes}); a "
            "tampered or broken manifest: re-run `fastdata shard`"
        )
    return list(ids)


def _fields(root: str, name: str, data: Any) -> dict[str, FieldSpec] | None:
    if data is None:
        return None
    try:
        return fields_from_json(data, f"{root}: split {name!r}")
    except FieldError as exc:
        raise ManifestError(
            f"{exc}; a tampered or broken manifest: re-run `fastdata shard`"
        ) from exc


def _shard_from_dict(root: str, split: str, number: int, entry: Any) -> ShardInfo:
    where = f"{root}: split {split!r} shard #{number}"
    if not isinstance(entry, dict):
        raise ManifestError(f"{where} is not an object")
    if isinstance(entry.get("name"), str):
        where = f"{root}: shard {entry['name']!r} (split {split!r})"
    unknown = set(entry) - _SHARD_KEYS
    missing = {"name", "index", "num_samples", "bytes", "sha256"} - set(entry)
    if unknown or missing:
        raise ManifestError(
            f"{where}: unknown fields {sorted(unknown)} / missing fields {sorted(missing)}"
        )
    count = entry["num_samples"]
    if not _is_int(count) or count < 1:
        raise ManifestError(
            f"{where}: num_samples must be a positive integer, got {count!r}; a tampered or "
            "broken manifest: re-run `fastdata shard`"
        )
    if not _is_int(entry["bytes"]) or not 0 <= entry["bytes"] <= MAX_SHARD_BYTES:
        raise ManifestError(
            f"{where}: bytes must be an integer from 0 to {MAX_SHARD_BYTES}, got "
            f"{entry['bytes']!r}; a tampered or broken manifest: re-run `fastdata shard`"
        )
    if count * 512 > entry["bytes"]:  # a plan of a claimed billion rows is never built
        raise ManifestError(
            f"{where}: num_samples {count} cannot fit in {entry['bytes']} bytes (a tar holds a "
            "512-byte header per member); a tampered or broken manifest: re-run `fastdata shard`"
        )
    if not isinstance(entry["sha256"], str) or not _HEX64.match(entry["sha256"]):
        raise ManifestError(f"{where}: sha256 {entry['sha256']!r} is not a hex sha256")
    for field_name in ("index_sha256", "sums_sha256"):
        value = entry.get(field_name)
        if value is not None and (not isinstance(value, str) or not _HEX64.match(value)):
            raise ManifestError(f"{where}: {field_name} {value!r} is not a hex sha256")
    for field_name in ("name", "index", "sums"):
        value = entry.get(field_name)
        if value is not None or field_name != "sums":  # name and index are never null
            check_name(root, value, f"{where}: {field_name}")
    if entry.get("sums") is not None and entry.get("sums_sha256") is None:
        raise ManifestError(f"{where}: has a 'sums' file but no 'sums_sha256'")
    return ShardInfo(**entry)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def manifest_from_dict(data: Any, root: str) -> Manifest:
    """Build from parsed JSON, checking every field a reader relies on.

    Raises:
        ManifestError: an unknown format, or a malformed field (names the split or shard,
            and the root), including a file name that leaves the dataset
            (`fastdata.format.manifest_paths.check_name`).
    """
    if not isinstance(data, dict):
        raise ManifestError(
            f"{root}: manifest is a JSON {type(data).__name__}, not an object; re-run "
            "`fastdata shard`"
        )
    if data.get("format") != FORMAT:
        raise ManifestError(f"{root}: not a fastdata manifest (format={data.get('format')!r})")
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ManifestError(
            f"{root}: manifest format_version {version!r} is newer than this fastdata reads "
            f"({FORMAT_VERSION}); upgrade fastdata"
        )
    try:
        classes = data["classes"]
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise ManifestError(f"{root}: 'classes' must be a list of names")
        if not isinstance(data["splits"], dict):
            raise ManifestError(f"{root}: 'splits' must be an object of split name -> split")
        splits = {
            name: split_from_dict(root, name, sp, len(classes))
            for name, sp in data["splits"].items()
        }
        return Manifest(
            root=root,
            classes=list(classes),
            splits=splits,
            source=dict(data["source"]),
            seed=int(data["seed"]),
            fastdata_version=str(data["fastdata_version"]),
            format=data["format"],
            format_version=version,
            data_root=check_data_root(root, data.get("data_root")),
            class_ids=check_class_ids(root, data.get("class_ids"), len(classes)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"{root}: manifest is missing or has a malformed field: {exc}") from exc


_WARNED_NO_INDEX_SUMS: set[str] = set()


def load_manifest(
    root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Manifest:
    """Load `ROOT/manifest.json` (ROOT may be a folder or the manifest file itself, or a URL).

    Args:
        root: a folder, its manifest.json, or a URL prefix (s3://, gs://, https://; needs
            `pip install "fastdata[remote]"`).
        storage_options: for a URL, passed to fsspec (e.g. `{"endpoint_url": ...}`).

    Raises:
        ManifestError: when there is no manifest there, or it is not a fastdata manifest.
        RemoteError: a remote manifest cannot be read after the retries (names the URL).
    """
    text_root = os.fspath(root)
    if text_root.endswith(".json"):
        text_root = text_root.rsplit("/", 1)[0] if "/" in text_root else "."
    url = _join(text_root, MANIFEST_NAME)
    try:
        if _is_remote(text_root):
            from fastdata.remote.fs import read_bytes  # fsspec only for remote manifests

            data = json.loads(read_bytes(url, storage_options))
        else:
            with open(url, encoding="utf-8") as f:
                data = json.load(f)
    except FileNotFoundError as exc:
        upload = " (an upload writes it last: is one still running?)" if _is_remote(url) else ""
        raise ManifestError(
            f"no {MANIFEST_NAME} in {text_root}{upload}: make the shards first with "
            f"`fastdata shard SOURCE INPUT {text_root}`"
        ) from exc
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise ManifestError(
            f"{url} is not valid UTF-8 JSON ({type(exc).__name__}: {exc}); re-run `fastdata shard`"
        ) from exc
    manifest = manifest_from_dict(data, root=text_root)
    check_files(manifest)
    shards = [s for split in manifest.splits.values() for s in split.shards]
    if any(s.index_sha256 is None for s in shards) and text_root not in _WARNED_NO_INDEX_SUMS:
        _WARNED_NO_INDEX_SUMS.add(text_root)
        log.warning(
            "%s: the manifest (format_version %d) carries no index checksums, so a changed "
            "index file goes unnoticed until it misplaces a sample; re-write it with this "
            "fastdata's `fastdata shard ... --overwrite` to add them",
            text_root,
            manifest.format_version,
        )
    return manifest
