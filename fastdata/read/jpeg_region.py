"""JPEG crop-region decoding on the CPU: nvImageCodec's libjpeg-turbo decoder, one per thread.

libjpeg-turbo decodes a region (`jpeg_crop_scanline` / `jpeg_skip_scanlines`): rows below it are
never decoded, and columns outside it skip the IDCT and colour conversion. nvImageCodec's Python
wheels ship that decoder (with no CUDA needed for it); it releases the GIL while it works. Used by
`fastdata.read.decode` for JPEG crops; where nvImageCodec is not installed or cannot start,
`region_decoder()` is None and Pillow-SIMD decodes whole images instead.

Each thread gets its own decoder, created on first use; a forked child (a DataLoader worker)
creates new ones and keeps the inherited ones alive, never destroying them: their destructors
would wait for decoder threads that do not exist in the child.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["JpegStream", "RegionDecoder", "jpeg_stream", "region_decoder"]

log = logging.getLogger("fastdata")

_local = threading.local()
_import_lock = threading.Lock()
_inherited: list[object] = []


def _forget_parent_decoders() -> None:
    global _local, _import_lock
    _inherited.append(_local)
    _local, _import_lock = threading.local(), threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_decoders)


class RegionDecoder:
    """nvImageCodec's CPU decoder (libjpeg-turbo) of a JPEG region; one per thread.

    Fancy chroma upsampling and no EXIF rotation, as libjpeg and Pillow do by default: the
    region's pixels are then those of a full Pillow decode (nvImageCodec's default upsampling is
    the cheaper box filter, which differs by up to ~70 levels at colour edges).

    Attributes:
        name: the library, its version and the backend, for logs and benchmark records.

    Raises:
        ImportError: nvImageCodec is not installed (`region_decoder()` then returns None).
    """

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


@dataclass(frozen=True)
class JpegStream:
    """A parsed JPEG code stream and its (width, height) in stored (not EXIF-rotated) pixels.

    Attributes:
        code: the `nvidia.nvimgcodec.CodeStream`.
        size: (width, height), as Pillow's `Image.size`.
    """

    code: Any
    size: tuple[int, int]


def jpeg_stream(data: memoryview | bytes) -> tuple[RegionDecoder, JpegStream] | None:
    """(this thread's region decoder, the parsed JPEG) when region decoding applies, else None."""
    if bytes(data[:2]) != b"\xff\xd8":  # JPEG's start-of-image marker
        return None
    decoder = region_decoder()
    stream = decoder.open(data) if decoder is not None else None
    return None if stream is None else (decoder, stream)


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
    """This thread's region decoder; None when nvImageCodec is missing or cannot start."""
    decoder = getattr(_local, "decoder", False)
    if decoder is False:
        try:
            decoder = RegionDecoder()
        except Exception as exc:  # ImportError, or a binary that does not load on this system
            log.debug("JPEG region decoding off, Pillow-SIMD decodes whole images: %r", exc)
            decoder = None
        _local.decoder = decoder
    return decoder
