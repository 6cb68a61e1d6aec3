"""CPU decoding of one sample to uint8 HWC pixels: where a sample is decoded.

Raw samples (`rgb`) are a reshape. Encoded images (`jpg`, `png`) are decoded with Pillow-SIMD and
given their decode-time geometry here, because it is cheaper to shrink while decoding than after:

- "rrc" (training, photo preset): the random-resized-crop box is drawn first from the image's
  size (read from the header), then the JPEG is decoded the cheaper of two ways: only the box's
  region, at full resolution, by libjpeg-turbo (`fastdata.read.decoders.jpeg_region`: fastdata's own
  extension; columns outside the box skip IDCT and colour
  conversion, rows above it the IDCT, rows below it are not decoded), resized by torch's uint8
  antialiased bilinear kernel; or, when the
  box is so large that a DCT scale of 1/2, 1/4 or 1/8 still covers the output size, the whole
  image at that scale through Pillow-SIMD's draft mode and a boxed bilinear `resize`. Whichever
  has fewer pixels to produce wins. The region path gives the pixels of a full decode then
  torchvision's `resized_crop` (Pillow's ``crop(box).resize(...)``; tests/read/decoders/test_decode.py).
- "center" (evaluation): resize the shorter side to `size * 256 / 224` and take the centre
  `size` x `size` crop, through the same two paths.
- "cover": resize so the image just covers `hw` and take the centre `hw` window (the stored size
  of photos when no crop is fused: `stored_hw`, with room around `image_size` only when the
  preset's ops crop on the device; the memory backend's store uses it too).
- "none": decode at the stored size (every image of the split must then share one size).

PNG, WebP, CMYK JPEGs, JPEGs that do not end in an EOI marker (for fastdata's extension), and
every JPEG where no region decoder is available, take the Pillow-SIMD path
(`fastdata.read.decoders.pillow_path`). A preset's decode-time flip (`Geometry.flip_p`,
"photo") is a PIL transpose after the resize. Pad-crops, other flips and normalization happen
later, batched on the device (fastdata.augment).

`decode_batch` decodes a batch in a persistent per-process thread pool (both decoders release the
GIL while they work); every image draws from its own generator, so the pixels do not depend on
the number of threads.
"""

from __future__ import annotations

import concurrent.futures
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from fastdata._util.threads import process_pool
from fastdata.read.decoders import pillow_path
from fastdata.read.decoders.geometry import EVAL_RESIZE_RATIO, Geometry, draw_crop, stored_hw
from fastdata.read.decoders.jpeg_region import (
    JpegStream,
    RegionDecoder,
    jpeg_stream,
    region_decoder,
)
from fastdata.read.decoders.resize import cover, resize_aa

__all__ = [
    "EVAL_RESIZE_RATIO",
    "Geometry",
    "decode_batch",
    "decode_image",
    "decode_raw",
    "draw_crop",
    "jpeg_region_decoder",
    "stored_hw",
]


def decode_raw(data: memoryview | bytes, shape: tuple[int, int, int]) -> np.ndarray:
    """Raw HWC uint8 pixels (a view when possible). ValueError when the size does not match."""
    expected = shape[0] * shape[1] * shape[2]
    if len(data) != expected:
        raise ValueError(f"raw sample has {len(data)} bytes, expected {expected} for shape {shape}")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def decode_image(
    data: memoryview | bytes, geometry: Geometry, rng: np.random.Generator, roi: bool = True
) -> np.ndarray:
    """Decode JPEG/PNG bytes to uint8 HWC RGB with the decode-time `geometry`.

    Args:
        data: the encoded image.
        geometry: the decode-time geometry.
        rng: the image's generator (crop box first, then the flip).
        roi: decode only a JPEG's crop region when that is cheaper (False: always Pillow-SIMD,
            for comparison; the pixels are the same).

    Raises:
        ValueError: the bytes are not a readable image (the caller adds the shard and key).
    """
    try:
        job = _region_job(data, geometry, rng) if roi else None
        if job is None:
            return _decode_pillow(data, geometry, rng)
        pixels = _region_pixels(job) if job.region else None
        return _finish(job, pixels, data, geometry.size)
    except Exception as exc:
        raise pillow_path.readable(exc, data) from exc


def decode_batch(
    payloads: Sequence[memoryview | bytes],
    geometry: Geometry,
    rngs: Sequence[np.random.Generator],
    threads: int = 1,
    roi: bool = True,
    out: np.ndarray | None = None,
) -> list[np.ndarray | ValueError]:
    """Decode a batch of encoded images: entry i is image i's HWC uint8 pixels, or its error.

    Each image draws its random geometry from its own generator `rngs[i]`, so the result does not
    depend on the order in which images are decoded (nor on `threads`). Every image's JPEG region
    is decoded (fastdata's extension), resized and flipped, or the image decoded whole by
    Pillow-SIMD, by the calling thread and ``threads - 1`` threads of this process's decode pool (created on first
    use, and anew in a forked child). The pool's threads have finished when it returns, even on
    an error: `out` may be shared memory that the caller hands on.

    Args:
        payloads: encoded image bytes.
        geometry: the decode-time geometry of every image.
        rngs: one generator per image.
        threads: decode threads.
        roi: see `decode_image`.
        out: an (N, 3, H, W) uint8 array, (H, W) = `geometry.out_hw`, to decode into: image i's
            pixels are written to ``out[i]`` (a region is resized straight into it) and entry i
            is the HWC view ``out[i].transpose(1, 2, 0)``; ``out[i]`` of a failed image is left
            as it was. The caller's batch then needs no copy of each image.

    Raises:
        ValueError: mismatched arguments (one generator per image, threads >= 1, `out`'s shape).
    """
    _check_batch(len(payloads), geometry, len(rngs), threads, out)
    n = len(payloads)
    jobs = [_region_job(payloads[i], geometry, rngs[i]) if roi else None for i in range(n)]

    def one(i: int) -> np.ndarray | ValueError:
        slot = None if out is None else out[i]
        job = jobs[i]
        try:
            if job is None:  # no draws made for it yet
                return _place(decode_image(payloads[i], geometry, rngs[i], roi=False), slot)
            try:
                # The region is decoded just before it is resized (while it is in the cache).
                pixels = _region_pixels(job) if job.region else None
                return _finish(job, pixels, payloads[i], geometry.size, slot)
            except Exception as exc:
                raise pillow_path.readable(exc, payloads[i]) from exc
        except ValueError as exc:
            return exc

    return _on_threads(one, n, threads)


def _check_batch(
    n: int, geometry: Geometry, generators: int, threads: int, out: np.ndarray | None
) -> None:
    """`decode_batch`'s argument checks (ValueError naming the mismatch)."""
    if n != generators:
        raise ValueError(f"need one generator per image, got {n} and {generators}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if out is not None and (out.shape != (n, 3, *geometry.out_hw) or out.dtype != np.uint8):
        raise ValueError(
            f"out must be a uint8 array of shape {(n, 3, *geometry.out_hw)} for {n} images of "
            f"geometry {geometry.kind!r}, got {out.dtype} {out.shape}"
        )


def _on_threads(
    one: Callable[[int], np.ndarray | ValueError], n: int, threads: int
) -> list[np.ndarray | ValueError]:
    """``[one(i) for i in range(n)]`` on the calling thread and ``threads - 1`` pool threads.

    Every pool thread has finished when it returns, even on an error (`one` may write into
    memory the caller hands on).
    """
    k = min(threads, n)
    if k <= 1:
        return [one(i) for i in range(n)]
    # Strided chunks (i, i + k, ...) balance the work; the calling thread does chunk 0.
    pool = process_pool(k - 1)
    futures = [pool.submit(lambda j=j: [one(i) for i in range(j, n, k)]) for j in range(1, k)]
    results: list[np.ndarray | ValueError] = [None] * n  # type: ignore[list-item]
    try:
        results[0::k] = [one(i) for i in range(0, n, k)]
    finally:  # no thread left writing `out` after an unexpected error here
        concurrent.futures.wait(futures)
    for j, future in enumerate(futures, start=1):
        results[j::k] = future.result()
    return results


def jpeg_region_decoder() -> str | None:
    """Name and version of the JPEG region decoder this process uses, None when unavailable."""
    decoder = region_decoder()
    return None if decoder is None else decoder.name


@dataclass(frozen=True)
class _Job:
    """A JPEG's planned crop: the box and flip drawn for it, and which path decodes it."""

    decoder: RegionDecoder
    stream: JpegStream
    box: tuple[int, int, int, int]  # (left, top, right, bottom), full-resolution pixels
    flip: bool
    region: bool  # decode the box's region; False: Pillow's DCT-scaled path


def _region_pixels(job: _Job) -> np.ndarray | None:
    """The RGB pixels of the job's box (None where the decode failed), by this thread's decoder.

    Every region decode goes through here (tests replace it to check which path ran).
    """
    return job.decoder.region(job.stream, job.box)


def _region_job(
    data: memoryview | bytes, geometry: Geometry, rng: np.random.Generator
) -> _Job | None:
    """Draw the box and flip of a JPEG the region decoder takes; None (no draws) otherwise.

    The JPEG is sized from its code stream (~3 us; Pillow's header parser, in Python, ~200 us).
    """
    if geometry.kind not in ("rrc", "center"):
        return None
    found = jpeg_stream(data)
    if found is None:
        return None
    decoder, stream = found
    box, flip = draw_crop(stream.size, geometry, rng)
    return _Job(decoder, stream, box, flip, _region_is_cheaper(stream.size, box, geometry.size))


def _region_is_cheaper(size: tuple[int, int], box: tuple[int, int, int, int], out: int) -> bool:
    """Whether decoding `box`'s region has fewer pixels to produce than a DCT-scaled whole decode."""
    width, height = size
    left, top, right, bottom = box
    dct = 2 ** min(3, int(math.log2(max(1.0, min(right - left, bottom - top) / out))))
    return (right - left) * (bottom - top) * dct * dct <= width * height


def _place(pixels: np.ndarray, slot: np.ndarray | None) -> np.ndarray:
    """`pixels` (HWC), or copied into `slot` (CHW) and returned as its HWC view."""
    if slot is None:
        return pixels
    if pixels.shape != (slot.shape[1], slot.shape[2], slot.shape[0]):
        raise ValueError(f"decoded to {pixels.shape}, expected HWC {slot.shape[1:]} x 3")
    slot[...] = pixels.transpose(2, 0, 1)
    return slot.transpose(1, 2, 0)


def _finish(
    job: _Job,
    pixels: np.ndarray | None,
    data: memoryview | bytes,
    size: int,
    slot: np.ndarray | None = None,
) -> np.ndarray:
    """Resize the decoded region to size x size and flip; Pillow's path when `pixels` is None.

    With `slot` (a contiguous CHW array), the pixels are written there; its HWC view is returned.

    None: the DCT-scaled path was chosen, or the region decode failed (Pillow names the reason).
    The region is resized by torch's uint8 antialiased bilinear kernel, which gives the pixels of
    Pillow's ``crop(box).resize(size, BILINEAR)`` (torchvision's `resized_crop` on a PIL image)
    without Pillow's RGB -> RGBX -> RGB conversions: ~0.1 ms an image less at 224 px.
    """
    if pixels is None:
        image = Image.open(io.BytesIO(data))
        return _place(pillow_path.crop_resize_flip(image, job.box, size, job.flip), slot)
    # (1, C, H, W) in the channels-last layout, the kernel's vectorized uint8 path.
    region = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)[None]
    target = None if slot is None else torch.from_numpy(slot)
    resized = resize_aa(region, size, job.flip, target)
    return resized.permute(1, 2, 0).numpy()  # HWC view of planar pixels: the batch's layout


def _decode_pillow(
    data: memoryview | bytes, geometry: Geometry, rng: np.random.Generator
) -> np.ndarray:
    """Pillow-SIMD decode with the geometry (draft mode for JPEG crops)."""
    image = Image.open(io.BytesIO(data))  # reads the header only
    if geometry.kind == "none":
        return pillow_path.to_array(pillow_path.maybe_flip(image, geometry.flip_p, rng))
    if geometry.kind == "cover":
        covered = cover(image, geometry.hw)
        return pillow_path.to_array(pillow_path.maybe_flip(covered, geometry.flip_p, rng))
    box, flip = draw_crop(image.size, geometry, rng)
    return pillow_path.crop_resize_flip(image, box, geometry.size, flip)
