"""A sample's fields: what a split's samples hold, how each is stored in a tar and decoded.

The one table (webdataset's handler-registry idea) that maps field -> tar components -> decoder,
read by the writer, every reader, `verify`, `fastdata index` and the DALI graphs. A split's
manifest entry lists its fields (`SplitInfo.fields`); manifests written before fields existed
hold an image and a label (`default_fields`).

| kind     | components (written)        | decoded value (`FieldKind.decode`)                         | batch (dict batches)            |
|----------|-----------------------------|------------------------------------------------------------|---------------------------------|
| `image`  | `jpg`/`png`/`rgb` (one)     | the component's bytes (decoded by `fastdata.read.decoders.image`)  | uint8 (N, 3, H, W)              |
| `label`  | `cls` (+ `lid`)             | int                                                        | int64 (N,)                      |
| `labels` | `labels.npy`                | int64 (k,) class indices, any k                            | multi-hot float32 (N, classes)  |
| `mask`   | `mask.png`                  | uint8 or uint16 (H, W), the image's size                   | int64 (N, H, W)                 |
| `boxes`  | `boxes.npy`, `box_labels.npy` | (float32 (k, 4) xyxy pixels, int64 (k,) classes)         | lists of tensors                |
| `text`   | `txt`                       | str (UTF-8)                                                | list of str                     |
| `array`  | `npy`                       | numpy array (no pickles)                                   | stacked when shapes agree, else list |
| `tensors` | `ten` (webdataset tenbin)  | list of numpy arrays (`fastdata.format.tenbin`)                   | list of stacked tensors, one per position, when every sample's agree; else a list of lists |
| `json`   | `json`                      | the parsed JSON value                                      | list                            |

Field *names* are free (a split may hold a `caption` text and a `meta` json); each names its kind
and its components. A component is a tar member's extension: everything after the first dot of
the member's base name, as in webdataset (`000012.mask.png` -> `mask.png`).

A component compressed by webdataset's convention (`txt.gz`, `json.gz`, `cls.gz`, `npy.gz`: its
`gzfilter` decompresses any `*.gz` and decodes by the inner extension) is typed by its inner
extension and decompressed by `FieldSpec.decode`, bounded by `MAX_INFLATED_BYTES`
(`gunzip_bounded`): a decompression bomb is an error, not an allocation.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "FIELD_KINDS",
    "FieldError",
    "FieldKind",
    "FieldSpec",
    "MAX_INFLATED_BYTES",
    "MAX_JSON_BYTES",
    "MASK_MODES",
    "MAX_MASK_PIXELS",
    "default_fields",
    "gunzip_bounded",
    "fields_from_json",
    "fields_to_json",
    "is_classification",
    "read_mask_png",
]

MAX_JSON_BYTES = 16 << 20  # a json/text component larger than this is refused, not parsed
MAX_MASK_PIXELS = 1 << 28  # a mask PNG whose header claims more is refused before decoding
_MAX_BOXES = 1 << 20
#: The most bytes one gzip-compressed component (`txt.gz`, `npy.gz`, ...) may decompress to.
MAX_INFLATED_BYTES = 256 << 20
GZ_SUFFIX = ".gz"

Parts = Mapping[str, bytes | memoryview]


class FieldError(ValueError):
    """A field's component is missing or cannot be decoded (the caller adds shard and key)."""


@dataclass(frozen=True)
class FieldKind:
    """How one kind of field is stored and decoded.

    Args:
        name: the kind ("image", "label", ...).
        components: the tar components the writer stores, in order.
        encode: value -> {component: bytes}.
        decode: {component: bytes} -> value (raises FieldError).
        doc: one line for `fastdata inspect` and the docs.
    """

    name: str
    components: tuple[str, ...]
    encode: Callable[[Any], dict[str, bytes]]
    decode: Callable[[Parts], Any]
    doc: str


@dataclass(frozen=True)
class FieldSpec:
    """One field of a split: its name in a batch, its kind, the components it is read from."""

    name: str
    kind: str
    components: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in FIELD_KINDS:
            raise FieldError(
                f"field {self.name!r}: unknown kind {self.kind!r}; known: {sorted(FIELD_KINDS)}"
            )
        if not self.components or not all(isinstance(c, str) and c for c in self.components):
            raise FieldError(f"field {self.name!r}: components must be non-empty names")

    def decode(self, parts: Parts) -> Any:
        """The field's value from a sample's components (only this field's are looked at); a
        `*.gz` component is decompressed first (`gunzip_bounded`)."""
        own = {
            c: gunzip_bounded(parts[c], c) if c.lower().endswith(GZ_SUFFIX) else parts[c]
            for c in self.components
            if c in parts
        }
        if self.kind in ("image", "label"):
            if not own:
                raise FieldError(
                    f"field {self.name!r} has none of its components {list(self.components)} "
                    f"(sample has {sorted(parts)})"
                )
            return FIELD_KINDS[self.kind].decode(own)
        missing = [c for c in self.components if c not in parts]
        if missing:
            raise FieldError(
                f"field {self.name!r} lacks component(s) {missing} (sample has {sorted(parts)})"
            )
        return FIELD_KINDS[self.kind].decode(own)

    def encode(self, value: Any) -> dict[str, bytes]:
        """{component: bytes} for a value of this field (names them by this spec's components)."""
        stored = FIELD_KINDS[self.kind].encode(value)
        if len(stored) != len(self.components) or self.kind == "image":
            return stored
        return dict(zip(self.components, stored.values(), strict=True))


def gunzip_bounded(data: bytes | memoryview, component: str, limit: int | None = None) -> bytes:
    """A gzip-compressed component's bytes, decompressed to at most `limit` bytes (None:
    `MAX_INFLATED_BYTES`).

    Raises:
        FieldError: not gzip data, or more than `limit` bytes once decompressed (a decompression
            bomb: refused before the bytes are allocated); the caller adds shard and key.
    """
    import zlib

    limit = MAX_INFLATED_BYTES if limit is None else limit
    inflater = zlib.decompressobj(wbits=31)  # gzip header and trailer
    try:
        out = inflater.decompress(bytes(data), limit + 1)
        more = bool(inflater.unconsumed_tail)
        if not more:
            out += inflater.flush(limit + 1 - len(out))
    except zlib.error as exc:
        raise FieldError(f"component {component!r} is not readable gzip data ({exc})") from exc
    if more or len(out) > limit:
        raise FieldError(
            f"component {component!r} decompresses to more than {limit} bytes (a decompression "
            "bomb, or a component too large for one sample); store it uncompressed or smaller"
        )
    if not inflater.eof:
        raise FieldError(f"component {component!r}: its gzip stream is cut short")
    return out


def _npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(array), allow_pickle=False)
    return out.getvalue()


def _npy(data: bytes | memoryview, what: str) -> np.ndarray:
    """An .npy component, its header checked against its size before anything is allocated (a
    header may claim any shape: np.load would allocate it first). The header is parsed once (an
    `ast.literal_eval` in numpy); the body is copied out of the bytes as np.load would."""
    raw = bytes(data)
    stream = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unknown .npy version {version}")
        if dtype.hasobject:
            raise FieldError(f"{what}: an .npy of objects (pickles) is refused")
        body = len(raw) - stream.tell()
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != body:
            raise FieldError(
                f"{what}: the .npy header says {shape} {dtype} but {body} bytes of data follow"
            )
        flat = np.frombuffer(raw, dtype=dtype, offset=stream.tell())
        array = flat.reshape(shape, order="F" if fortran else "C").copy(order="K")
    except (ValueError, OSError, EOFError) as exc:
        if isinstance(exc, FieldError):
            raise
        raise FieldError(f"{what}: not a readable .npy array ({exc})") from exc
    if not isinstance(array, np.ndarray) or array.dtype.hasobject:
        raise FieldError(f"{what}: an .npy of objects is refused")
    return array


def _one(parts: Parts) -> bytes | memoryview:
    return next(iter(parts.values()))


# image ----------------------------------------------------------------------------------------
def _image_decode(parts: Parts) -> bytes | memoryview:
    return _one(parts)


def _image_encode(value: Any) -> dict[str, bytes]:
    ext, data = value  # (component, bytes): the writer chooses the encoding
    return {ext: bytes(data)}


# label ----------------------------------------------------------------------------------------
def _label_decode(parts: Parts) -> int:
    if "lid" in parts:
        data = parts["lid"]
        if len(data) != 16:
            raise FieldError(f"'lid' component has {len(data)} bytes, expected 16")
        return int(np.frombuffer(data, dtype="<i8", count=1)[0])
    text = bytes(_one(parts)).strip()
    try:
        return int(text)
    except ValueError as exc:
        raise FieldError(f"label {text[:40]!r} is not an integer") from exc


def _label_encode(value: Any) -> dict[str, bytes]:
    return {"cls": str(int(value)).encode()}


# labels (multi-label) -------------------------------------------------------------------------
def _labels_decode(parts: Parts) -> np.ndarray:
    array = _npy(_one(parts), "labels")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise FieldError(f"labels: expected a 1-D integer array, got {array.dtype} {array.shape}")
    return array.astype(np.int64, copy=False)


def _labels_encode(value: Any) -> dict[str, bytes]:
    return {"labels.npy": _npy_bytes(np.asarray(value, dtype=np.int64).reshape(-1))}


# mask -----------------------------------------------------------------------------------------
#: PNG modes read as a class map: 8-bit grey, palette (its indices), 16-bit grey.
MASK_MODES = ("L", "P", "I;16", "I;16L", "I;16B", "I;16N", "I")


def read_mask_png(
    data: bytes,
    max_pixels: int | None = MAX_MASK_PIXELS,
    explain: Callable[[Exception, bytes], str] | None = None,
) -> np.ndarray:
    """A mask PNG as an (H, W) uint8 or uint16 class map: the one check of the writer and readers.

    Args:
        data: the PNG's bytes.
        max_pixels: most width x height, checked from the header before decoding; None: no bound.
        explain: why Pillow could not read `data` (the writer names the file's real format);
            default Pillow's message.

    Raises:
        FieldError: not a PNG, larger than `max_pixels`, not a single-channel map (`MASK_MODES`:
            grey or palette; colour masks must be converted to class indices first), unreadable,
            or values outside 0..65535.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "PNG":
                raise FieldError(f"mask: expected a PNG, got {image.format}")
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise FieldError(
                    f"mask: {image.width} x {image.height} is more than {max_pixels:,} pixels"
                )
            if image.mode not in MASK_MODES:
                raise FieldError(
                    f"mask: PNG mode {image.mode} is not a single-channel class map (8/16-bit "
                    "grey or palette); convert colour masks to class indices first"
                )
            mask = np.asarray(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        if isinstance(exc, FieldError):
            raise
        raise FieldError(f"mask: unreadable PNG ({_unreadable(exc, data, explain)})") from exc
    if mask.dtype.kind not in "iu" or mask.ndim != 2:
        raise FieldError(f"mask: expected an (H, W) integer map, got {mask.dtype} {mask.shape}")
    if mask.size and (mask.min() < 0 or mask.max() > 65535):
        raise FieldError("mask: values must be 0..65535")
    return mask.astype(np.uint16 if mask.max(initial=0) > 255 else np.uint8, copy=False)


def _unreadable(
    exc: Exception, data: bytes, explain: Callable[[Exception, bytes], str] | None
) -> str:
    from PIL import Image

    if explain is not None:
        return explain(exc, data)
    if isinstance(exc, Image.UnidentifiedImageError):
        # Pillow's message names a BytesIO object, not the file: say what the bytes are.
        return f"not an image Pillow can identify, starts {data[:8]!r}"
    return str(exc)


def _mask_decode(parts: Parts) -> np.ndarray:
    return read_mask_png(bytes(_one(parts)))


def _mask_encode(value: Any) -> dict[str, bytes]:
    from PIL import Image

    mask = np.asarray(value)
    if mask.ndim != 2 or mask.dtype.kind not in "iu" or mask.min(initial=0) < 0:
        raise FieldError(
            f"mask: expected a non-negative (H, W) integer map, got {mask.dtype} {mask.shape}"
        )
    if mask.max(initial=0) > 65535:
        raise FieldError("mask: values above 65535 do not fit a 16-bit PNG")
    big = mask.max(initial=0) > 255
    image = Image.fromarray(
        mask.astype(np.uint16 if big else np.uint8), mode="I;16" if big else "L"
    )
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=False, compress_level=1)
    return {"mask.png": out.getvalue()}


# boxes ----------------------------------------------------------------------------------------
def _boxes_decode(parts: Parts) -> tuple[np.ndarray, np.ndarray]:
    data = list(parts.values())
    boxes = _npy(data[0], "boxes")
    labels = _npy(data[1], "box_labels")
    if boxes.ndim != 2 or boxes.shape[1] != 4 or boxes.dtype.kind != "f":
        raise FieldError(f"boxes: expected float (k, 4) xyxy, got {boxes.dtype} {boxes.shape}")
    if labels.shape != (boxes.shape[0],) or labels.dtype.kind not in "iu":
        raise FieldError(
            f"box_labels: expected int ({boxes.shape[0]},), got {labels.dtype} {labels.shape}"
        )
    if boxes.shape[0] > _MAX_BOXES:
        raise FieldError(f"boxes: {boxes.shape[0]} boxes is more than {_MAX_BOXES}")
    boxes = boxes.astype(np.float32, copy=False)
    if not np.isfinite(boxes).all() or (boxes[:, 2:] < boxes[:, :2]).any():
        raise FieldError("boxes: every box must be finite with x1 >= x0 and y1 >= y0")
    return boxes, labels.astype(np.int64, copy=False)


def _boxes_encode(value: Any) -> dict[str, bytes]:
    boxes, labels = value
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if labels.shape[0] != boxes.shape[0]:
        raise FieldError(f"boxes: {boxes.shape[0]} boxes but {labels.shape[0]} labels")
    return {"boxes.npy": _npy_bytes(boxes), "box_labels.npy": _npy_bytes(labels)}


# text, array, json ----------------------------------------------------------------------------
def _text_decode(parts: Parts) -> str:
    data = _one(parts)
    if len(data) > MAX_JSON_BYTES:
        raise FieldError(f"text: {len(data)} bytes is more than {MAX_JSON_BYTES}")
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FieldError(f"text: not UTF-8 ({exc})") from exc


def _text_encode(value: Any) -> dict[str, bytes]:
    return {"txt": str(value).encode("utf-8")}


def _array_decode(parts: Parts) -> np.ndarray:
    return _npy(_one(parts), "array")


def _array_encode(value: Any) -> dict[str, bytes]:
    return {"npy": _npy_bytes(np.asarray(value))}


def _tensors_decode(parts: Parts) -> list[np.ndarray]:
    from fastdata.format.tenbin import TenbinError, decode_tenbin

    try:
        return decode_tenbin(_one(parts))
    except TenbinError as exc:
        raise FieldError(f"tensors: not a readable .ten member ({exc})") from exc


def _tensors_encode(value: Any) -> dict[str, bytes]:
    from fastdata.format.tenbin import TenbinError, encode_tenbin

    try:
        return {"ten": encode_tenbin([np.asarray(a) for a in value])}
    except TenbinError as exc:
        raise FieldError(f"tensors: {exc}") from exc


def _json_decode(parts: Parts) -> Any:
    text = _text_decode(parts)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FieldError(f"json: not valid JSON ({exc})") from exc


def _json_encode(value: Any) -> dict[str, bytes]:
    return {"json": json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")}


FIELD_KINDS: dict[str, FieldKind] = {
    k.name: k
    for k in (
        FieldKind(
            "image",
            ("jpg", "png", "rgb"),
            _image_encode,
            _image_decode,
            "an image (jpg, png or raw rgb)",
        ),
        FieldKind("label", ("cls", "lid"), _label_encode, _label_decode, "one class index"),
        FieldKind(
            "labels", ("labels.npy",), _labels_encode, _labels_decode, "class indices (multi-label)"
        ),
        FieldKind(
            "mask",
            ("mask.png",),
            _mask_encode,
            _mask_decode,
            "a per-pixel class map (PNG, 8/16-bit)",
        ),
        FieldKind(
            "boxes",
            ("boxes.npy", "box_labels.npy"),
            _boxes_encode,
            _boxes_decode,
            "boxes xyxy (pixels) and their classes",
        ),
        FieldKind("text", ("txt",), _text_encode, _text_decode, "UTF-8 text"),
        FieldKind("array", ("npy",), _array_encode, _array_decode, "a numpy array"),
        FieldKind("json", ("json",), _json_encode, _json_decode, "any JSON value"),
        FieldKind(
            "tensors",
            ("ten",),
            _tensors_encode,
            _tensors_decode,
            "numpy arrays in webdataset's tenbin format",
        ),
    )
}


def default_fields(image_components: Iterable[str]) -> dict[str, FieldSpec]:
    """The fields of a split written before fields existed: its image and its label."""
    return {
        "image": FieldSpec("image", "image", tuple(image_components)),
        "label": FieldSpec("label", "label", ("lid", "cls")),
    }


def is_classification(fields: Mapping[str, FieldSpec]) -> bool:
    """True when a split holds exactly an image and one label: its batches are `(x, y)`."""
    return sorted(f.kind for f in fields.values()) == ["image", "label"]


def fields_to_json(fields: Mapping[str, FieldSpec]) -> dict[str, Any]:
    """The manifest's `fields` object of a split."""
    return {n: {"kind": f.kind, "components": list(f.components)} for n, f in fields.items()}


def fields_from_json(data: Any, where: str) -> dict[str, FieldSpec]:
    """Parse and check a split's `fields` object.

    Raises:
        FieldError: not an object of name -> {kind, components}, an unknown kind, two fields
            reading one component, or no image field (names `where`).
    """
    if not isinstance(data, dict) or not data:
        raise FieldError(f"{where}: 'fields' must be a non-empty object of name -> field")
    out: dict[str, FieldSpec] = {}
    owner: dict[str, str] = {}
    for name, spec in data.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise FieldError(f"{where}: field name {name!r} must be an identifier")
        if not isinstance(spec, dict) or not isinstance(spec.get("components"), list):
            raise FieldError(
                f"{where}: field {name!r} must be {{'kind': ..., 'components': [...]}}"
            )
        try:
            out[name] = FieldSpec(name, str(spec.get("kind")), tuple(spec["components"]))
        except FieldError as exc:
            raise FieldError(f"{where}: {exc}") from exc
        for comp in out[name].components:
            if comp in owner:
                raise FieldError(
                    f"{where}: component {comp!r} belongs to fields {owner[comp]!r} and {name!r}"
                )
            owner[comp] = name
    images = sum(f.kind == "image" for f in out.values())
    if images > 1:
        raise FieldError(f"{where}: a split holds at most one image field, got {sorted(out)}")
    if not images and any(f.kind in ("mask", "boxes") for f in out.values()):
        raise FieldError(
            f"{where}: mask and boxes fields are placed on an image, but the split has none "
            f"({sorted(out)})"
        )
    if images and (out.get("image") is None or out["image"].kind != "image"):
        raise FieldError(f"{where}: the image field must be named 'image' (batches use that key)")
    if "padded" in out:
        raise FieldError(f"{where}: 'padded' is a batch key of its own, not a field name")
    return out
