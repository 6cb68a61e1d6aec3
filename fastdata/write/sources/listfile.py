"""Images named by a list file: CSV (`path,label[,split]`) or JSON Lines.

    path,label,split                      {"path": "img/0001.jpg", "label": "cat", "split": "val"}
    img/0001.jpg,cat,val                  {"path": "img/0002.jpg", "label": 3}
    img/0002.jpg,3,

More columns make more fields (`fastdata.write.sources.listcolumns`): `labels` (multi-label: a JSON
list or "a;b"), `caption`/`text` (text), any other column (CSV: text; JSONL: any JSON value).
`path` + `label` (+ `split`) alone is a classification list, stored as it always was.

Relative paths are resolved against `root` (default: the list file's folder). Labels are class
indices or class names. A list file is untrusted input: it must be UTF-8 (an error names the line
of the first byte that is not, or of a NUL byte), split names must be plain names
(`fastdata.write.sources.base.SPLIT_NAME`: they become shard file names), and the class list it implies
is bounded by `max_classes` before anything of that size is allocated. The image files are not opened or checked here (that would stat every
file of a large list); the writer reports a missing or unreadable file by its origin.

Memory: the list is read a line at a time and each row goes to a file as it is parsed
(`fastdata.write.sources.rowfile`); `item` reads its row back. What the source holds in memory
is the class tokens, not the rows: a list of 100 million rows costs the same RAM as one of 1,000
(the disk holds 28 bytes a row plus the path, in a temporary folder removed with the source).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fastdata.format.fields import FieldSpec
from fastdata.write.sources.base import (
    BadSourceError,
    SourceItem,
    describe_path,
    split_name_problem,
)
from fastdata.write.sources.listcolumns import (
    ColumnError,
    list_fields,
    merged_kinds,
)
from fastdata.write.sources.listrows import (
    HELP,
    PARSERS,
    Row,
    bad_line,
    check_text,
    short,
)
from fastdata.write.sources.rowfile import RowFile, RowFolder

__all__ = ["DEFAULT_MAX_CLASSES", "PARSERS", "ListSource"]

#: Most classes a list may imply (labels are indices 0..max or distinct names). ImageNet-21k has
#: 21,841; a stray label such as 99999999999 would otherwise size a list of 10^11 names.
DEFAULT_MAX_CLASSES = 100_000

_INT = re.compile(r"[+-]?\d+")


class _Token(NamedTuple):
    """One class token to resolve (a row's label, or one of its labels)."""

    line: int
    label: int | str


class ListSource:
    """Image files and labels listed in a CSV or JSON Lines file.

    Args:
        path: the list file (`.csv`, `.jsonl` or `.ndjson`).
        root: folder that relative image paths are resolved against (default: the list file's).
        split: split name of rows without a `split` column / field (or with an empty one).
        classes: class names, so that labels can be names or indices into this list. Without it,
            labels must be all indices (classes "0".."max") or all names (sorted).
        max_classes: most classes the labels may imply without `classes` (an index label must be
            below it; at most this many distinct names).

    Raises:
        ValueError: `split` is not a valid split name, or `max_classes` < 1.
        BadSourceError: the file is missing, unreadable, not UTF-8, of an unknown format, or a
            line is bad (named by line number: a bad split name, too large a label...).
    """

    kind = "list"

    def __init__(
        self,
        path: str | Path,
        root: str | Path | None = None,
        split: str = "train",
        classes: Sequence[str] | None = None,
        max_classes: int = DEFAULT_MAX_CLASSES,
    ) -> None:
        if path is None:
            raise ValueError("ListSource needs the list file as input, got None")
        if (problem := split_name_problem(split)) is not None:
            raise ValueError(f"ListSource(split=...): {problem}")
        if max_classes < 1:
            raise ValueError(f"max_classes must be >= 1, got {max_classes}")
        self.list_path = Path(path).expanduser().resolve()
        if not self.list_path.is_file():
            raise BadSourceError(f"{describe_path(self.list_path)}: no such list file. {HELP}")
        parser = PARSERS.get(self.list_path.suffix.lower())
        if parser is None:
            raise BadSourceError(
                f"{self.list_path}: unknown list format {self.list_path.suffix!r}"
                f"; expected one of {sorted(PARSERS)}. {HELP}"
            )
        self.root = Path(root).expanduser().resolve() if root is not None else self.list_path.parent
        check_text(self.list_path)  # a first pass, streamed: the file is never held whole
        self._read_rows(parser(self.list_path), split)
        ordered = [_Token(line, token) for token, line in self._label_first.items()]
        ordered += [
            _Token(line, token)
            for token, line in self._multi_first.items()
            if token not in self._label_first
        ]
        self.classes, resolved = _resolve_labels(ordered, classes, self.list_path, max_classes)
        # Token id -> class index; rows keep token ids, not their tokens.
        self._by_id = np.zeros(len(self._token_ids), dtype=np.int64)
        for token, index in zip(ordered, resolved, strict=True):
            self._by_id[self._token_ids[token.label]] = index
        del self._label_first, self._multi_first, self._token_ids

    def _read_rows(self, rows: Iterator[Row], split: str) -> None:
        """Consume the parsed rows one at a time into per-split row files on disk (`RowFile`:
        the memory held does not grow with the list); the problems seen only over all rows are
        raised after the last row, in the order they always were."""
        self._folder = RowFolder(prefix="fastdata-list-")
        self._rows: dict[str, RowFile] = {}
        self._token_ids: dict[int | str, int] = {}
        # First line of each distinct class token, labels then `labels` tokens (file order):
        # what `_resolve_labels` checks, so that an error names the line it always named.
        self._label_first: dict[int | str, int] = {}
        self._multi_first: dict[int | str, int] = {}
        first: Row | None = None
        mismatch: BadSourceError | None = None
        kinds: dict[str, str] = {}
        kinds_error: ColumnError | None = None
        has_labels = False
        csv = self.list_path.suffix.lower() == ".csv"
        for row in rows:
            first = first or row
            if mismatch is None and (row.label is not None) != (first.label is not None):
                has = first.label is not None
                mismatch = bad_line(
                    self.list_path,
                    row.line,
                    f"'label' is {'missing' if has else 'given'} here but "
                    f"{'given' if has else 'missing'} on line {first.line}; "
                    "give every row a label or none",
                )
            if row.extras and kinds_error is None:
                try:
                    kinds = merged_kinds([kinds, row.extras], csv)
                except ColumnError as exc:
                    kinds_error = exc
            has_labels = self._store(row, row.split or split) or has_labels
        for rows_of_split in self._rows.values():
            rows_of_split.finish()
        if first is None:
            raise BadSourceError(f"{self.list_path}: lists no images. {HELP}")
        if mismatch is not None:
            raise mismatch
        if kinds_error is not None:
            raise kinds_error
        self._has_label = first.label is not None
        if not (self._has_label or has_labels or kinds):
            raise bad_line(self.list_path, first.line, "no 'label', 'labels' or other column")
        self._fields = list_fields(self._has_label, has_labels, kinds)
        self._kinds = kinds

    def _store(self, row: Row, name: str) -> bool:
        """Append `row` to split `name`'s rows, its class tokens numbered; True if it has `labels`."""
        rows_of_split = self._rows.get(name)
        if rows_of_split is None:
            rows_of_split = self._rows[name] = RowFile(self._folder, f"split-{len(self._rows)}")
        label_id = 0
        if row.label is not None:
            self._label_first.setdefault(row.label, row.line)
            label_id = self._token_ids.setdefault(row.label, len(self._token_ids))
        ids = None
        if row.labels is not None:
            for token in row.labels:
                self._multi_first.setdefault(token, row.line)
            ids = [self._token_ids.setdefault(t, len(self._token_ids)) for t in row.labels]
        rows_of_split.append(_pack(row, label_id, ids))
        return row.labels is not None

    def splits(self) -> dict[str, int]:
        """Split name -> number of listed images, in order of first appearance."""
        return {split: len(rows) for split, rows in self._rows.items()}

    def sample_fields(self, split: str) -> dict[str, FieldSpec] | None:
        """The list's fields besides the image (`listcolumns`); None: path + label only."""
        return None if self._fields is None else dict(self._fields)

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th listed image of `split` (file order)."""
        if split not in self._rows:
            raise ValueError(f"unknown split {split!r}; {self.list_path} has {sorted(self._rows)}")
        rows = self._rows[split]
        if not 0 <= index < len(rows):
            raise IndexError(f"{split}[{index}] is out of range: the split has {len(rows)} images")
        name, line, label_id, ids, extras = _unpack(rows[index])
        path = self.root / name
        label = int(self._by_id[label_id]) if self._has_label else -1
        fields = None
        if self._fields is not None:
            extras = extras or {}
            fields = {
                k: extras.get(k, "" if kind == "text" else None) for k, kind in self._kinds.items()
            }
            fields["labels"] = (
                self._by_id[np.asarray(ids, dtype=np.int64)]
                if ids is not None
                else np.zeros(0, np.int64)
            )
            fields["label"] = label
        return SourceItem(
            sample_id=index,
            label=label,
            origin=f"{path} ({self.list_path.name}:{line})",
            path=path,
            fields=fields,
            source_id=name,  # as the list names it (relative to root, unless absolute)
        )

    def move_rows(self, folder: Path) -> None:
        """Read the parsed rows from copies in `folder` from now on (the writer's work folder,
        which every node of a cluster reaches; the temporary originals go with this source)."""
        for rows in self._rows.values():
            rows.move_to(folder)

    def fingerprint(self) -> dict[str, Any]:
        """Kind, the list file's resolved path, size and mtime, the root and the classes."""
        stat = self.list_path.stat()
        return {
            "kind": self.kind,
            "path": str(self.list_path),
            "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "root": str(self.root),
            "classes": list(self.classes),
        }


_HEAD = struct.Struct("<qqI")  # a row's line, label token id and path length


def _pack(row: Row, label_id: int, ids: list[int] | None) -> bytes:
    """One row as stored: line, label token id, path; then, only for rows that have them, the
    `labels` token ids and the other columns as JSON (their values as the parser gave them)."""
    path = row.path.encode("utf-8")
    more = b""
    if ids is not None or row.extras:
        more = json.dumps([ids, row.extras or None]).encode("ascii")  # \uXXXX: any str
    return _HEAD.pack(row.line, label_id, len(path)) + path + more


def _unpack(data: bytes) -> tuple[str, int, int, list[int] | None, dict[str, Any] | None]:
    """(path, line, label token id, `labels` token ids, other columns) of a stored row."""
    line, label_id, size = _HEAD.unpack_from(data)
    start = _HEAD.size
    path = data[start : start + size].decode("utf-8")
    ids, extras = None, None
    if len(data) > start + size:
        ids, extras = json.loads(data[start + size :])
    return path, line, label_id, ids, extras


def _as_index(label: int | str) -> int | None:
    """The label as a class index, if it is one (an int, or a decimal string in CSV)."""
    if isinstance(label, int):
        return label
    if not _INT.fullmatch(label):
        return None
    # int() refuses more than 4300 digits; any index of 20 digits is out of every bound anyway.
    if len(label.lstrip("+-")) > 19:
        return -(10**19) if label.startswith("-") else 10**19
    return int(label)


def _resolve_labels(
    rows: Sequence[_Token], classes: Sequence[str] | None, list_path: Path, max_classes: int
) -> tuple[list[str], list[int]]:
    """(class names, label index per row) following the rules of `ListSource`."""
    if not rows:  # a list of captions or other columns only: no classes
        return list(classes or []), []
    if classes is not None:
        return list(classes), _indices_of(rows, list(classes), list_path)
    indices = [_as_index(row.label) for row in rows]
    by_index = indices[0] is not None
    for row, index in zip(rows, indices, strict=True):
        if (index is not None) != by_index:
            first = "class indices" if by_index else "class names"
            raise bad_line(
                list_path,
                row.line,
                f"label {short(row.label)} differs in kind from the {first} used since line "
                f"{rows[0].line}; use one kind, or pass classes=[...] to allow both",
            )
        if index is not None and index < 0:
            raise bad_line(list_path, row.line, f"negative label {short(row.label)}")
        if index is not None and index >= max_classes:
            # Checked before `range(max + 1)` below sizes the class list.
            raise bad_line(
                list_path,
                row.line,
                f"label {short(row.label)} implies more than max_classes={max_classes:,} classes "
                "(indices 0..label); fix the label, or raise max_classes (--max-classes) "
                "if the dataset really has that many",
            )
    if by_index:
        return [str(i) for i in range(max(indices) + 1)], indices  # type: ignore[arg-type,type-var]
    seen: set[str] = set()
    for row in rows:
        seen.add(str(row.label))
        if len(seen) > max_classes:
            raise bad_line(
                list_path,
                row.line,
                f"label {short(row.label)} is class name number {len(seen):,}: more than "
                f"max_classes={max_classes:,}; raise max_classes (--max-classes) if the dataset "
                "really has that many",
            )
    names = sorted(seen)
    lookup = {name: i for i, name in enumerate(names)}
    return names, [lookup[str(row.label)] for row in rows]


def _indices_of(rows: Sequence[_Token], names: list[str], list_path: Path) -> list[int]:
    """Each row's class index among the given class `names` (a name, or an index into them)."""
    lookup = {name: i for i, name in enumerate(names)}
    labels = []
    for row in rows:
        # A name wins over an index: with classes "0".."9" in any order, "3" means class "3".
        index = lookup.get(row.label) if isinstance(row.label, str) else None
        if index is None:
            index = _as_index(row.label)
        if index is None or not 0 <= index < len(names):
            raise bad_line(
                list_path,
                row.line,
                f"label {short(row.label)} is neither one of the "
                f"{len(names)} classes nor an index 0..{len(names) - 1}",
            )
        labels.append(index)
    return labels
