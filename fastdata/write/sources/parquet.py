"""Images in Parquet files: the Hugging Face layout and plain columns (needs `fastdata[parquet]`).

| column                                   | becomes                                              |
|------------------------------------------|------------------------------------------------------|
| `image`: struct {bytes, path} (HF Image) | the image: its bytes (or the file at `path`)         |
| `image`: binary / string                 | the image's bytes / a path (relative: the file's folder) |
| `label`: int / string                    | the label (a class index / a class name)             |
| any other string column                  | a text field (`txt`; `<name>.txt` when several)      |
| any other column (numbers, lists...)     | a json field (`json`; `<name>.json` when several)    |

Class names come from `classes=`, else from the schema metadata `datasets` writes (the
`huggingface` key: `info.features.<label>` is a ClassLabel with `names`), else from the labels
(indices: "0".."max"; names: sorted). Splits: a file named `<split>-00000-of-00004.parquet`
(the Hub's layout) is in `<split>`; else a file in a sub-folder of INPUT is in the folder's split
(`train/0000.parquet`); else in `split`. A sample's source id (`SourceItem.source_id`) is its
file, relative to INPUT, and its row in the file: `data/train-00000-of-00002.parquet:17`.

Opening reads every column but the image, one row group per task on a thread pool, and checks
every label. The images are read when the writer asks for them: a row group's image column at a
time, kept in a per-process cache of `cache_bytes` (the writer's plan visits rows in a seeded
random order, so a dataset larger than the cache reads a row group once per sample it serves).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastdata.format.fields import FieldSpec
from fastdata.write.sources.base import (
    BadSourceError,
    SourceItem,
    describe_path,
    split_name_problem,
)
from fastdata.write.sources.listcolumns import list_fields
from fastdata.write.sources.parquet_columns import (
    class_names,
    extra_kinds,
    hf_features,
    image_column,
    label_column,
    same_columns,
)

__all__ = ["DEFAULT_CACHE_BYTES", "ParquetSource"]

#: Image bytes a process keeps of the row groups it read (the writer's processes each have one).
DEFAULT_CACHE_BYTES = 256 << 20
_HUB_NAME = re.compile(r"(?P<split>[A-Za-z0-9][A-Za-z0-9_]*)-\d+-of-\d+")
_INSTALL = "install pyarrow: pip install 'fastdata[parquet]'"


@dataclass(frozen=True)
class _Group:
    """One row group of one file, and where its rows start in their split."""

    file: int
    group: int
    rows: int
    start: int  # index in the split of the group's first row
    first_row: int  # index in the file of the group's first row


class ParquetSource:
    """Images and their labels and fields from Parquet files (see the module docstring).

    Args:
        path: a `.parquet` file, or a folder searched recursively for them (sorted by path).
        image: the image column (default: `image` or `img`, else the only binary or
            Hugging Face Image column, else a path column such as `image_path`).
        label: the label column (default: `label`, else the only ClassLabel column; none when
            there is neither).
        columns: the other columns to keep as fields (default: all of them).
        classes: class names (labels may then be names or indices into them).
        split: the split of files the layout names no split for.
        threads: row groups read at once while opening (default: up to 8).
        cache_bytes: image bytes each process keeps of the row groups it read.

    Raises:
        ImportError: pyarrow is not installed.
        ValueError: `split` is not a valid split name.
        BadSourceError: no Parquet file, an unreadable file, a missing or unusable column, files
            whose columns differ, or a bad label (the message names the file, row group and row).
    """

    kind = "parquet"

    def __init__(
        self,
        path: str | Path,
        image: str | None = None,
        label: str | None = None,
        columns: Sequence[str] | None = None,
        classes: Sequence[str] | None = None,
        split: str = "train",
        threads: int | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(f"the parquet source needs pyarrow; {_INSTALL}") from exc
        if path is None:
            raise ValueError("ParquetSource needs a .parquet file or a folder as input, got None")
        if (problem := split_name_problem(split)) is not None:
            raise ValueError(f"ParquetSource(split=...): {problem}")
        self.root = Path(path).expanduser().resolve()
        self.files = _parquet_files(self.root)
        self._cache_bytes = cache_bytes
        metas = [_open(pq, f) for f in self.files]
        schema = metas[0].schema.to_arrow_schema()
        features = hf_features(schema)
        self.image_column, self._image_kind = image_column(schema, features, image, self.files[0])
        self.label_column = label_column(schema, features, label, self.image_column, self.files[0])
        kinds = extra_kinds(schema, self.image_column, self.label_column, columns, self.files[0])
        for file, meta in zip(self.files[1:], metas[1:], strict=True):
            same_columns(meta.schema.to_arrow_schema(), schema, file, self.files[0])
        self._kinds = kinds
        self._fields = list_fields(self.label_column is not None, False, kinds)
        if self.label_column is None and self._fields is None:
            raise BadSourceError(
                f"{describe_path(self.files[0])}: no label column and no other column besides "
                f"the image {self.image_column!r}; pass label=... naming the label column"
            )
        self._groups, self._splits = _plan(self.files, metas, self.root, split)
        self._load_columns(pq, class_names(classes, features, self.label_column), threads)
        self._cache: OrderedDict[tuple[int, int], tuple[Any, int]] = OrderedDict()

    # ------------------------------------------------------------------------------ Source API

    def splits(self) -> dict[str, int]:
        """Split name -> number of rows, in the order the files name them."""
        return dict(self._splits)

    def sample_fields(self, split: str) -> dict[str, FieldSpec] | None:
        """The fields besides the image (label, text and json columns); None: image + label."""
        return None if self._fields is None else dict(self._fields)

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th row of `split` (file order, then row order)."""
        if split not in self._groups:
            raise ValueError(f"unknown split {split!r}; {self.root} has {sorted(self._groups)}")
        if not 0 <= index < self._splits[split]:
            raise IndexError(
                f"{split}[{index}] is out of range: the split has {self._splits[split]}"
            )
        group = self._groups[split][int(np.searchsorted(self._starts[split], index, "right")) - 1]
        row = index - group.start
        file = self.files[group.file]
        origin = (
            f"{file}: row group {group.group}, row {row} (row {group.first_row + row} of the file)"
        )
        data, path = self._image(split, index, group, row)
        label = int(self._labels[split][index])
        fields = None
        if self._fields is not None:
            fields = dict(self._extras[split][index])
            fields["label"] = label
        # The source id names the row where the dataset puts it, whatever folder it was opened in.
        name = file.name if file == self.root else file.relative_to(self.root).as_posix()
        source_id = f"{name}:{group.first_row + row}"
        return SourceItem(
            index, label, origin, path=path, fields=fields, source_id=source_id, data=data
        )

    def fingerprint(self) -> dict[str, Any]:
        """Kind, root, each file's path, size and mtime, the columns used and the classes."""
        files = []
        for file in self.files:
            stat = file.stat()
            files.append([str(file), stat.st_size, stat.st_mtime_ns])
        return {
            "kind": self.kind,
            "path": str(self.root),
            "files": files,
            "image": self.image_column,
            "label": self.label_column,
            "columns": list(self._kinds),
            "splits": self.splits(),
            "classes": list(self.classes),
        }

    # ------------------------------------------------------------------------------ reading

    def _load_columns(self, pq: Any, names: list[str] | None, threads: int | None) -> None:
        """Read every column but the image, a row group per task on a thread pool (pyarrow
        releases the GIL), check the labels, and keep each row's label and field values."""
        kinds = self._kinds
        read_cols = [c for c in (self.label_column, *kinds) if c is not None]
        if self._image_kind == "path":
            read_cols.append(self.image_column)
        tasks = [(s, g) for s, groups in self._groups.items() for g in groups]
        with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
            read = list(pool.map(lambda t: self._read_columns(pq, t[1], read_cols), tasks))
        self.classes, labels = _resolve(read, tasks, names, self)
        counts = self._splits
        # Arrays, not lists of ints: forked writer workers share them without refcount writes.
        self._labels = {s: np.full(n, -1, dtype=np.int64) for s, n in counts.items()}
        self._extras: dict[str, list[dict[str, Any]]] = {s: [] for s in counts}
        self._paths: dict[str, list[str | None]] = {s: [] for s in counts}
        for (split, group), columns_read, group_labels in zip(tasks, read, labels, strict=True):
            if group_labels is not None:
                self._labels[split][group.start : group.start + group.rows] = group_labels
            values = zip(*(columns_read[k] for k in kinds), strict=True)
            rows = [dict(zip(kinds, v, strict=True)) for v in values]
            self._extras[split].extend(rows or [{}] * group.rows)
            if self._image_kind == "path":
                self._paths[split].extend(columns_read[self.image_column])
        self._starts = {
            s: np.asarray([g.start for g in gs], np.int64) for s, gs in self._groups.items()
        }

    def _read_columns(self, pq: Any, group: _Group, names: list[str]) -> dict[str, list[Any]]:
        """The named columns of one row group as Python values (run on the open thread pool)."""
        file = self.files[group.file]
        try:
            with pq.ParquetFile(file) as parquet:  # closed at once: no descriptor per row group
                table = parquet.read_row_group(group.group, columns=names)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError...
            raise BadSourceError(
                f"{file}: cannot read row group {group.group} ({exc}); the file is damaged: "
                "download or write it again"
            ) from exc
        values = {name: table.column(name).to_pylist() for name in names}
        for name, kind in self._kinds.items():
            if kind == "text":  # a null string is an empty text, as a list file's missing cell
                values[name] = ["" if v is None else v for v in values[name]]
        return values

    def _image(
        self, split: str, index: int, group: _Group, row: int
    ) -> tuple[bytes | None, Path | None]:
        """(bytes, None) or (None, file path) of a row's image; (None, None): the row has none."""
        if self._image_kind == "path":
            return None, self._image_path(group, self._paths[split][index])
        value = self._image_group(group)[row].as_py()
        if self._image_kind == "bytes":
            return value, None
        value = value or {}
        if value.get("bytes") is not None:
            return value["bytes"], None
        return None, self._image_path(group, value.get("path"))

    def _image_path(self, group: _Group, value: str | None) -> Path | None:
        # Relative to the Parquet file's folder, not the working directory: the dataset folder can
        # move as a whole, and the shards do not depend on where the command ran.
        return None if not value else self.files[group.file].parent / value

    def _image_group(self, group: _Group) -> Any:
        """The image column of a row group (an Arrow array), from this process's cache."""
        key = (group.file, group.group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key][0]
        import pyarrow.parquet as pq

        file = self.files[group.file]
        try:
            with pq.ParquetFile(file) as parquet:
                table = parquet.read_row_group(group.group, columns=[self.image_column])
        except Exception as exc:
            raise BadSourceError(
                f"{file}: cannot read the images of row group {group.group} ({exc}); the file "
                "changed or is damaged since the source was opened: write it again"
            ) from exc
        array = table.column(self.image_column).combine_chunks()
        size = int(array.nbytes)
        self._cache[key] = (array, size)
        total = sum(s for _, s in self._cache.values())
        while total > self._cache_bytes and len(self._cache) > 1:
            _, (_, dropped) = self._cache.popitem(last=False)
            total -= dropped
        return array


def _parquet_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise BadSourceError(f"{root}: no such file or folder; give a .parquet file or a folder")
    files = sorted((p for p in root.rglob("*.parquet") if p.is_file()), key=lambda p: p.parts)
    if not files:
        raise BadSourceError(f"{root}: holds no .parquet file (searched its sub-folders too)")
    return files


def _open(pq: Any, file: Path) -> Any:
    try:
        with pq.ParquetFile(file) as parquet:
            return parquet.metadata
    except Exception as exc:  # ArrowInvalid: not Parquet; OSError: unreadable
        raise BadSourceError(
            f"{file}: not a readable Parquet file ({exc}); remove it from the folder or write "
            "it again"
        ) from exc


def _plan(
    files: list[Path], metas: list[Any], root: Path, default: str
) -> tuple[dict[str, list[_Group]], dict[str, int]]:
    """Each split's row groups in file order, and each split's number of rows."""
    groups: dict[str, list[_Group]] = {}
    counts: dict[str, int] = {}
    for number, (file, meta) in enumerate(zip(files, metas, strict=True)):
        split = _split_of(file, root, default)
        first_row = 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            if rows:
                groups.setdefault(split, []).append(
                    _Group(number, g, rows, counts.get(split, 0), first_row)
                )
                counts[split] = counts.get(split, 0) + rows
            first_row += rows
    if not counts:
        raise BadSourceError(f"{root}: the Parquet files hold no rows")
    return groups, counts


def _split_of(file: Path, root: Path, default: str) -> str:
    match = _HUB_NAME.fullmatch(file.stem)
    if match:
        name = match["split"]
    elif file.parent != root and file != root:
        name = file.parent.name
    else:
        return default
    if (problem := split_name_problem(name)) is not None:
        raise BadSourceError(f"{file}: its split is named by its path, but {problem}")
    return name


def _resolve(
    read: list[dict[str, list[Any]]],
    tasks: list[tuple[str, _Group]],
    names: list[str] | None,
    source: ParquetSource,
) -> tuple[list[str], list[np.ndarray | None]]:
    """(class names, each row group's label indices) with every label checked."""
    column = source.label_column
    if column is None:
        return list(names or []), [None] * len(tasks)
    lookup = {n: i for i, n in enumerate(names)} if names is not None else None
    if lookup is None and any(isinstance(v, str) for r in read for v in r[column]):
        lookup = {n: i for i, n in enumerate(sorted({v for r in read for v in r[column] if v}))}
    out: list[np.ndarray | None] = []
    top = -1
    for (_, group), values in zip(tasks, read, strict=True):
        labels = np.empty(group.rows, dtype=np.int64)
        for row, value in enumerate(values[column]):
            index = lookup.get(value) if isinstance(value, str) and lookup else value
            bound = len(lookup) if lookup is not None else None
            if not isinstance(index, int) or index < 0 or (bound is not None and index >= bound):
                raise BadSourceError(
                    f"{source.files[group.file]}: row group {group.group}, row {row} (row "
                    f"{group.first_row + row} of the file): label {value!r} is not "
                    + (f"one of the {bound} classes" if bound is not None else "a class index")
                    + " (Hugging Face writes -1 for an unlabelled row); leave such files out, "
                    "or pass classes=[...] (--classes) naming every class"
                )
            labels[row] = index
            top = max(top, index)
        out.append(labels)
    if lookup is None:
        return [str(i) for i in range(top + 1)], out
    return list(lookup), out
