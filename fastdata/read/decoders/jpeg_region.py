"""JPEG crop-region decoding on the CPU: libjpeg-turbo, through fastdata's own small extension
(`fastdata.read._jpeg`, built from `_jpeg.c` at install) or nvImageCodec's CPU decoder.

libjpeg-turbo decodes a region (`jpeg_crop_scanline` / `jpeg_skip_scanlines`): columns outside it
skip the IDCT and colour conversion, rows above it skip the IDCT. Both decoders give the pixels of a
full Pillow decode (fancy chroma upsampling, islow IDCT, no EXIF rotation). They differ in the rows
below the box: fastdata's extension stops at the box's last row, nvImageCodec entropy-decodes the
rest of the image; and in how they are called: the extension decodes one image in the thread that
then resizes it (the region is still in the cache), nvImageCodec a batch's regions in one call.

`region_decoder()` gives this thread's decoder: $FASTDATA_REGION_DECODER picks one ("libjpeg",
"nvimgcodec", or "pillow" for none); by default ("auto") the extension where it was built (a C
compiler and the libjpeg headers at install time), else nvImageCodec where its wheel is installed,
else None: Pillow-SIMD then decodes whole images (`fastdata.read.decoders.image`).

nvImageCodec's decoders are per thread, created on first use; a forked child (a DataLoader worker)
creates new ones and keeps the inherited ones alive, never destroying them: their destructors would
wait for decoder threads that do not exist in the child.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DECODER_ENV",
    "DecoderChoiceError",
    "JpegStream",
    "LibjpegDecoder",
    "NvImageCodecDecoder",
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
_import_lock = threading.Lock()
_inherited: list[object] = []


def _forget_parent_decoders() -> None:
    global _local, _import_lock
    _inherited.append(_local)
    _local, _import_lock = threading.local(), threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_decoders)


@dataclass(frozen=True)
class JpegStream:
    """A parsed JPEG and its (width, height) in stored (not EXIF-rotated) pixels.

    Attributes:
        code: what the decoder decodes (the bytes for `LibjpegDecoder`, an nvImageCodec
            `CodeStream` for `NvImageCodecDecoder`).
        size: (width, height), as Pillow's `Image.size`.
    """

    code: Any
    size: tuple[int, int]


class RegionDecoder:
    """Decodes JPEG crop regions to RGB; one per thread (`region_decoder()`).

    Attributes:
        name: the library, its version and the backend, for logs and benchmark records.
        batched: decode a batch's regions in one `regions` call before resizing them (True), or
            each image's region in the thread that resizes it (False).
    """

    name: str = ""
    batched: bool = False

    def open(self, data: memoryview | bytes) -> JpegStream | None:
        """The JPEG's parsed header, None unless it is an 8-bit grey, YCbCr (or, for
        `LibjpegDecoder`, RGB) JPEG."""
        raise NotImplementedError

    def region(self, stream: JpegStream, box: tuple[int, int, int, int]) -> np.ndarray | None:
        """RGB (H, W, 3) pixels of ``box = (left, top, right, bottom)``, None when it fails."""
        raise NotImplementedError

    def regions(
        self, items: list[tuple[JpegStream, tuple[int, int, int, int]]], threads: int = 1
    ) -> list[np.ndarray | None]:
        """`region` of each (stream, box)."""
        return [self.region(stream, box) for stream, box in items]


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

    batched = False

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


class NvImageCodecDecoder(RegionDecoder):
    """nvImageCodec's CPU decoder (libjpeg-turbo); a batch's regions in one call.

    Fancy chroma upsampling and no EXIF rotation, as libjpeg and Pillow do by default: the
    region's pixels are then those of a full Pillow decode (nvImageCodec's default upsampling is
    the cheaper box filter, which differs by up to ~70 levels at colour edges).

    Attributes:
        name: the library, its version and the backend, for logs and benchmark records.

    Raises:
        ImportError: nvImageCodec is not installed (`region_decoder()` then returns None).
    """

    batched = True

    def __init__(self) -> None:
        nvimgcodec = _import_nvimgcodec()
        self._nv = nvimgcodec
        self._decoders: dict[int, Any] = {}  # threads -> nvimgcodec.Decoder
        self._params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB
        )
        self.name = f"nvimgcodec {nvimgcodec.__version__} (libjpeg-turbo, CPU)"
        self._decoder(1)  # fail here, not at the first decode, where nvImageCodec cannot start

    def open(self, data: memoryview | bytes) -> JpegStream | None:
        """The JPEG's parsed header, None unless it is an 8-bit grey or YCbCr JPEG."""
        try:
            stream = self._nv.CodeStream(bytes(data))
            kind = (stream.codec_name, stream.num_channels, stream.precision)
            size = (stream.width, stream.height)
        except RuntimeError:  # not parseable: Pillow says why
            return None
        # CMYK / YCCK (4 channels) and 12-bit JPEGs: Pillow converts them, as before.
        return JpegStream(stream, size) if kind in (("jpeg", 1, 8), ("jpeg", 3, 8)) else None

    def region(self, stream: JpegStream, box: tuple[int, int, int, int]) -> np.ndarray | None:
        """RGB pixels of ``box = (left, top, right, bottom)``, None when the decode fails."""
        return self.regions([(stream, box)])[0]

    def regions(
        self, items: list[tuple[JpegStream, tuple[int, int, int, int]]], threads: int = 1
    ) -> list[np.ndarray | None]:
        """`region` of each (stream, box), in one call on `threads` libjpeg-turbo threads.

        One call per batch instead of per image: the decoder hands the work to its threads and
        waits once (measured ~60 us an image less CPU than one call each, single-threaded).
        """
        nv = self._nv
        try:
            subs = [
                stream.code.get_sub_code_stream(region=nv.Region(top, left, bottom, right))
                for stream, (left, top, right, bottom) in items
            ]
            images = self._decoder(threads).decode(subs, params=self._params)
        except RuntimeError:
            images = []
        if len(images) != len(items):  # a failure left no placeholder: decode one by one
            if len(items) == 1:
                return [None]
            return [self.regions([item])[0] for item in items]
        return [None if image is None else np.asarray(image.cpu()) for image in images]

    def _decoder(self, threads: int) -> Any:
        decoder = self._decoders.get(threads)
        if decoder is None:
            nv = self._nv
            decoder = self._decoders[threads] = nv.Decoder(
                device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
                max_num_cpu_threads=threads,
                backends=[nv.Backend(nv.CPU_ONLY)],
                options=":fancy_upsampling=1",
            )
        return decoder


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


def _import_nvimgcodec() -> Any:
    """Import nvImageCodec without the notes it prints where its GPU libraries are missing."""
    with _import_lock:
        if "nvidia.nvimgcodec" in sys.modules:
            return sys.modules["nvidia.nvimgcodec"]
        # Failed decodes are re-done by Pillow, which raises with the reason; nvImageCodec would
        # also log each failure (read at import; a user's own setting is kept).
        os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
        # At import, its GPU extensions print "Failed to load nvjpeg library! Please install CUDA
        # toolkit..." (and nvJPEG2000, nvTIFF) from C++ when those wheels are absent, as in a
        # CPU-only install; its CPU decoder needs none of them. An import error still raises.
        sys.stderr.flush()
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
            from nvidia import nvimgcodec
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)
        return nvimgcodec


def region_decoder() -> RegionDecoder | None:
    """This thread's region decoder, as $FASTDATA_REGION_DECODER asks (see the module's doc).

    None where none is available (Pillow-SIMD decodes whole images then), or for "pillow".

    Raises:
        DecoderChoiceError: $FASTDATA_REGION_DECODER is not one of auto, libjpeg, nvimgcodec,
            pillow.
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
    "auto": (LibjpegDecoder, NvImageCodecDecoder),
    "libjpeg": (LibjpegDecoder,),
    "nvimgcodec": (NvImageCodecDecoder,),
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
