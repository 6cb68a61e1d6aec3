"""The per-split source-id file: each sample key's id in the source's own terms.

`fastdata shard` records, for sources that have one, each sample's own id (`SourceItem.source_id`:
a COCO image id, a folder's or list's image path relative to its root) beside the shards, one
JSON file per split named in the manifest (`SplitInfo.source_ids`, with its sha256), so that the
shards' bytes stay as they always were. Readers map batch keys through it
(`fastdata.read.source_ids`).

A split of 100 million samples would need its 100 million ids in memory to sort them at once.
Each shard writes its own ids sorted (`write_id_run`, beside its `done` record), and the split's
file is a streamed merge of those runs (`write_source_ids`): at most `MERGE_FAN_IN` runs are open
at a time (more are merged in rounds into temporary runs first), so the memory held is a line per
open run, whatever the split's size. The bytes are those `json.dumps(..., sort_keys=True)` gives
for the whole mapping.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

__all__ = [
    "MERGE_FAN_IN",
    "SOURCE_IDS_FORMAT",
    "source_ids_name",
    "write_id_run",
    "write_source_ids",
]

SOURCE_IDS_FORMAT = "fastdata-source-ids"
MERGE_FAN_IN = 128  # runs open at once while merging (file descriptors: the limit is often 1024)


def source_ids_name(split: str) -> str:
    """The file name of `split`'s source ids (beside the manifest)."""
    return f"{split}-source-ids.json"


def source_ids_text(split: str, ids: Mapping[str, int | str]) -> str:
    """The file's text: deterministic (sorted keys), so a re-run writes the same bytes."""
    data = {"format": SOURCE_IDS_FORMAT, "version": 1, "split": split, "ids": dict(ids)}
    return json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"


def write_id_run(path: Path, ids: Mapping[str, int | str]) -> None:
    """Write one shard's ids as a sorted run (a line per key: the key, a tab, the id's JSON),
    atomically."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            file.writelines(_line(key, ids[key]) for key in sorted(ids))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _line(key: str, value: int | str) -> str:
    if "\t" in key or "\n" in key:
        raise ValueError(f"a sample key cannot hold a tab or a newline: {key!r}")
    return f"{key}\t{json.dumps(value)}\n"


def write_source_ids(
    out_dir: Path,
    split: str,
    runs: Sequence[Path | Mapping[str, int | str]],
    scratch: Path | None = None,
) -> tuple[str, str] | None:
    """Write `split`'s source ids into `out_dir` (atomically) from sorted runs; (file name,
    sha256), or None (nothing written) when the runs hold no id.

    Args:
        runs: each a run file (`write_id_run`) or a mapping (an older `done` record's ids).
        scratch: where rounds of merging put their temporary runs (default: `out_dir`); they
            are removed before this returns.
    """
    runs = _merged_down(list(runs), scratch or out_dir)
    name = source_ids_name(split)
    path = out_dir / name
    tmp = path.with_name(f"{name}.tmp-{os.getpid()}")  # renamed into place: never half-written
    digest = hashlib.sha256()
    written = 0
    try:
        with contextlib.ExitStack() as stack, open(tmp, "wb") as out:

            def emit(text: str) -> None:
                data = text.encode("utf-8")
                digest.update(data)
                out.write(data)

            # json.dumps(data, sort_keys=True, separators=(",", ":")): "format" < "ids" < "split"
            emit(f'{{"format":{json.dumps(SOURCE_IDS_FORMAT)},"ids":{{')
            for key, value in _merge([_open_run(stack, run) for run in runs]):
                emit(f"{',' if written else ''}{json.dumps(key)}:{value}")
                written += 1
            emit(f'}},"split":{json.dumps(split)},"version":1}}\n')
        if not written:
            tmp.unlink()
            return None
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        _remove_scratch(runs)
    return name, digest.hexdigest()


class _Scratch:
    """A temporary run made by a round of merging (removed when the merge is done)."""

    def __init__(self, path: Path) -> None:
        self.path = path


def _merged_down(
    runs: list[Path | Mapping[str, int | str] | _Scratch], scratch: Path
) -> list[Path | Mapping[str, int | str] | _Scratch]:
    """Merge groups of `MERGE_FAN_IN` runs into temporary runs until at most that many are left."""
    rounds = 0
    merged: list[Path | Mapping[str, int | str] | _Scratch] = []
    try:
        while len(runs) > MERGE_FAN_IN:
            merged = []
            for start in range(0, len(runs), MERGE_FAN_IN):
                target = _Scratch(scratch / f".source-ids-{os.getpid()}-{rounds}-{start}.run")
                merged.append(target)
                with contextlib.ExitStack() as stack, open(target.path, "w") as out:
                    group = runs[start : start + MERGE_FAN_IN]
                    pairs = _merge([_open_run(stack, run) for run in group])
                    out.writelines(f"{key}\t{value}\n" for key, value in pairs)
            _remove_scratch(runs)  # merged into this round's runs
            runs, rounds = merged, rounds + 1
    except BaseException:
        _remove_scratch([*runs, *merged])
        raise
    return runs


def _remove_scratch(runs: Iterable[object]) -> None:
    for run in runs:
        if isinstance(run, _Scratch):
            run.path.unlink(missing_ok=True)


def _open_run(
    stack: contextlib.ExitStack, run: Path | Mapping[str, int | str] | _Scratch
) -> Iterator[tuple[str, str]]:
    """A run's (key, id JSON) pairs in key order."""
    if isinstance(run, Mapping):
        return ((key, json.dumps(run[key])) for key in sorted(run))
    path = run.path if isinstance(run, _Scratch) else run
    file = stack.enter_context(open(path, encoding="utf-8"))
    return _pairs(file, path)


def _pairs(lines: Iterable[str], path: Path) -> Iterator[tuple[str, str]]:
    for number, line in enumerate(lines, start=1):
        key, tab, value = line.rstrip("\n").partition("\t")
        if not tab:
            raise ValueError(f"{path}:{number}: not a source-id run line (key, tab, id)")
        yield key, value


def _merge(runs: list[Iterator[tuple[str, str]]]) -> Iterator[tuple[str, str]]:
    """The runs' pairs in key order (keys are unique across runs: each sample is in one shard)."""
    return heapq.merge(*runs, key=lambda pair: pair[0])
