"""Which columns of a Parquet schema are the image, the label and the fields (`ParquetSource`).

The image column is a Hugging Face Image (struct of bytes + path), binary, or a path string; the
label an integer (class index) or a string (class name); every other kept column a text field
(strings) or a JSON field (numbers, booleans, lists, structs). A column with no such form (binary,
dates, decimals) is refused by name, with the `columns=[...]` that leaves it out. Class names come
from the schema metadata `datasets` writes (`huggingface` -> `info.features`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastdata.write.sources.base import BadSourceError, describe_path

__all__ = [
    "class_names",
    "describe_schema",
    "extra_kinds",
    "hf_features",
    "image_column",
    "label_column",
    "same_columns",
]

_IMAGE_NAMES = ("image", "img")
_PATH_NAMES = ("image_path", "path", "file_name", "filename")


def hf_features(schema: Any) -> dict[str, Any]:
    """The `features` that `datasets` stores in the schema metadata ({} when absent or bad)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(raw)["info"]["features"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}
    return features if isinstance(features, dict) else {}


def image_column(
    schema: Any, features: dict[str, Any], wanted: str | None, file: Path
) -> tuple[str, str]:
    """(name, "struct" | "bytes" | "path") of the image column."""
    names = schema.names
    if wanted is None:
        typed = [n for n in names if _image_kind(schema.field(n).type) in ("struct", "bytes")]
        hub = [n for n in names if _feature_type(features, n) == "Image"]
        found = [n for n in _IMAGE_NAMES if n in names]
        found = found or (hub if len(hub) == 1 else []) or (typed if len(typed) == 1 else [])
        found = found or [n for n in _PATH_NAMES if n in names]
        if not found:
            raise BadSourceError(
                f"{describe_path(file)}: no image column among {names}; name it with "
                "image=... (a struct of bytes + path, a binary or a path column)"
            )
        wanted = found[0]
    if wanted not in names:
        raise BadSourceError(
            f"{describe_path(file)}: no column {wanted!r} for the images; it has {names}"
        )
    kind = _image_kind(schema.field(wanted).type)
    if kind is None:
        raise BadSourceError(
            f"{describe_path(file)}: column {wanted!r} is {schema.field(wanted).type}: an image "
            "column must be a struct of bytes + path (Hugging Face Image), binary or a path"
        )
    return wanted, kind


def _image_kind(arrow_type: Any) -> str | None:
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        children = {arrow_type.field(i).name for i in range(arrow_type.num_fields)}
        return "struct" if "bytes" in children else None
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return "bytes"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "path"
    return None


def _feature_type(features: dict[str, Any], name: str) -> str | None:
    feature = features.get(name)
    return feature.get("_type") if isinstance(feature, dict) else None


def label_column(
    schema: Any, features: dict[str, Any], wanted: str | None, image: str, file: Path
) -> str | None:
    """The label column: `wanted`, else `label`, else the only ClassLabel; None: no label."""
    import pyarrow as pa

    names = [n for n in schema.names if n != image]
    if wanted is None:
        hub = [n for n in names if _feature_type(features, n) == "ClassLabel"]
        wanted = "label" if "label" in names else (hub[0] if len(hub) == 1 else None)
        if wanted is None:
            return None
    if wanted not in names:
        raise BadSourceError(
            f"{describe_path(file)}: no label column {wanted!r}; the columns are {schema.names}"
        )
    arrow_type = schema.field(wanted).type
    if not (pa.types.is_integer(arrow_type) or pa.types.is_string(arrow_type)):
        raise BadSourceError(
            f"{describe_path(file)}: label column {wanted!r} is {arrow_type}: a label is a class index (an integer) "
            "or a class name (a string); pass label=... to name another column"
        )
    return wanted


def extra_kinds(
    schema: Any, image: str, label: str | None, wanted: Sequence[str] | None, file: Path
) -> dict[str, str]:
    """Field kind ("text" / "json") of every kept column besides the image and the label."""
    import pyarrow as pa

    rest = [n for n in schema.names if n not in (image, label)]
    chosen = list(wanted) if wanted is not None else rest
    kinds: dict[str, str] = {}
    for name in chosen:
        if name not in rest:
            raise BadSourceError(
                f"{describe_path(file)}: columns=[...] names {name!r}, which is not one of the "
                f"columns besides the image and the label: {rest}"
            )
        arrow_type = schema.field(name).type
        if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
            problem = f"is binary ({arrow_type}), which no field kind stores"
        elif not name.isidentifier() or name in ("image", "label", "labels"):
            problem = "is not a usable field name (an identifier other than image/label/labels)"
        elif pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
            kinds[name] = "text"
            continue
        elif _jsonable(arrow_type):
            kinds[name] = "json"
            continue
        else:
            problem = f"is {arrow_type}, which has no JSON form (dates, decimals, binary)"
        raise BadSourceError(
            f"{describe_path(file)}: column {name!r} {problem}; leave it out with columns=[...] "
            "listing the columns to keep"
        )
    return kinds


def _jsonable(arrow_type: Any) -> bool:
    """Whether a column's values are JSON values: numbers, booleans, strings, lists, structs."""
    import pyarrow as pa

    t = pa.types
    if t.is_null(arrow_type) or t.is_boolean(arrow_type) or t.is_integer(arrow_type):
        return True
    if t.is_floating(arrow_type) or t.is_string(arrow_type) or t.is_large_string(arrow_type):
        return True
    if t.is_list(arrow_type) or t.is_large_list(arrow_type) or t.is_fixed_size_list(arrow_type):
        return _jsonable(arrow_type.value_type)
    if t.is_struct(arrow_type):
        return all(_jsonable(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    return False


def same_columns(schema: Any, first: Any, file: Path, first_file: Path) -> None:
    if schema.names != first.names or schema.types != first.types:
        raise BadSourceError(
            f"{file}: its columns {describe_schema(schema)} differ from those of {first_file} "
            f"{describe_schema(first)}; shard files of one schema together (or leave this one out)"
        )


def describe_schema(schema: Any) -> str:
    return ", ".join(
        f"{name}: {kind}" for name, kind in zip(schema.names, schema.types, strict=True)
    )


def class_names(
    classes: Sequence[str] | None, features: dict[str, Any], label: str | None
) -> list[str] | None:
    if classes is not None:
        return list(classes)
    feature = features.get(label) if label is not None else None
    names = feature.get("names") if isinstance(feature, dict) else None
    return [str(n) for n in names] if isinstance(names, list) and names else None
