"""Say why an image file cannot be read, in words a person can act on.

Used by `fastdata.write.images` once decoding has failed: which container the bytes are (from
their signature, not the file name), whether the file was cut short (and by how many bytes, where
the container records lengths), or what the file starts with when it is no image at all.

How much of a truncation can be measured depends on the container: WebP (RIFF) and BMP record
the file's size, so the missing count is exact; PNG records each chunk's length, so the count is
a lower bound; JPEG records the length of its header segments but not of the compressed pixels,
so a file cut inside the pixels is reported by where it stops.
"""

from __future__ import annotations

import re

__all__ = ["describe_truncation", "not_an_image", "sniff_format"]

# (offset, signature, format) of the containers we can name from their first bytes.
_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\xff\xd8\xff", "JPEG"),
    (0, b"\x89PNG\r\n\x1a\n", "PNG"),
    (0, b"GIF87a", "GIF"),
    (0, b"GIF89a", "GIF"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
    (0, b"II+\x00", "TIFF"),  # BigTIFF
    (0, b"MM\x00+", "TIFF"),
    (0, b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
    (0, b"\xff\x4f\xff\x51", "JPEG 2000"),  # a bare J2K codestream
    (0, b"8BPS", "PSD"),
    (0, b"qoif", "QOI"),
)
_FTYP_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIF", b"heix": "HEIF", b"mif1": "HEIF"}
_BMP_HEADER_SIZES = (12, 40, 52, 56, 64, 108, 124)
_PNM = re.compile(rb"P[1-7]\s")
_PREVIEW_CHARS = 24


def sniff_format(data: bytes) -> str | None:
    """The image container named by the bytes' signature ("JPEG", "WebP", ...), or None."""
    for offset, signature, name in _SIGNATURES:
        if data[offset : offset + len(signature)] == signature:
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[4:8] == b"ftyp" and data[8:12] in _FTYP_BRANDS:
        return _FTYP_BRANDS[data[8:12]]
    if data[:2] == b"BM" and _le(data, 14, 4) in _BMP_HEADER_SIZES:
        return "BMP"
    if _PNM.match(data[:3]):
        return "PNM"
    return None


def describe_truncation(fmt: str, data: bytes) -> str | None:
    """How the file of container `fmt` is cut short ("37 bytes missing"), or None if it is not."""
    check = _TRUNCATION_CHECKS.get(fmt)
    reason = check(data) if check is not None else None
    return None if reason is None else f"{reason}; copy the file again from where it came from"


def not_an_image(data: bytes) -> str:
    """'not an image: starts with ...' for bytes with no known image signature."""
    text = data[: _PREVIEW_CHARS * 4].decode("utf-8", errors="replace")[:_PREVIEW_CHARS]
    shown = text.replace("\n", " ").replace("\r", " ").replace("\t", " ")
    if "\ufffd" not in text and shown.isprintable():
        more = "…" if len(data) > len(text.encode()) else ""
        lower = text.lower()
        web_page = "<html" in lower or "<!doctype html" in lower
        hint = " (a web page: a failed download?)" if web_page else ""
        return f"not an image: starts with '{shown}{more}'{hint}"
    shown_bytes = " ".join(f"{b:02x}" for b in data[:12])
    return f"not an image: starts with bytes {shown_bytes} (no known image signature)"


# ----------------------------------------------------------------------------- containers


def _le(data: bytes, offset: int, size: int) -> int:
    return int.from_bytes(data[offset : offset + size], "little")


def _be(data: bytes, offset: int, size: int) -> int:
    return int.from_bytes(data[offset : offset + size], "big")


def _riff_truncation(data: bytes) -> str | None:
    size = _le(data, 4, 4)
    expected = 8 + size + (size & 1)  # chunks are padded to an even size
    if len(data) < expected:
        return f"{expected - len(data):,} bytes missing"
    return None


def _bmp_truncation(data: bytes) -> str | None:
    size = _le(data, 2, 4)  # 0 in some writers: then nothing is known
    if size and len(data) < size:
        return f"{size - len(data):,} bytes missing"
    return None


def _png_truncation(data: bytes) -> str | None:
    pos, n = 8, len(data)
    while pos + 8 <= n:
        kind = data[pos + 4 : pos + 8]
        end = pos + 12 + _be(data, pos, 4)  # length, type, data, CRC
        if kind == b"IEND":
            return None
        if end > n:
            name = kind.decode("latin-1")
            return f"at least {end - n + 12:,} bytes missing (cut inside its {name} chunk)"
        pos = end
    return f"at least {pos + 12 - n:,} bytes missing (no IEND chunk)"


def _gif_truncation(data: bytes) -> str | None:
    if data.rstrip(b"\x00")[-1:] != b";":
        return f"the file stops after {len(data):,} bytes, without the GIF trailer"
    return None


def _jpeg_truncation(data: bytes) -> str | None:
    """Walk the marker segments; only the compressed pixels after SOS lack a length."""
    pos, n = 2, len(data)
    while pos < n:
        if data[pos] != 0xFF:
            return None  # no marker where one must be: corrupt, not cut short
        while pos < n and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= n:
            break
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # end of image
            return None
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a segment
            continue
        end = pos + _be(data, pos, 2)
        if pos + 2 > n or end > n:
            return f"at least {max(end, pos + 2) - n + 2:,} bytes missing (cut inside a header)"
        pos = end
        if marker == 0xDA:  # start of scan: compressed pixels up to the next marker
            pos = _next_marker(data, pos)
            if pos >= n:
                return (
                    f"the file stops after {n:,} bytes, inside the compressed pixels "
                    "(no end-of-image marker)"
                )
    return f"the file stops after {n:,} bytes (no end-of-image marker)"


def _next_marker(data: bytes, pos: int) -> int:
    """Index of the next marker after entropy-coded data (FF00 is a stuffed byte, FFD0-D7 RST)."""
    n = len(data)
    while True:
        pos = data.find(b"\xff", pos)
        if pos < 0 or pos + 1 >= n:
            return n
        follower = data[pos + 1]
        if follower != 0x00 and not 0xD0 <= follower <= 0xD7:
            return pos
        pos += 2


_TRUNCATION_CHECKS = {
    "JPEG": _jpeg_truncation,
    "PNG": _png_truncation,
    "WebP": _riff_truncation,
    "BMP": _bmp_truncation,
    "GIF": _gif_truncation,
}
