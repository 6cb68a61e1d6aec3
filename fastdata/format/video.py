"""A video sample's clip index: what a reader needs to pick and seek a clip without decoding.

A video sample holds the file as it was (``mp4`` or ``webm`` component, never re-encoded) and
its clip index (``vidx``, JSON), read from the container at shard time by demuxing its packets
(`probe`):

| field | meaning |
|-------|---------|
| ``codec`` | the video stream's codec ("h264", "vp9", ...) |
| ``width``, ``height`` | the coded frame size (before rotation) |
| ``rotation`` | degrees counter-clockwise the player turns the frames (0, 90, 180, 270) |
| ``time_base`` | [num, den] of the stream's timestamps |
| ``pts`` | every frame's presentation timestamp, ascending (frame i of the video is ``pts[i]``) |
| ``keys`` | the frame numbers of the key frames, ascending (where a decoder can start) |
| ``fps`` | the stream's average frame rate (frames / s) |

`probe` reads the index from a video's bytes (`fastdata shard video` stores it;
a reader of other tools' tars, which hold no ``vidx``, reads it the same way, once a video).

A clip is a list of frame numbers; a reader seeks to the last key frame at or before the first
one (`ClipIndex.key_before`) and decodes forward. The index is untrusted input on read
(`ClipIndex.from_json` checks every field and bounds its size).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CLIP_INDEX_EXT",
    "MAX_INDEX_FRAMES",
    "VIDEO_EXTS",
    "ClipIndex",
    "ClipIndexError",
    "probe",
    "require_av",
]

#: Video components a reader accepts (the container's usual file extension).
VIDEO_EXTS: tuple[str, ...] = ("mp4", "webm")
#: The clip index component.
CLIP_INDEX_EXT = "vidx"
#: Most frames an index may list: 10 hours at 60 frames/s (~20 MB of JSON). More is refused as
#: a corrupt or hostile index rather than parsed into memory.
MAX_INDEX_FRAMES = 2_160_000
_ROTATIONS = (0, 90, 180, 270)
# Containers whose header states a duration: the index must reach it, within this many
# seconds, or the file is taken for truncated.
_DURATION_SLACK = 0.5


#: FFmpeg decoder names that earlier indexes stored as the codec (the decoder PyAV opened),
#: by the codec they decode.
_DECODER_CODECS = {
    "libdav1d": "av1",
    "libaom-av1": "av1",
    "av1_cuvid": "av1",
    "libvpx": "vp8",
    "libvpx-vp9": "vp9",
    "libopenh264": "h264",
}


def canonical_codec(name: str) -> str:
    """The codec's FFmpeg name ("h264", "hevc", "vp9", "av1", ...) for a codec or decoder name
    (an index written before 2026-12-06 may hold the decoder's, e.g. "libdav1d" for AV1)."""
    return _DECODER_CODECS.get(name, name)


class ClipIndexError(ValueError):
    """A clip index that cannot be used (the caller adds the shard and sample key)."""


@dataclass(frozen=True)
class ClipIndex:
    """The clip index of one video (see the module docstring for each field)."""

    codec: str
    width: int
    height: int
    rotation: int
    time_base: tuple[int, int]
    pts: np.ndarray  # int64 (frames,), ascending
    keys: np.ndarray  # int64 (key frames,), ascending frame numbers
    fps: float

    @property
    def frames(self) -> int:
        """Number of frames."""
        return len(self.pts)

    @property
    def duration(self) -> float:
        """Seconds from the first frame to the end of the last (one frame period after it)."""
        if not self.frames:
            return 0.0
        num, den = self.time_base
        span = float(self.pts[-1] - self.pts[0]) * num / den
        return span + (1.0 / self.fps if self.fps > 0 else 0.0)

    @property
    def display_hw(self) -> tuple[int, int]:
        """(height, width) of the frames as shown (after the rotation)."""
        if self.rotation in (90, 270):
            return self.width, self.height
        return self.height, self.width

    def seconds(self) -> np.ndarray:
        """Each frame's time in seconds from the first frame (float64)."""
        num, den = self.time_base
        return (self.pts - self.pts[0]).astype(np.float64) * num / den

    def key_before(self, frame: int) -> int:
        """The frame number of the last key frame at or before `frame` (0 if none)."""
        at = int(np.searchsorted(self.keys, frame, side="right")) - 1
        return int(self.keys[at]) if at >= 0 else 0

    def to_json(self) -> bytes:
        """The ``vidx`` component's bytes."""
        return json.dumps(
            {
                "codec": self.codec,
                "width": self.width,
                "height": self.height,
                "rotation": self.rotation,
                "time_base": list(self.time_base),
                "fps": self.fps,
                "pts": self.pts.tolist(),
                "keys": self.keys.tolist(),
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | memoryview) -> ClipIndex:
        """Parse and check a ``vidx`` component.

        Raises:
            ClipIndexError: not JSON, a field missing or of the wrong type, timestamps not
                ascending, key frames outside the video, or more than `MAX_INDEX_FRAMES`.
        """
        if len(data) > 16 * MAX_INDEX_FRAMES:
            raise ClipIndexError(f"clip index is {len(data):,} bytes: too large to be one")
        try:
            raw = json.loads(bytes(data))
            index = cls(
                codec=canonical_codec(str(raw["codec"])),
                width=_int(raw["width"], 1),
                height=_int(raw["height"], 1),
                rotation=_int(raw["rotation"], 0),
                time_base=(_int(raw["time_base"][0], 1), _int(raw["time_base"][1], 1)),
                pts=_ints(raw["pts"]),
                keys=_ints(raw["keys"]),
                fps=float(raw["fps"]),
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ClipIndexError(f"unreadable clip index ({exc})") from exc
        index.check()
        return index

    def check(self) -> None:
        """Raise `ClipIndexError` unless the fields agree (see `from_json`)."""
        if self.rotation not in _ROTATIONS:
            raise ClipIndexError(f"rotation {self.rotation} is not one of {_ROTATIONS}")
        if not 0 < self.frames <= MAX_INDEX_FRAMES:
            raise ClipIndexError(f"{self.frames} frames: need 1 to {MAX_INDEX_FRAMES:,}")
        if np.any(np.diff(self.pts) <= 0):
            raise ClipIndexError("frame timestamps are not strictly ascending")
        keys = self.keys
        if len(keys) == 0 or keys[0] != 0 or np.any(np.diff(keys) <= 0) or keys[-1] >= self.frames:
            raise ClipIndexError(
                "key frames must be ascending frame numbers of the video, starting with frame 0"
            )
        if not np.isfinite(self.fps) or self.fps <= 0:
            raise ClipIndexError(f"frame rate {self.fps} is not a positive number")


def _int(value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"expected an integer >= {least}, got {value!r:.40}")
    return value


def _ints(values: object) -> np.ndarray:
    if not isinstance(values, list) or len(values) > MAX_INDEX_FRAMES:
        raise ValueError("expected a list of at most MAX_INDEX_FRAMES integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError("expected a list of integers")
    return np.asarray(values, dtype=np.int64)


def require_av() -> object:
    """The `av` module (PyAV), imported on first use: `import fastdata` works without it.

    Raises:
        ImportError: PyAV is not installed; the message names the extra that installs it.
    """
    try:
        import av
    except ImportError as exc:
        raise ImportError(
            "video samples need PyAV: pip install 'fastdata[video]' (or pip install av)"
        ) from exc
    return av


def probe(data: bytes | memoryview, max_pixels: int | None = None) -> ClipIndex:
    """The clip index of a video file's bytes, read by demuxing its packets (no frame decoded
    for it), then decoding the first frame only: the stream must decode, and FFmpeg applies the
    container's display matrix to decoded frames, which gives the rotation.

    Args:
        data: the whole file.
        max_pixels: most width x height of a frame (None: no bound).

    Raises:
        ClipIndexError: not a readable video, no video stream, frames too large, too many
            frames, a truncated file (a packet past the end, or frames that end before the
            duration its header states), or a first frame that does not decode.
    """
    av = require_av()
    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.video:
                raise ClipIndexError("no video stream (not a video, or truncated)")
            stream = container.streams.video[0]
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            if width < 1 or height < 1:
                raise ClipIndexError(f"video stream has no frame size ({width}x{height})")
            if max_pixels is not None and width * height > max_pixels:
                raise ClipIndexError(
                    f"frames are {width} x {height}, more than max_pixels={max_pixels:,} "
                    "(raise --max-pixels if the file is trusted)",
                )
            pts, key = _packets(container, stream, len(data))
            rotation = _first_frame_rotation(container, stream)
            order = np.argsort(pts, kind="stable")
            pts, key = pts[order], key[order]
            keys = np.flatnonzero(key)
            if len(keys) == 0 or keys[0] != 0:
                keys = np.concatenate([[0], keys[keys > 0]])  # decoding starts at the start
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            index = ClipIndex(
                codec=canonical_codec(stream.codec_context.codec.canonical_name),
                width=width,
                height=height,
                rotation=rotation,
                time_base=(stream.time_base.numerator, stream.time_base.denominator),
                pts=pts,
                keys=keys.astype(np.int64),
                fps=float(rate) if rate else _measured_rate(pts, stream.time_base),
            )
            _check_duration(container, index)
            index.check()
            return index
    except ClipIndexError:
        raise
    except (av.FFmpegError, ValueError, OSError, ZeroDivisionError) as exc:
        raise ClipIndexError(f"not a readable video ({exc})") from exc


def _packets(container: Any, stream: Any, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(pts, key flag) of every video packet, in decode order, demuxed without decoding."""
    pts: list[int] = []
    key: list[bool] = []
    for packet in container.demux(stream):
        if packet.size == 0 or packet.pts is None:
            continue  # the demuxer's final empty packet
        if packet.pos is not None and packet.pos >= 0 and packet.pos + packet.size > size:
            raise ClipIndexError("truncated: a frame lies past the end of the file")
        pts.append(int(packet.pts))
        key.append(bool(packet.is_keyframe))
        if len(pts) > MAX_INDEX_FRAMES:
            raise ClipIndexError(f"more than {MAX_INDEX_FRAMES:,} frames")
    if not pts:
        raise ClipIndexError("the video stream has no frames")
    if len(set(pts)) != len(pts):
        raise ClipIndexError("two frames share a timestamp; remux the file (ffmpeg -c copy)")
    return np.asarray(pts, dtype=np.int64), np.asarray(key, dtype=bool)


def _first_frame_rotation(container: Any, stream: Any) -> int:
    """Decode the first frame (the stream must decode) and return its rotation in degrees."""
    container.seek(0, stream=stream)
    for frame in container.decode(stream):
        return int(round(getattr(frame, "rotation", 0) or 0)) % 360
    raise ClipIndexError("no frame of the video stream decodes")


def _measured_rate(pts: np.ndarray, time_base: Any) -> float:
    if len(pts) < 2:
        return 1.0
    span = float(pts.max() - pts.min()) * float(time_base)
    return (len(pts) - 1) / span if span > 0 else 1.0


def _check_duration(container: Any, index: ClipIndex) -> None:
    """A container whose header states a duration must hold frames up to it (else truncated)."""
    if container.duration is None or container.duration <= 0:
        return
    stated = container.duration / 1_000_000  # AV_TIME_BASE
    if index.duration + max(_DURATION_SLACK, 0.1 * stated) < stated:
        raise ClipIndexError(
            f"truncated: the header states {stated:.2f} s but the frames end at "
            f"{index.duration:.2f} s; download or copy the file again",
        )
