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
"""

from __future__ import annotations

import csv
import io
import json
import re
from array import array
from collections.abc import Callable, Sequence
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
    column_kinds,
    labels_of,
    list_fields,
    merged_kinds,
    text_value,
)

__all__ = ["DEFAULT_MAX_CLASSES", "PARSERS", "ListSource"]

#: Most classes a list may imply (labels are indices 0..max or distinct names). ImageNet-21k has
#: 21,841; a stray label such as 99999999999 would otherwise size a list of 10^11 names.
DEFAULT_MAX_CLASSES = 100_000

_INT = re.compile(r"[+-]?\d+")
_HELP = (
    "Expected a CSV with the header 'path,label' (optionally ',split') or JSON Lines with "
    '{"path": ..., "label": ...} (optionally "split"); a label is a class index or a class name. '
    "Optional columns: 'labels' (several classes: a JSON list or \"a;b\"), 'caption'/'text' "
    "(text), others (CSV: text, JSONL: JSON values)."
)


class _Row(NamedTuple):
    line: int
    path: str
    label: int | str | None  # an int from JSON; a str from CSV (maybe decimal) or a JSON name
    split: str | None
    labels: list[int | str] | None = None  # the `labels` column's class tokens
    extras: dict[str, Any] | None = None  # other columns by name


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
            raise BadSourceError(f"{describe_path(self.list_path)}: no such list file. {_HELP}")
        parser = PARSERS.get(self.list_path.suffix.lower())
        if parser is None:
            raise BadSourceError(
                f"{self.list_path}: unknown list format {self.list_path.suffix!r}"
                f"; expected one of {sorted(PARSERS)}. {_HELP}"
            )
        self.root = Path(root).expanduser().resolve() if root is not None else self.list_path.parent
        rows = parser(self.list_path, _read_text(self.list_path))
        if not rows:
            raise BadSourceError(f"{self.list_path}: lists no images. {_HELP}")
        has_label = rows[0].label is not None
        for row in rows:
            if (row.label is not None) != has_label:
                raise _bad(
                    self.list_path,
                    row.line,
                    f"'label' is {'missing' if has_label else 'given'} here but "
                    f"{'given' if has_label else 'missing'} on line {rows[0].line}; "
                    "give every row a label or none",
                )
        has_labels = any(row.labels is not None for row in rows)
        csv = self.list_path.suffix.lower() == ".csv"
        kinds = merged_kinds((row.extras or {} for row in rows), csv)
        if not (has_label or has_labels or kinds):
            raise _bad(self.list_path, rows[0].line, "no 'label', 'labels' or other column")
        self._fields = list_fields(has_label, has_labels, kinds)
        tokens = [_Token(r.line, r.label) for r in rows if r.label is not None]
        tokens += [_Token(r.line, t) for r in rows for t in (r.labels or [])]
        self.classes, resolved = _resolve_labels(tokens, classes, self.list_path, max_classes)
        labels = resolved[: len(rows)] if has_label else [-1] * len(rows)
        rest = iter(resolved[len(rows) if has_label else 0 :])
        path_lists: dict[str, _StrColumn] = {}
        self._multi: dict[str, list[np.ndarray]] = {}
        self._extras: dict[str, list[dict[str, Any]]] = {}
        label_lists: dict[str, list[int]] = {}
        line_lists: dict[str, list[int]] = {}
        for row, label in zip(rows, labels, strict=True):
            name = row.split or split
            path_lists.setdefault(name, _StrColumn()).append(row.path)
            label_lists.setdefault(name, []).append(label)
            line_lists.setdefault(name, []).append(row.line)
            if self._fields is not None:
                mine = [next(rest) for _ in row.labels or []]
                self._multi.setdefault(name, []).append(np.asarray(mine, dtype=np.int64))
                extras = row.extras or {}
                values = {
                    k: extras.get(k, "" if kind == "text" else None) for k, kind in kinds.items()
                }
                self._extras.setdefault(name, []).append(values)
        # Arrays, not lists of ints: forked writer workers then share them without refcount writes.
        self._labels = {s: np.asarray(v, dtype=np.int64) for s, v in label_lists.items()}
        self._lines = {s: np.asarray(v, dtype=np.int64) for s, v in line_lists.items()}
        # One bytes buffer per split, not a str object per row (~60 bytes each, and refcounts
        # that forked workers would write to): the source then holds ~25 bytes a row.
        self._paths = path_lists

    def splits(self) -> dict[str, int]:
        """Split name -> number of listed images, in order of first appearance."""
        return {split: len(paths) for split, paths in self._paths.items()}

    def sample_fields(self, split: str) -> dict[str, FieldSpec] | None:
        """The list's fields besides the image (`listcolumns`); None: path + label only."""
        return None if self._fields is None else dict(self._fields)

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th listed image of `split` (file order)."""
        if split not in self._paths:
            raise ValueError(f"unknown split {split!r}; {self.list_path} has {sorted(self._paths)}")
        paths = self._paths[split]
        if not 0 <= index < len(paths):
            raise IndexError(f"{split}[{index}] is out of range: the split has {len(paths)} images")
        name = paths[index]
        path = self.root / name
        line = int(self._lines[split][index])
        fields = None
        if self._fields is not None:
            fields = dict(self._extras[split][index])
            fields["labels"] = self._multi[split][index]
            fields["label"] = int(self._labels[split][index])
        return SourceItem(
            sample_id=index,
            label=int(self._labels[split][index]),
            origin=f"{path} ({self.list_path.name}:{line})",
            path=path,
            fields=fields,
            source_id=name,  # as the list names it (relative to root, unless absolute)
        )

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


class _StrColumn:
    """Strings stored as one UTF-8 buffer and end offsets: a sequence of str that appends."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._ends = array("q")

    def append(self, value: str) -> None:
        self._data += value.encode("utf-8")
        self._ends.append(len(self._data))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> str:
        start = self._ends[index - 1] if index > 0 else 0
        return self._data[start : self._ends[index]].decode("utf-8")


def _bad(list_path: Path, line: int, problem: str) -> BadSourceError:
    return BadSourceError(f"{list_path}:{line}: {problem}. {_HELP}")


def _read_text(list_path: Path) -> str:
    """The list file as text: UTF-8 (after an optional byte-order mark), without NUL bytes."""
    try:
        data = list_path.read_bytes()
    except OSError as exc:
        raise BadSourceError(
            f"{list_path}: cannot read the list file ({exc.strerror or exc})"
        ) from exc
    # Spreadsheet programs start CSV files with a byte-order mark.
    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    nul = body.find(b"\x00")
    if nul >= 0:
        utf16 = (
            " (UTF-16? save the list as UTF-8)" if body[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        )
        raise _bad(list_path, body.count(b"\n", 0, nul) + 1, f"NUL byte: not a text file{utf16}")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = body.count(b"\n", 0, exc.start) + 1
        column = exc.start - (body.rfind(b"\n", 0, exc.start) + 1) + 1
        raise _bad(
            list_path,
            line,
            f"not UTF-8 (byte 0x{body[exc.start]:02x} at column {column}); save the list as "
            "UTF-8, e.g. `iconv -f latin1 -t utf-8 old.csv > new.csv`",
        ) from None


def _split_of(list_path: Path, line: int, split: str | None) -> str | None:
    """The row's split name (None: the default), checked to be a plain name."""
    if not split:
        return None
    if (problem := split_name_problem(split)) is not None:
        raise _bad(list_path, line, problem)
    return split


def _parse_csv(list_path: Path, text: str) -> list[_Row]:
    """Rows of a CSV list with a header naming at least `path` and `label`."""
    lines = _Counted(io.StringIO(text, newline=""))
    reader = csv.DictReader(lines)
    rows = []
    try:
        header = reader.fieldnames or []
        if "path" not in header:
            raise _bad(list_path, 1, f"header {header} lacks 'path'")
        if len(set(header)) != len(header):
            raise _bad(list_path, 1, f"header {header} names a column twice")
        try:
            kinds = column_kinds(header, csv=True)
        except ColumnError as exc:
            raise _bad(list_path, 1, str(exc)) from None
        for record in reader:
            line = reader.line_num
            if None in record or None in record.values():
                raise _bad(list_path, line, f"{len(header)} columns expected")
            path = record["path"].strip()
            label = record["label"].strip() if "label" in record else None
            if not path or label == "":
                raise _bad(list_path, line, "empty path or label")
            split = _split_of(list_path, line, (record.get("split") or "").strip())
            labels = labels_of(record["labels"]) if "labels" in record else None
            extras = {name: record[name] for name in kinds}
            rows.append(_Row(line, path, label, split, labels, extras))
    except csv.Error as exc:  # e.g. "field larger than field limit", "new-line in unquoted field"
        raise _bad(list_path, max(lines.count, 1), f"not valid CSV ({exc})") from None
    return rows


class _Counted:
    """Lines of a text, counting those handed out (the CSV reader's current line on an error)."""

    def __init__(self, lines: io.StringIO) -> None:
        self._lines = lines
        self.count = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self.count += 1
        return line


def _parse_jsonl(list_path: Path, text: str) -> list[_Row]:
    """Rows of a JSON Lines list: one object per line; blank lines are skipped."""
    rows = []
    for line, chunk in enumerate(text.split("\n"), start=1):
        if not chunk.strip():
            continue
        try:
            record = json.loads(chunk)
        except json.JSONDecodeError as exc:
            raise _bad(list_path, line, f"not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise _bad(list_path, line, "not a flat JSON object (nested too deeply)") from None
        except ValueError as exc:  # e.g. an integer of more than 4300 digits
            raise _bad(list_path, line, f"not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise _bad(list_path, line, f"expected an object, got {type(record).__name__}")
        path, label, split = record.get("path"), record.get("label"), record.get("split")
        if not isinstance(path, str) or not path.strip():
            raise _bad(list_path, line, f"'path' must be a non-empty string, got {_short(path)}")
        if "\x00" in path:
            raise _bad(list_path, line, f"'path' contains a NUL character: {_short(path)}")
        # bool is an int subclass: true/false are not labels.
        if label is not None and (
            isinstance(label, bool) or not isinstance(label, (int, str)) or label == ""
        ):
            raise _bad(
                list_path, line, f"'label' must be an int or a class name, got {_short(label)}"
            )
        if split is not None and not isinstance(split, str):
            raise _bad(list_path, line, f"'split' must be a string, got {_short(split)}")
        try:
            labels = labels_of(record["labels"]) if "labels" in record else None
            kinds = column_kinds(record, csv=False)
            extras = {
                k: text_value(k, record[k]) if kind == "text" else record[k]
                for k, kind in kinds.items()
            }
        except ColumnError as exc:
            raise _bad(list_path, line, str(exc)) from None
        split = _split_of(list_path, line, split)
        rows.append(_Row(line, path.strip(), label, split, labels, extras))
    return rows


# List-file suffix -> parser.
PARSERS: dict[str, Callable[[Path, str], list[_Row]]] = {
    ".csv": _parse_csv,
    ".jsonl": _parse_jsonl,
    ".ndjson": _parse_jsonl,
}


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
        names = list(classes)
        lookup = {name: i for i, name in enumerate(names)}
        labels = []
        for row in rows:
            # A name wins over an index: with classes "0".."9" in any order, "3" means class "3".
            index = lookup.get(row.label) if isinstance(row.label, str) else None
            if index is None:
                index = _as_index(row.label)
            if index is None or not 0 <= index < len(names):
                raise _bad(
                    list_path,
                    row.line,
                    f"label {_short(row.label)} is neither one of the "
                    f"{len(names)} classes nor an index 0..{len(names) - 1}",
                )
            labels.append(index)
        return names, labels
    indices = [_as_index(row.label) for row in rows]
    by_index = indices[0] is not None
    for row, index in zip(rows, indices, strict=True):
        if (index is not None) != by_index:
            first = "class indices" if by_index else "class names"
            raise _bad(
                list_path,
                row.line,
                f"label {_short(row.label)} differs in kind from the {first} used since line "
                f"{rows[0].line}; use one kind, or pass classes=[...] to allow both",
            )
        if index is not None and index < 0:
            raise _bad(list_path, row.line, f"negative label {_short(row.label)}")
        if index is not None and index >= max_classes:
            # Checked before `range(max + 1)` below sizes the class list.
            raise _bad(
                list_path,
                row.line,
                f"label {_short(row.label)} implies more than max_classes={max_classes:,} classes "
                "(indices 0..label); fix the label, or raise max_classes (--max-classes) "
                "if the dataset really has that many",
            )
    if by_index:
        return [str(i) for i in range(max(indices) + 1)], indices  # type: ignore[arg-type,type-var]
    seen: set[str] = set()
    for row in rows:
        seen.add(str(row.label))
        if len(seen) > max_classes:
            raise _bad(
                list_path,
                row.line,
                f"label {_short(row.label)} is class name number {len(seen):,}: more than "
                f"max_classes={max_classes:,}; raise max_classes (--max-classes) if the dataset "
                "really has that many",
            )
    names = sorted(seen)
    lookup = {name: i for i, name in enumerate(names)}
    return names, [lookup[str(row.label)] for row in rows]


def _short(value: object, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters for a message (a label may be 10,000 digits)."""
    text = repr(value) if not isinstance(value, int) else str(value)
    return text if len(text) <= limit else f"{text[: limit - 12]}...({len(text):,} chars)"
