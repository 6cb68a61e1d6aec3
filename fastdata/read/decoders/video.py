"""Where a clip is decoded on the CPU: seek to the key frame before it, decode forward (PyAV).

Only what the clip needs is read and decoded: the container is opened on the sample's bytes in
place (a memory-mapped shard: `_ViewFile` reads through a view, so the pages of the video
outside the clip are never touched), the decoder jumps to the last key frame at or before the
clip's first frame (`ClipIndex.key_before`) and stops after its last frame. A worker's memory
therefore follows the clip, not the video: a 10-minute video costs what a clip of it costs
(benchmarks/bench_video.py measures it).

Each kept frame is scaled by FFmpeg's swscale (area filter) so that it covers ``side x side``
(shown orientation: the container's rotation applied), then centre-cropped: a batch of clips
of any sizes and orientations is one uint8 ``(B, T, 3, side, side)`` tensor. The random crop and
flip run later, on the device, the same for every frame of a clip (`fastdata.augment`).
"""

from __future__ import annotations

import io
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator
from contextlib import closing
from typing import Any

import numpy as np

from fastdata.format.video import (
    CLIP_INDEX_EXT,
    VIDEO_EXTS,
    ClipIndex,
    ClipIndexError,
    probe,
    require_av,
)

__all__ = ["check_video", "decode_clip", "source_window"]

_THREAD = threading.local()  # per thread: its swscale converter (`_reformatter`)
# (shard, key) -> the clip index probed from a video that has none stored (`video_parts`).
_PROBED: OrderedDict[tuple[str, str], ClipIndex] = OrderedDict()
_PROBED_LIMIT = 4096


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (no copy of the bytes)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view.cast("B") if view.format != "B" else view
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        end = min(len(self._view), self._at + len(buffer))
        n = end - self._at
        buffer[:n] = self._view[self._at : end]
        self._at = end
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at


def decode_clip(
    data: bytes | memoryview,
    index: ClipIndex,
    frames: np.ndarray,
    side: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The frames `frames` (frame numbers, any order, repeats allowed) of a video, decoded.

    Args:
        data: the video file's bytes (a view into a shard is read in place).
        index: its clip index.
        frames: the frame numbers to return, in the order wanted.
        side: each frame is scaled to cover ``side x side`` (as shown) and centre-cropped.
        out: where to write the result (uint8 ``(T, 3, side, side)``); None: a new array.

    Returns:
        uint8 ``(T, 3, side, side)``.

    Raises:
        ValueError: the video does not decode, or ends before a wanted frame (the message
            names the frame numbers).
    """
    av = require_av()
    wanted = np.asarray(frames, dtype=np.int64)
    if out is None:
        out = np.empty((len(wanted), 3, side, side), np.uint8)
    first, last = int(wanted.min()), int(wanted.max())
    if first < 0 or last >= index.frames:
        raise ValueError(f"frames {first}..{last} asked of a video of {index.frames} frames")
    slots: dict[int, list[int]] = {}  # pts -> positions in the clip
    for position, frame in enumerate(wanted.tolist()):
        slots.setdefault(int(index.pts[frame]), []).append(position)
    last_pts = int(index.pts[last])
    size = _scaled_size(index, side)
    try:
        with av.open(_ViewFile(memoryview(data)), "r") as container:
            stream = container.streams.video[0]
            stream.codec_context.thread_count = 1  # a worker per core: no threads inside
            key = index.key_before(first)
            if key > 0:
                container.seek(int(index.pts[key]), stream=stream, backward=True)
            _fill(
                container,
                stream,
                slots,
                last_pts,
                lambda f: _shown(f, size, index.rotation, side),
                out,
            )
    except av.FFmpegError as exc:
        raise ValueError(f"video does not decode ({exc})") from exc
    if slots:
        missing = sorted(int(np.searchsorted(index.pts, p)) for p in slots)
        raise ValueError(
            f"video ended before frame(s) {missing[:5]} of its {index.frames} (truncated, or "
            "its clip index does not match it)"
        )
    return out


def _fill(
    container: Any,
    stream: Any,
    slots: dict[int, list[int]],
    last_pts: int,
    shown: Callable[[Any], np.ndarray],
    out: np.ndarray,
) -> None:
    """Decode from where the container stands into `out`: each frame whose pts is in `slots`
    (pts -> positions in the clip, emptied as they are filled) made `shown`, until the slots are
    filled or the frame at `last_pts` is passed."""
    # Closed while the container is open: a generator left at the early break would otherwise
    # be finalized (its demux and decode iterators) after the container is.
    with closing(_decoded(container, stream, slots)) as decoded:
        for frame in decoded:
            if frame.pts is None:
                continue
            if frame.pts in slots:
                pixels = shown(frame)
                for position in slots.pop(frame.pts):
                    out[position] = pixels
            if not slots or frame.pts >= last_pts:
                break


#: FFmpeg decoders that apply ``skip_frame`` to the packet just sent, so it can change packet
#: by packet (checked: wanted frames equal a full decode's on B-frame, open-GOP, VFR and alt-ref
#: streams). libdav1d (AV1) buffers packets and loses wanted frames that way: it never skips.
SKIPPING_DECODERS = frozenset({"h264", "hevc", "mpeg4", "vp9"})


def _decoded(
    container: Any, stream: Any, wanted: dict[int, list[int]]
) -> Generator[Any, None, None]:
    """The stream's frames from where the container stands, decoding only what the wanted ones
    need: with a decoder of `SKIPPING_DECODERS`, a packet whose frame is not wanted (its pts not
    in `wanted`, which `decode_clip` empties as it fills the clip) is decoded with
    ``skip_frame="NONREF"``, so a frame no other frame refers to (most B-frames) is dropped
    undecoded; every reference frame still decodes, so the wanted frames come out exactly as
    from a full decode (5% less time for a clip of an H.264 video with B-frames and a key
    frame a second: `benchmarks/bench_video_decoders.py`, case "h264-bframes" against "pyav
    every frame"; nothing changes for a stream without them). Other decoders decode every packet."""
    context = stream.codec_context
    if context.name not in SKIPPING_DECODERS:
        yield from container.decode(stream)
        return
    for packet in container.demux(stream):
        skip = packet.pts is not None and packet.pts not in wanted
        context.skip_frame = "NONREF" if skip else "DEFAULT"
        yield from context.decode(packet)  # the last, empty packet flushes the decoder


def video_parts(parts: Any, where: tuple[str, str] | None = None) -> tuple[memoryview, ClipIndex]:
    """(the video's bytes, its clip index) of a sample's components.

    A sample of another tool's tar (`fastdata index`) has no ``vidx``: its index is read from the
    video (`fastdata.format.video.probe`, demuxing the whole file) the first time this process
    reads it, then kept (`where`: the sample's (shard, key); at most `_PROBED_LIMIT` indexes).

    Raises:
        ClipIndexError: no video component, or an unusable index or video.
    """
    video = next((parts[e] for e in VIDEO_EXTS if e in parts), None)
    if video is None:
        raise ClipIndexError(f"not a video sample (components {sorted(parts)})")
    if CLIP_INDEX_EXT in parts:
        return video, ClipIndex.from_json(parts[CLIP_INDEX_EXT])
    found = _PROBED.get(where) if where is not None else None
    if found is None:
        found = probe(video)
        if where is not None:
            _PROBED[where] = found
            if len(_PROBED) > _PROBED_LIMIT:
                _PROBED.popitem(last=False)
    else:
        _PROBED.move_to_end(where)
    return video, found


def check_video(parts: Any) -> None:
    """`fastdata verify`'s check of a video sample: its clip index parses and its first and
    last frames decode (ValueError otherwise)."""
    video, index = video_parts(parts)
    decode_clip(video, index, np.array([0, index.frames - 1]), 8)


def source_window(index: ClipIndex, side: int) -> tuple[float, float, float, float]:
    """The part of a coded (unturned) frame that `decode_clip` makes the ``side x side`` square
    of: (top, left, bottom, right) in the coded frame's pixels, sub-pixel.

    `decode_clip` scales the frame to `_scaled_size`, turns it by the index's rotation and
    crops the centre; resizing this window to ``side x side`` and then turning it gives the same
    square, to the resize filter's rounding (the DALI video loader does this on the device).
    """
    width, height = _scaled_size(index, side)
    turns = index.rotation // 90
    shown_h, shown_w = (height, width) if turns % 2 == 0 else (width, height)
    top, left = (shown_h - side) // 2, (shown_w - side) // 2
    # The crop's corner in the scaled frame before `np.rot90(k=turns)` (counter-clockwise).
    y0, x0 = {
        0: (top, left),
        1: (left, width - top - side),
        2: (height - top - side, width - left - side),
        3: (height - left - side, top),
    }[turns]
    sy, sx = height / index.height, width / index.width
    return y0 / sy, x0 / sx, (y0 + side) / sy, (x0 + side) / sx


def _scaled_size(index: ClipIndex, side: int) -> tuple[int, int]:
    """(width, height) to scale the coded frames to, so that the shown frame covers side x side."""
    width, height = index.width, index.height
    scale = side / min(width, height)
    return max(side, round(width * scale)), max(side, round(height * scale))


def _reformatter() -> Any:
    """This thread's swscale converter. Reused: `VideoFrame.reformat` builds a new scaling
    context per call, which cost more than decoding (8 frames of 320x180 to 112 px: 17.4 ms a
    clip with it, 7.7 ms reusing one; the H.264 decoding alone ~7 ms). Made anew in a forked
    process (a worker): it must not use its parent's."""
    found = getattr(_THREAD, "reformatter", None)
    if found is None or found[0] != os.getpid():
        from av.video.reformatter import VideoReformatter

        found = _THREAD.reformatter = (os.getpid(), VideoReformatter())
    return found[1]


def _shown(frame: Any, size: tuple[int, int], rotation: int, side: int) -> np.ndarray:
    """One decoded frame scaled, turned as shown and centre-cropped: uint8 (3, side, side)."""
    # threads=1: one worker per core; swscale's own thread pool (its default) would also leave
    # threads that a forked child of this process waits on for ever.
    rgb = _reformatter().reformat(
        frame, width=size[0], height=size[1], format="rgb24", interpolation="AREA", threads=1
    )
    pixels = rgb.to_ndarray()
    if rotation:
        pixels = np.rot90(pixels, k=rotation // 90)
    h, w = pixels.shape[:2]
    top, left = (h - side) // 2, (w - side) // 2
    return np.moveaxis(pixels[top : top + side, left : left + side], -1, 0)
