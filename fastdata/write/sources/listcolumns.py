"""The columns of a list file besides `path`, `label` and `split`, and the fields they become.

| column (CSV header / JSONL key) | field (kind)        | value                                              |
|---------------------------------|---------------------|----------------------------------------------------|
| `labels`                        | `labels` (labels)   | several classes: a JSON list, or "a;b" (CSV/JSONL)  |
| `caption`, `text`               | same name (text)    | a string                                           |
| any other CSV column            | same name (text)    | the cell's string                                  |
| any other JSONL key             | same name (json)    | any JSON value                                     |

Components: a field that is the only one of its kind is stored as `txt` / `json` (the webdataset
names, what img2dataset writes); several are `<name>.txt` / `<name>.json`. A row without a JSONL
key gets "" (text), null (json) or no classes (labels). Column names must be identifiers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fastdata.format.fields import FieldSpec

__all__ = [
    "RESERVED",
    "TEXT_COLUMNS",
    "ColumnError",
    "column_kinds",
    "labels_of",
    "list_fields",
    "merged_kinds",
    "text_value",
]

RESERVED = ("path", "split", "label")
TEXT_COLUMNS = ("caption", "text")
_MAX_COLUMNS = 64


class ColumnError(ValueError):
    """A column's value or name is not usable (the caller adds the file and line)."""


def labels_of(value: Any) -> list[int | str]:
    """The class tokens of a `labels` value: a list of ints / names, or "a;b" (empty: none).

    Raises:
        ColumnError: any other value.
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [token.strip() for token in value.split(";") if token.strip()]
    if isinstance(value, list) and all(
        (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and v)
        for v in value
    ):
        return list(value)
    raise ColumnError(
        f"'labels' must be a list of class indices or names, or 'a;b', got {str(value)[:40]!r}"
    )


def column_kinds(columns: Iterable[str], csv: bool) -> dict[str, str]:
    """Field kind ("text" / "json") of every column that is not reserved nor `labels`.

    Raises:
        ColumnError: a column name that is not an identifier, "image", or too many columns.
    """
    kinds: dict[str, str] = {}
    for name in columns:
        if name in RESERVED or name == "labels":
            continue
        if not name.isidentifier() or name == "image":
            raise ColumnError(
                f"column {name[:40]!r} cannot be a field: a field name is an identifier "
                "(letters, digits, '_') and not 'image'"
            )
        kinds[name] = "text" if csv or name in TEXT_COLUMNS else "json"
    if len(kinds) > _MAX_COLUMNS:
        raise ColumnError(f"{len(kinds)} extra columns is more than {_MAX_COLUMNS}")
    return kinds


def merged_kinds(rows: Iterable[Mapping[str, Any]], csv: bool) -> dict[str, str]:
    """Field kind of every extra column over all rows (JSONL rows may name different keys)."""
    kinds: dict[str, str] = {}
    for extras in rows:
        for name in extras:
            if name not in kinds:
                kinds.update(column_kinds([name], csv))
                if len(kinds) > _MAX_COLUMNS:  # rows naming new keys each: bounded in total
                    raise ColumnError(
                        f"the rows name {len(kinds)} extra columns in all, more than {_MAX_COLUMNS}"
                    )
    return kinds


def text_value(name: str, value: Any) -> str:
    """A text column's value (missing: "")."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ColumnError(f"{name!r} must be a string, got {type(value).__name__}")
    return value


def list_fields(
    has_label: bool, has_labels: bool, kinds: Mapping[str, str]
) -> dict[str, FieldSpec] | None:
    """The fields of a list's samples besides the image; None for path + label only."""
    if not has_labels and not kinds:
        return None
    fields: dict[str, FieldSpec] = {}
    if has_label:
        fields["label"] = FieldSpec("label", "label", ("cls", "lid"))
    if has_labels:
        fields["labels"] = FieldSpec("labels", "labels", ("labels.npy",))
    for kind, ext in (("text", "txt"), ("json", "json")):
        names = sorted(n for n, k in kinds.items() if k == kind)
        for name in names:
            fields[name] = FieldSpec(name, kind, (ext if len(names) == 1 else f"{name}.{ext}",))
    return fields
