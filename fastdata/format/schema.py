"""The sample schema: how one sample is laid out in a shard, for the writer and every reader.

One table (webdataset's handler-registry idea): the writer, the cpu and memory backends, `verify`
and the DALI graphs all read the component names, the key format and the label encoding from
here, so none of them hard-codes which tar member holds the image or the label.

A sample ``<split>_<sample_id:08d>`` has these components (tar members ``<key>.<ext>``):

| component | content |
|-----------|---------|
| ``jpg`` / ``png`` | an encoded image (JPEG bytes are kept byte-identical from the source) |
| ``rgb``   | raw uint8 pixels, HWC, shape given by the split's ``raw_shape`` in the manifest |
| ``cls``   | the label as ASCII decimal (the WebDataset convention) |
| ``lid``   | 16 bytes: little-endian int64 label, then int64 sample id (binary readers, DALI) |

Other tools' shards, read in place through `fastdata index`, keep their own keys (members grouped
as webdataset groups them: `split_member`) and have no ``lid``: the label is ``cls``, the sample id
the sample's position in its split.

Beside each shard, a ``sums`` file lists a BLAKE2b-128 digest of every sample's components
(`sample_digest`), for readers that check samples (`verify_samples=True`): a header line
``fastdata-sums v1 blake2b-128 N``, then ``KEY HEX`` for each of the N samples in shard order.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import numpy as np

from fastdata.format.video import VIDEO_EXTS

__all__ = [
    "ENCODED_EXTS",
    "IMAGE_EXTS",
    "LABEL_EXT",
    "LABEL_TEXT_EXT",
    "RAW_EXT",
    "SUMS_HEADER",
    "VIDEO_ENCODING",
    "MissingComponentError",
    "components",
    "decode_lid",
    "encode_lid",
    "encoding_of_exts",
    "exts_of_encoding",
    "image_component",
    "label_and_id",
    "sample_digest",
    "sample_key",
    "split_member",
    "sums_text",
]

RAW_EXT = "rgb"
#: Encoded image components a reader accepts, in the order it looks for them.
ENCODED_EXTS: tuple[str, ...] = ("jpg", "png", "jpeg", "webp")
IMAGE_EXTS: tuple[str, ...] = (RAW_EXT, *ENCODED_EXTS)
LABEL_EXT = "lid"
LABEL_TEXT_EXT = "cls"
SUMS_HEADER = "fastdata-sums v1 blake2b-128"

# A split's manifest "encoding" <-> the image components its shards hold.
_ENCODING_EXTS: dict[str, tuple[str, ...]] = {
    "raw": (RAW_EXT,),
    "png": ("png",),
    "jpeg": ("jpg",),
    "mixed": ("jpg", "png"),
    "video": VIDEO_EXTS,
}
#: The manifest encoding of a split of videos (`fastdata.format.video`).
VIDEO_ENCODING = "video"


class MissingComponentError(ValueError):
    """A sample lacks a component the schema requires (the caller adds shard and key)."""


def sample_key(split: str, sample_id: int) -> str:
    """The key of a sample: ``<split>_<sample_id:08d>`` (dots and slashes in `split` become _)."""
    safe_split = split.replace(".", "_").replace("/", "_")
    return f"{safe_split}_{sample_id:08d}"


def encode_lid(label: int, sample_id: int) -> bytes:
    """The 16-byte ``lid`` component."""
    return np.array([label, sample_id], dtype="<i8").tobytes()


def decode_lid(data: bytes | memoryview) -> tuple[int, int]:
    """(label, sample id) of a ``lid`` component."""
    if len(data) != 16:
        raise ValueError(f"'lid' component has {len(data)} bytes, expected 16")
    label, sample_id = np.frombuffer(data, dtype="<i8", count=2)
    return int(label), int(sample_id)


def components(image_ext: str, image: bytes, label: int, sample_id: int) -> dict[str, bytes]:
    """Every component of one sample, as the writer stores them (a video sample: its video
    component in place of the image; the writer adds its clip index, `fastdata.format.video`)."""
    if image_ext not in IMAGE_EXTS and image_ext not in VIDEO_EXTS:
        raise ValueError(
            f"image component must be one of {IMAGE_EXTS + VIDEO_EXTS}, got {image_ext!r}"
        )
    return {
        image_ext: image,
        LABEL_TEXT_EXT: str(label).encode(),
        LABEL_EXT: encode_lid(label, sample_id),
    }


def image_component(parts: Mapping[str, bytes | memoryview]) -> tuple[str, bytes | memoryview]:
    """(ext, bytes) of the sample's image; MissingComponentError when it has none."""
    for ext in IMAGE_EXTS:
        if ext in parts:
            return ext, parts[ext]
    raise MissingComponentError(
        f"sample has no image component (looked for {IMAGE_EXTS}, found {sorted(parts)})"
    )


def split_member(name: str) -> tuple[str, str] | None:
    """(key, component) of a tar member, grouped as webdataset groups them: the key is the
    member's path up to the first dot of its base name (``a/b.c/000012.mask.png`` ->
    ``("a/b.c/000012", "mask.png")``); None for a member that belongs to no sample (no dot in
    its base name, or nothing before or after the dot)."""
    head, slash, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem or not ext:
        return None
    return head + slash + stem, ext


_OWN_KEY = re.compile(r"^[^/.]*_(\d{8,})$")


def label_and_id(
    key: str, parts: Mapping[str, bytes | memoryview], position: int | None = None
) -> tuple[int, int]:
    """(label, sample id) of a sample: from ``lid``, else ``cls`` and the key.

    A key written by this project (``<split>_<id:08d>``) gives the id; a foreign key (another
    tool's shard, read through `fastdata index`) has none: its id is `position`, the sample's
    position in its split (`fastdata.read.shardio.ShardReader.position`), or -1 when the caller
    does not give it.
    """
    if LABEL_EXT in parts:
        return decode_lid(parts[LABEL_EXT])
    if LABEL_TEXT_EXT in parts:
        try:
            label = int(bytes(parts[LABEL_TEXT_EXT]))
        except ValueError as exc:
            raise MissingComponentError(f"unreadable label ({exc})") from exc
        own = _OWN_KEY.match(key)
        if own is not None:
            return label, int(own.group(1))
        return label, -1 if position is None else position
    raise MissingComponentError(
        f"sample has no label component (looked for {LABEL_EXT!r}, {LABEL_TEXT_EXT!r}, "
        f"found {sorted(parts)})"
    )


def exts_of_encoding(encoding: str) -> tuple[str, ...]:
    """The image components of a split with this manifest encoding."""
    if encoding not in _ENCODING_EXTS:
        raise ValueError(f"unknown split encoding {encoding!r}; known: {sorted(_ENCODING_EXTS)}")
    return _ENCODING_EXTS[encoding]


def encoding_of_exts(exts: list[str] | tuple[str, ...]) -> str:
    """The manifest encoding of a split whose shards hold these image (or video) components."""
    found = tuple(sorted(set(exts)))
    if found and set(found) <= set(VIDEO_EXTS):
        return VIDEO_ENCODING
    for encoding, expected in _ENCODING_EXTS.items():
        if found == tuple(sorted(expected)) and encoding != "mixed":
            return encoding
    return "mixed"


def sample_digest(parts: Mapping[str, bytes | memoryview]) -> str:
    """Hex BLAKE2b-128 of a sample's components (sorted by extension, each framed by name
    and size), as written to the `sums` file."""
    digest = hashlib.blake2b(digest_size=16)
    for ext in sorted(parts):
        data = parts[ext]
        digest.update(b"%s\0%d\0" % (ext.encode(), len(data)))
        digest.update(data)
    return digest.hexdigest()


def sums_text(keys: list[str], digests: list[str]) -> str:
    """The `sums` file of a shard whose samples have these keys and digests."""
    lines = [f"{SUMS_HEADER} {len(keys)}"]
    lines += [f"{k} {d}" for k, d in zip(keys, digests, strict=True)]
    return "\n".join(lines) + "\n"
