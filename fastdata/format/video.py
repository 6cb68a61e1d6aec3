"""A video sample's clip index: what a reader needs to pick and seek a clip without decoding.

A video sample holds the file as it was (``mp4`` or ``webm`` component, never re-encoded) and
its clip index (``vidx``, JSON), read from the container at shard time by demuxing its packets
(`fastdata.write.video.probe_video`):

| field | meaning |
|-------|---------|
| ``codec`` | the video stream's codec ("h264", "vp9", ...) |
| ``width``, ``height`` | the coded frame size (before rotation) |
| ``rotation`` | degrees counter-clockwise the player turns the frames (0, 90, 180, 270) |
| ``time_base`` | [num, den] of the stream's timestamps |
| ``pts`` | every frame's presentation timestamp, ascending (frame i of the video is ``pts[i]``) |
| ``keys`` | the frame numbers of the key frames, ascending (where a decoder can start) |
| ``fps`` | the stream's average frame rate (frames / s) |

A clip is a list of frame numbers; a reader seeks to the last key frame at or before the first
one (`ClipIndex.key_before`) and decodes forward. The index is untrusted input on read
(`ClipIndex.from_json` checks every field and bounds its size).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CLIP_INDEX_EXT",
    "MAX_INDEX_FRAMES",
    "VIDEO_EXTS",
    "ClipIndex",
    "ClipIndexError",
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
                codec=str(raw["codec"]),
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
