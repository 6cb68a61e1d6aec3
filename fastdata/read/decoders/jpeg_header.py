"""A JPEG's stored size from its frame header, without decoding (pure Python, microseconds).

The nvjpeg backend draws each sample's crop box in its read thread, before the GPU decodes the
batch, so the draws overlap the decode instead of following it; that needs the image's size from
the bytes alone. Pillow's lazy open would do, at ~10x the cost and with PIL imported.
"""

from __future__ import annotations

__all__ = ["jpeg_size"]

# Start-of-frame markers (baseline, extended, progressive, lossless; Huffman and arithmetic). Not
# 0xC4 (DHT), 0xC8 (reserved), 0xCC (DAC), which share the range.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length field: TEM and RST0-7.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


def jpeg_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """(height, width) of a JPEG from its SOF segment; None if the bytes are not a JPEG whose
    header can be read (not JPEG, truncated before the frame header, a zero dimension).

    The size is the stored one (EXIF orientation is not applied), as nvJPEG and the CPU decoders
    return it. The marker walk stops at the first frame header, so it reads only the header bytes.
    """
    view = memoryview(data)
    n = len(view)
    if n < 4 or view[0] != 0xFF or view[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if view[i] != 0xFF:
            return None  # not at a marker: corrupt header
        marker = view[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI or start of scan before any frame header
            return None
        length = (view[i + 2] << 8) | view[i + 3]
        if length < 2:
            return None
        if marker in _SOF:
            if i + 9 > n:
                return None
            height = (view[i + 5] << 8) | view[i + 6]
            width = (view[i + 7] << 8) | view[i + 8]
            return (height, width) if height and width else None
        i += 2 + length
    return None
