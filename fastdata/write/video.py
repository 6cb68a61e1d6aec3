"""A video file -> its shard components: the file as it is, and its clip index.

`probe_video` reads the index from the container by demuxing its packets (timestamps, key
flags, sizes: no frame is decoded for it), then decodes the first frame only, to check that the
stream decodes and to read its rotation (FFmpeg applies the container's display matrix to
decoded frames). A video file is untrusted input: its byte size and frame size are bounded
before anything is decoded, and a file that cannot be opened, has no video stream, or ends
before the duration its header states (a truncated download) is a bad sample, skipped and
listed like a bad image (or fatal under ``--strict``).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from fastdata.format.video import (
    CLIP_INDEX_EXT,
    MAX_INDEX_FRAMES,
    VIDEO_EXTS,
    ClipIndex,
    ClipIndexError,
    require_av,
)
from fastdata.write.encode import BadSampleError, EncodedSample, read_source_file
from fastdata.write.sources.base import SourceItem

__all__ = ["encode_video", "probe_video"]
# Containers whose header states a duration: the index must reach it, within this many
# seconds, or the file is taken for truncated.
_DURATION_SLACK = 0.5


def probe_video(data: bytes | memoryview, origin: str, max_pixels: int | None) -> ClipIndex:
    """The clip index of a video file's bytes (see the module docstring).

    Args:
        data: the whole file.
        origin: the file, for messages.
        max_pixels: most width x height of a frame (None: no bound).

    Raises:
        BadSampleError: not a readable video, no video stream, frames too large, too many
            frames, a truncated file, or a first frame that does not decode.
    """
    av = require_av()
    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.video:
                raise BadSampleError(origin, "no video stream (not a video, or truncated)")
            stream = container.streams.video[0]
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            if width < 1 or height < 1:
                raise BadSampleError(origin, f"video stream has no frame size ({width}x{height})")
            if max_pixels is not None and width * height > max_pixels:
                raise BadSampleError(
                    origin,
                    f"frames are {width} x {height}, more than max_pixels={max_pixels:,} "
                    "(raise --max-pixels if the file is trusted)",
                )
            pts, key = _packets(container, stream, len(data), origin)
            rotation = _first_frame_rotation(container, stream, origin)
            order = np.argsort(pts, kind="stable")
            pts, key = pts[order], key[order]
            keys = np.flatnonzero(key)
            if len(keys) == 0 or keys[0] != 0:
                keys = np.concatenate([[0], keys[keys > 0]])  # decoding starts at the start
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            index = ClipIndex(
                codec=str(stream.codec_context.name),
                width=width,
                height=height,
                rotation=rotation,
                time_base=(stream.time_base.numerator, stream.time_base.denominator),
                pts=pts,
                keys=keys.astype(np.int64),
                fps=float(rate) if rate else _measured_rate(pts, stream.time_base),
            )
            _check_duration(container, index, origin)
            index.check()
            return index
    except BadSampleError:
        raise
    except ClipIndexError as exc:
        raise BadSampleError(origin, f"unusable video index: {exc}") from exc
    except (av.FFmpegError, ValueError, OSError, ZeroDivisionError) as exc:
        raise BadSampleError(origin, f"not a readable video ({exc})") from exc


def _packets(container: Any, stream: Any, size: int, origin: str) -> tuple[np.ndarray, np.ndarray]:
    """(pts, key flag) of every video packet, in decode order, demuxed without decoding."""
    pts: list[int] = []
    key: list[bool] = []
    for packet in container.demux(stream):
        if packet.size == 0 or packet.pts is None:
            continue  # the demuxer's final empty packet
        if packet.pos is not None and packet.pos >= 0 and packet.pos + packet.size > size:
            raise BadSampleError(origin, "truncated: a frame lies past the end of the file")
        pts.append(int(packet.pts))
        key.append(bool(packet.is_keyframe))
        if len(pts) > MAX_INDEX_FRAMES:
            raise BadSampleError(origin, f"more than {MAX_INDEX_FRAMES:,} frames")
    if not pts:
        raise BadSampleError(origin, "the video stream has no frames")
    if len(set(pts)) != len(pts):
        raise BadSampleError(
            origin, "two frames share a timestamp; remux the file (ffmpeg -c copy)"
        )
    return np.asarray(pts, dtype=np.int64), np.asarray(key, dtype=bool)


def _first_frame_rotation(container: Any, stream: Any, origin: str) -> int:
    """Decode the first frame (the stream must decode) and return its rotation in degrees."""
    container.seek(0, stream=stream)
    for frame in container.decode(stream):
        return int(round(getattr(frame, "rotation", 0) or 0)) % 360
    raise BadSampleError(origin, "no frame of the video stream decodes")


def _measured_rate(pts: np.ndarray, time_base: Any) -> float:
    if len(pts) < 2:
        return 1.0
    span = float(pts.max() - pts.min()) * float(time_base)
    return (len(pts) - 1) / span if span > 0 else 1.0


def _check_duration(container: Any, index: ClipIndex, origin: str) -> None:
    """A container whose header states a duration must hold frames up to it (else truncated)."""
    if container.duration is None or container.duration <= 0:
        return
    stated = container.duration / 1_000_000  # AV_TIME_BASE
    if index.duration + max(_DURATION_SLACK, 0.1 * stated) < stated:
        raise BadSampleError(
            origin,
            f"truncated: the header states {stated:.2f} s but the frames end at "
            f"{index.duration:.2f} s; download or copy the file again",
        )


def encode_video(
    item: SourceItem, max_bytes: int | None, max_pixels: int | None
) -> tuple[EncodedSample, dict[str, bytes]]:
    """A video item's stored component (its file, as it is) and its clip index component.

    Returns:
        (the video component as an `EncodedSample`: ext "mp4" or "webm", the file's bytes, the
        displayed height and width; {"vidx": the clip index's JSON}).

    Raises:
        BadSampleError: see `probe_video`; also a file over `max_bytes`, or in a container that
            is not MP4/MOV or WebM/Matroska.
    """
    if item.data is not None:
        data = item.data
    elif item.path is not None:
        data = read_source_file(item, max_bytes, f"over max_video_bytes={max_bytes:,}")
    else:
        raise BadSampleError(item.origin, "the source gives no video here (no bytes or file)")
    if max_bytes is not None and len(data) > max_bytes:
        raise BadSampleError(item.origin, f"video is {len(data):,} bytes, over {max_bytes:,}")
    ext = _container_ext(data, item.origin)
    index = probe_video(data, item.origin, max_pixels)
    height, width = index.display_hw
    return EncodedSample(ext, data, height, width), {CLIP_INDEX_EXT: index.to_json()}


def _container_ext(data: bytes, origin: str) -> str:
    """ "mp4" (ISO base media: MP4, MOV, M4V) or "webm" (EBML: WebM, Matroska) from the magic."""
    if data[4:8] == b"ftyp" or data[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return VIDEO_EXTS[0]
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return VIDEO_EXTS[1]
    raise BadSampleError(
        origin, "not an MP4/MOV or WebM/Matroska file (other containers: remux with ffmpeg -c copy)"
    )
