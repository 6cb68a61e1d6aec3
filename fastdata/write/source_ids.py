"""The per-split source-id file: each sample key's id in the source's own terms.

`fastdata shard` records, for sources that have one, each sample's own id (`SourceItem.source_id`:
a COCO image id, a folder's or list's image path relative to its root) beside the shards, one
JSON file per split named in the manifest (`SplitInfo.source_ids`, with its sha256), so that the
shards' bytes stay as they always were. Readers map batch keys through it
(`fastdata.read.source_ids`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SOURCE_IDS_FORMAT", "source_ids_name", "write_source_ids"]

SOURCE_IDS_FORMAT = "fastdata-source-ids"


def source_ids_name(split: str) -> str:
    """The file name of `split`'s source ids (beside the manifest)."""
    return f"{split}-source-ids.json"


def source_ids_text(split: str, ids: Mapping[str, int | str]) -> str:
    """The file's text: deterministic (sorted keys), so a re-run writes the same bytes."""
    data = {"format": SOURCE_IDS_FORMAT, "version": 1, "split": split, "ids": dict(ids)}
    return json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"


def write_source_ids(
    out_dir: Path, split: str, ids: Mapping[str, int | str]
) -> tuple[str, str] | None:
    """Write `split`'s source ids into `out_dir` (atomically); (file name, sha256), or None
    (nothing written) when `ids` is empty."""
    if not ids:
        return None
    name = source_ids_name(split)
    text = source_ids_text(split, ids)
    path = out_dir / name
    tmp = path.with_name(f"{name}.tmp-{os.getpid()}")  # renamed into place: never half-written
    tmp.write_text(text)
    os.replace(tmp, path)
    return name, hashlib.sha256(text.encode()).hexdigest()
