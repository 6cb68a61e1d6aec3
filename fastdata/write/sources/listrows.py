"""A list file's lines -> rows: the CSV and JSON Lines parsers of `fastdata.write.sources.listfile`.

A list is untrusted input: `check_text` checks, a line at a time, that it is UTF-8 without NUL
bytes before a parser runs; each parser yields one `Row` a line (its path, label, split and other
columns) and raises a `BadSourceError` that names the line and says what a list should hold.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from fastdata.write.sources.base import BadSourceError, split_name_problem
from fastdata.write.sources.listcolumns import ColumnError, column_kinds, labels_of, text_value

__all__ = ["HELP", "PARSERS", "Row", "bad_line", "check_text", "short"]

HELP = (
    "Expected a CSV with the header 'path,label' (optionally ',split') or JSON Lines with "
    '{"path": ..., "label": ...} (optionally "split"); a label is a class index or a class name. '
    "Optional columns: 'labels' (several classes: a JSON list or \"a;b\"), 'caption'/'text' "
    "(text), others (CSV: text, JSONL: JSON values)."
)


class Row(NamedTuple):
    line: int
    path: str
    label: int | str | None  # an int from JSON; a str from CSV (maybe decimal) or a JSON name
    split: str | None
    labels: list[int | str] | None = None  # the `labels` column's class tokens
    extras: dict[str, Any] | None = None  # other columns by name


def bad_line(list_path: Path, line: int, problem: str) -> BadSourceError:
    """The error for line `line` of a list: the problem, then what a list should hold."""
    return BadSourceError(f"{list_path}:{line}: {problem}. {HELP}")


def check_text(list_path: Path) -> None:
    """Check, a line at a time, that the list is UTF-8 (after an optional byte-order mark)
    without NUL bytes; the first NUL is reported even after a line that is not UTF-8."""
    not_utf8: BadSourceError | None = None
    try:
        with list_path.open("rb") as file:
            for number, line in enumerate(file, start=1):
                if number == 1:
                    # Spreadsheet programs start CSV files with a byte-order mark.
                    line = line[3:] if line.startswith(b"\xef\xbb\xbf") else line
                    utf16 = line[:2] in (b"\xff\xfe", b"\xfe\xff")
                if b"\x00" in line:
                    hint = " (UTF-16? save the list as UTF-8)" if utf16 else ""
                    raise bad_line(list_path, number, f"NUL byte: not a text file{hint}")
                if not_utf8 is None:
                    not_utf8 = _utf8_problem(list_path, number, line)
    except OSError as exc:
        raise BadSourceError(
            f"{list_path}: cannot read the list file ({exc.strerror or exc})"
        ) from exc
    if not_utf8 is not None:
        raise not_utf8


def _utf8_problem(list_path: Path, number: int, line: bytes) -> BadSourceError | None:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return bad_line(
            list_path,
            number,
            f"not UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1}); save the "
            "list as UTF-8, e.g. `iconv -f latin1 -t utf-8 old.csv > new.csv`",
        )
    return None


def _split_of(list_path: Path, line: int, split: str | None) -> str | None:
    """The row's split name (None: the default), checked to be a plain name."""
    if not split:
        return None
    if (problem := split_name_problem(split)) is not None:
        raise bad_line(list_path, line, problem)
    return split


def _parse_csv(list_path: Path) -> Iterator[Row]:
    """Rows of a CSV list with a header naming at least `path` and `label` (`check_text`ed)."""
    with list_path.open(encoding="utf-8-sig", newline="") as file:
        yield from _csv_rows(list_path, file)


def _csv_rows(list_path: Path, file: io.TextIOBase) -> Iterator[Row]:
    lines = _Counted(file)
    reader = csv.DictReader(lines)
    try:
        header = reader.fieldnames or []
        if "path" not in header:
            raise bad_line(list_path, 1, f"header {header} lacks 'path'")
        if len(set(header)) != len(header):
            raise bad_line(list_path, 1, f"header {header} names a column twice")
        try:
            kinds = column_kinds(header, csv=True)
        except ColumnError as exc:
            raise bad_line(list_path, 1, str(exc)) from None
        for record in reader:
            line = reader.line_num
            if None in record or None in record.values():
                raise bad_line(list_path, line, f"{len(header)} columns expected")
            path = record["path"].strip()
            label = record["label"].strip() if "label" in record else None
            if not path or label == "":
                raise bad_line(list_path, line, "empty path or label")
            split = _split_of(list_path, line, (record.get("split") or "").strip())
            labels = labels_of(record["labels"]) if "labels" in record else None
            extras = {name: record[name] for name in kinds}
            yield Row(line, path, label, split, labels, extras)
    except csv.Error as exc:  # e.g. "field larger than field limit", "new-line in unquoted field"
        raise bad_line(list_path, max(lines.count, 1), f"not valid CSV ({exc})") from None


class _Counted:
    """Lines of a text, counting those handed out (the CSV reader's current line on an error)."""

    def __init__(self, lines: Iterator[str]) -> None:
        self._lines = lines
        self.count = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self.count += 1
        return line


def _parse_jsonl(list_path: Path) -> Iterator[Row]:
    """Rows of a JSON Lines list (`check_text`ed): one object per line; blank lines skipped."""
    with list_path.open("rb") as file:
        for line, raw in enumerate(file, start=1):
            chunk = raw.decode("utf-8-sig" if line == 1 else "utf-8").removesuffix("\n")
            if (row := _jsonl_row(list_path, line, chunk)) is not None:
                yield row


def _jsonl_row(list_path: Path, line: int, chunk: str) -> Row | None:
    """The row of one JSON Lines line; None for a blank line."""
    if not chunk.strip():
        return None
    try:
        record = json.loads(chunk)
    except json.JSONDecodeError as exc:
        raise bad_line(list_path, line, f"not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise bad_line(list_path, line, "not a flat JSON object (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise bad_line(list_path, line, f"not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise bad_line(list_path, line, f"expected an object, got {type(record).__name__}")
    path, label, split = record.get("path"), record.get("label"), record.get("split")
    if not isinstance(path, str) or not path.strip():
        raise bad_line(list_path, line, f"'path' must be a non-empty string, got {short(path)}")
    if "\x00" in path:
        raise bad_line(list_path, line, f"'path' contains a NUL character: {short(path)}")
    # bool is an int subclass: true/false are not labels.
    if label is not None and (
        isinstance(label, bool) or not isinstance(label, (int, str)) or label == ""
    ):
        raise bad_line(
            list_path, line, f"'label' must be an int or a class name, got {short(label)}"
        )
    if split is not None and not isinstance(split, str):
        raise bad_line(list_path, line, f"'split' must be a string, got {short(split)}")
    try:
        labels = labels_of(record["labels"]) if "labels" in record else None
        kinds = column_kinds(record, csv=False)
        extras = {
            k: text_value(k, record[k]) if kind == "text" else record[k]
            for k, kind in kinds.items()
        }
    except ColumnError as exc:
        raise bad_line(list_path, line, str(exc)) from None
    split = _split_of(list_path, line, split)
    return Row(line, path.strip(), label, split, labels, extras)


# List-file suffix -> parser.
PARSERS: dict[str, Callable[[Path], Iterator[Row]]] = {
    ".csv": _parse_csv,
    ".jsonl": _parse_jsonl,
    ".ndjson": _parse_jsonl,
}


def short(value: object, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters for a message (a label may be 10,000 digits)."""
    text = repr(value) if not isinstance(value, int) else str(value)
    return text if len(text) <= limit else f"{text[: limit - 12]}...({len(text):,} chars)"
