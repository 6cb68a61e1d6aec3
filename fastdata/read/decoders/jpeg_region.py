"""JPEG crop-region decoding on the CPU: libjpeg-turbo through fastdata's own small extension
(`fastdata.read._jpeg`, built from `_jpeg.c` at install).

libjpeg-turbo decodes a region (`jpeg_crop_scanline` / `jpeg_skip_scanlines`): columns outside it
skip the IDCT and colour conversion, rows above it skip the IDCT, and decoding stops at the box's
last row. The pixels are those of a full Pillow decode (fancy chroma upsampling, islow IDCT, no
EXIF rotation). The extension decodes one image in the thread that then resizes it (the region is
still in the cache).

`region_decoder()` gives this thread's decoder: $FASTDATA_REGION_DECODER picks "libjpeg" or
"pillow" (none); by default ("auto") the extension where it was built (a C compiler and the
libjpeg headers at install time), else None: Pillow-SIMD then decodes whole JPEGs
(`fastdata.read.decoders.image`).

There is no other region decoder. nvImageCodec's CPU decoder was one until 2026-12-05: it cost
more CPU per image than the extension (clothing-small, 224 px, one thread: 0.84 against 0.79 ms
an image for random-resized crops, 0.90 against 0.89 for centre crops; Pillow-SIMD 1.2 and 1.1),
gave the same pixels, and loaded nvImageCodec's CUDA libraries into every cpu-backend worker
that used it (the GPU check of 2026-12-04 saw the cpu row take 3.3 GB of device memory with DALI,
which installs it, against 188 MB without; and its cpu baseline move 2.3x with it). A cpu worker
now imports nothing of NVIDIA's (tests/read/backends/test_cpu_no_cuda.py).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DECODER_ENV",
    "DecoderChoiceError",
    "JpegStream",
    "LibjpegDecoder",
    "RegionDecoder",
    "jpeg_stream",
    "region_decoder",
]

log = logging.getLogger("fastdata")

DECODER_ENV = "FASTDATA_REGION_DECODER"


class DecoderChoiceError(RuntimeError):
    """$FASTDATA_REGION_DECODER names no decoder: a setting to fix, never a bad image (not a
    ValueError, which the readers take for a sample that cannot be decoded, and skip)."""


_local = threading.local()


@dataclass(frozen=True)
class JpegStream:
    """A parsed JPEG and its (width, height) in stored (not EXIF-rotated) pixels.

    Attributes:
        code: what the decoder decodes (the bytes, for `LibjpegDecoder`).
        size: (width, height), as Pillow's `Image.size`.
    """

    code: Any
    size: tuple[int, int]


class RegionDecoder:
    """Decodes JPEG crop regions to RGB; one per thread (`region_decoder()`).

    Attributes:
        name: the library, its version and the backend, for logs and benchmark records.
    """

    name: str = ""

    def open(self, data: memoryview | bytes) -> JpegStream | None:
        """The JPEG's parsed header, None unless it is an 8-bit grey, YCbCr or RGB JPEG."""
        raise NotImplementedError

    def region(self, stream: JpegStream, box: tuple[int, int, int, int]) -> np.ndarray | None:
        """RGB (H, W, 3) pixels of ``box = (left, top, right, bottom)``, None when it fails."""
        raise NotImplementedError


class LibjpegDecoder(RegionDecoder):
    """fastdata's extension (`_jpeg.c`) over the system's libjpeg-turbo.

    It stops decoding at the box's last row (the rows below are never entropy-decoded) and returns
    None on any libjpeg error or warning (truncated or corrupt data), so that Pillow decodes that
    image and says what is wrong with it; damage below the box, or in markers after the scan, is
    not seen (`fastdata shard` and `fastdata verify` decode every image whole). Its pixels equal a
    full Pillow decode's where both link the same libjpeg-turbo (Pillow-SIMD built on this
    system, as `.ci/install.sh` does). It holds no state: nothing to re-create after a fork.

    Raises:
        ImportError: the extension was not built (no C compiler or libjpeg headers at install).
    """

    def __init__(self) -> None:
        from fastdata.read import _jpeg

        self._jpeg = _jpeg
        self.name = f"fastdata._jpeg (libjpeg-turbo {_jpeg.LIBJPEG_TURBO_VERSION}, CPU)"

    def open(self, data: memoryview | bytes) -> JpegStream | None:
        """The JPEG's header; None for one that does not end in an EOI marker (truncated, or with
        bytes after the image), where a box above the missing rows would decode without a word:
        Pillow decodes it whole and says what is wrong."""
        if bytes(data[-2:]) != b"\xff\xd9":
            return None
        found = self._jpeg.info(data)
        return None if found is None else JpegStream(data, (found[0], found[1]))

    def region(self, stream: JpegStream, box: tuple[int, int, int, int]) -> np.ndarray | None:
        left, top, right, bottom = box
        out = np.empty((bottom - top, right - left, 3), dtype=np.uint8)
        ok = self._jpeg.region(stream.code, left, top, right - left, bottom - top, out)
        return out if ok else None


def jpeg_stream(data: memoryview | bytes) -> tuple[RegionDecoder, JpegStream] | None:
    """(this thread's region decoder, the parsed JPEG) when region decoding applies, else None.

    None as well for an image over Pillow's decompression-bomb limit: Pillow then refuses it.
    """
    if bytes(data[:2]) != b"\xff\xd8":  # JPEG's start-of-image marker
        return None
    decoder = region_decoder()
    stream = decoder.open(data) if decoder is not None else None
    if stream is None or _bomb(stream.size):
        return None
    return decoder, stream


def _bomb(size: tuple[int, int]) -> bool:
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    return limit is not None and size[0] * size[1] > 2 * limit  # Pillow's error threshold


def region_decoder() -> RegionDecoder | None:
    """This thread's region decoder, as $FASTDATA_REGION_DECODER asks (see the module's doc).

    None where none is available (Pillow-SIMD decodes whole images then), or for "pillow".

    Raises:
        DecoderChoiceError: $FASTDATA_REGION_DECODER is not one of auto, libjpeg, pillow.
    """
    choice = os.environ.get(DECODER_ENV, "auto").strip().lower() or "auto"
    decoders = getattr(_local, "decoders", None)
    if decoders is None:
        decoders = _local.decoders = {}
    if choice not in decoders:
        if choice not in _DECODERS:
            raise DecoderChoiceError(
                f"${DECODER_ENV}={choice!r}: expected one of {', '.join(_DECODERS)}"
            )
        decoders[choice] = _start(choice)
    return decoders[choice]


#: $FASTDATA_REGION_DECODER's values -> the decoders tried, in order ("pillow": none).
_DECODERS: dict[str, tuple[type[RegionDecoder], ...]] = {
    "auto": (LibjpegDecoder,),
    "libjpeg": (LibjpegDecoder,),
    "pillow": (),
}


def _start(choice: str) -> RegionDecoder | None:
    for kind in _DECODERS[choice]:
        try:
            return kind()
        except Exception as exc:  # ImportError, or a binary that does not load on this system
            log.debug("JPEG region decoder %s unavailable: %r", kind.__name__, exc)
    if choice not in ("auto", "pillow"):
        log.warning(
            "$%s=%s: that decoder is not available here; Pillow-SIMD decodes whole JPEGs",
            DECODER_ENV,
            choice,
        )
    return None
