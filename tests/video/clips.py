"""Small videos made here with PyAV, in the codecs and containers users have.

Each frame shows one bright 6-pixel square on a dark background at a known place, so a test can
tell which frame of the video a decoded frame is (`frame_number`): the square's column is
``(2 * i) % (width - 6)`` (moving right), or mirrored (moving left), or the same on rows
(`axis=0`, moving down or up). A few KB each, 16-64 frames, ~32x32.
"""

from __future__ import annotations

import fractions
from dataclasses import dataclass
from pathlib import Path

import numpy as np

av = __import__("pytest").importorskip("av")

SQUARE = 6


@dataclass(frozen=True)
class Clip:
    """How to make one video (see `make_video`)."""

    codec: str = "libx264"  # "libx264" (MP4), "libvpx-vp9" (WebM), "mpeg4"
    frames: int = 24
    width: int = 32
    height: int = 32
    fps: int = 12
    gop: int = 8  # a key frame every `gop` frames
    direction: int = 1  # +1: right (or down), -1: left (or up)
    axis: int = 1  # 1: the square moves along columns, 0: along rows
    offset: int = 0  # where the square starts (frame i is at step i + offset)
    audio: bool = False
    rotation: int | None = None  # a display-matrix rotation tag, degrees counter-clockwise
    vfr: bool = False  # variable frame rate: frame durations alternate 50 ms and 120 ms
    bframes: int = 0  # libx264: B-frames between references (x264's "medium" preset), as cameras


def square_at(clip: Clip, i: int) -> int:
    """The square's first column (axis 1) or row (axis 0) in frame i."""
    span = (clip.width if clip.axis == 1 else clip.height) - SQUARE
    step = (2 * (i + clip.offset)) % span
    return step if clip.direction > 0 else span - step


def frame_pixels(clip: Clip, i: int) -> np.ndarray:
    """Frame i as uint8 (H, W, 3)."""
    image = np.full((clip.height, clip.width, 3), 16, np.uint8)
    at = square_at(clip, i)
    middle = (clip.height if clip.axis == 1 else clip.width) // 2 - SQUARE // 2
    if clip.axis == 1:
        image[middle : middle + SQUARE, at : at + SQUARE] = 235
    else:
        image[at : at + SQUARE, middle : middle + SQUARE] = 235
    return image


def make_video(path: Path, clip: Clip = Clip()) -> Path:
    """Write `clip` to `path` (the container from the suffix: .mp4, .webm, .mkv)."""
    out = av.open(str(path), "w")
    stream = out.add_stream(clip.codec, rate=clip.fps)
    stream.width, stream.height, stream.pix_fmt = clip.width, clip.height, "yuv420p"
    stream.codec_context.gop_size = clip.gop
    if clip.codec == "libx264":
        preset = "medium" if clip.bframes else "ultrafast"
        stream.options = {"preset": preset, "bf": str(clip.bframes), "keyint_min": str(clip.gop)}
    if clip.rotation is not None:
        stream.set_display_rotation(clip.rotation)
    if clip.vfr:
        stream.codec_context.time_base = fractions.Fraction(1, 1000)
    audio = out.add_stream("aac", rate=8000, layout="mono") if clip.audio else None
    ms = 0
    for i in range(clip.frames):
        frame = av.VideoFrame.from_ndarray(frame_pixels(clip, i), format="rgb24")
        if clip.vfr:
            frame.pts, frame.time_base = ms, fractions.Fraction(1, 1000)
            ms += 50 if i % 2 else 120
        out.mux(stream.encode(frame))
    out.mux(stream.encode())
    if audio is not None:
        for k in range(4):
            samples = np.zeros((1, 1024), np.float32)
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 8000, k * 1024
            out.mux(audio.encode(frame))
        out.mux(audio.encode())
    out.close()
    return path


def frame_number(clip: Clip, frame: np.ndarray) -> int:
    """Which frame of `clip` a decoded (C, H, W) or (H, W, C) frame shows (the first i whose
    square sits where this frame's brightest column or row is)."""
    hwc = frame if frame.shape[-1] in (1, 3) else np.moveaxis(frame, 0, -1)
    grey = hwc.astype(np.float32).mean(axis=-1)
    profile = grey.mean(axis=0 if clip.axis == 1 else 1)
    at = int(np.argmax(np.convolve(profile, np.ones(SQUARE), "valid")))
    for i in range(clip.frames):
        if abs(square_at(clip, i) - at) <= 1:
            return i
    raise AssertionError(f"no frame of the clip has its square at {at}")


def make_tree(root: Path, clips: dict[str, list[tuple[str, Clip]]]) -> Path:
    """root/<class>/<name> for each class's (file name, clip)."""
    for label, videos in clips.items():
        (root / label).mkdir(parents=True, exist_ok=True)
        for name, clip in videos:
            make_video(root / label / name, clip)
    return root


def truncate(path: Path, keep: float = 0.5) -> Path:
    """Cut `path` to the first `keep` share of its bytes (a broken download)."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path
