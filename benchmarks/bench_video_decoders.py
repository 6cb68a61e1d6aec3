"""Per-clip CPU decode time: fastdata's `decode_clip` (PyAV) against torchcodec's `VideoDecoder`.

    python benchmarks/bench_video_decoders.py [--rounds 5] [--clips 12] [--quick] [--out DIR]

Which CPU decoder should the cpu backend's workers run (issue 37)? Videos are made here (a
scrolling noise texture, 30 fps, a key frame a second): H.264 MP4 and VP9 WebM, 64x64 to
320x240, 2 to 60 s (`CASES`; `--quick`: two 2 s videos, for a smoke test). Each clip is T=8
frames at stride 2 from a random start (the same clips for every decoder), from the video's
bytes in memory, to uint8 ``(8, 3, 112, 112)`` (scaled to cover 112 x 112, centre-cropped), one
thread each (a worker per core):

- "pyav": `fastdata.read.decoders.video.decode_clip` (the clip index tells the key frame
  before the clip: one seek, decode forward, frames no other refers to and the clip does not
  keep skipped undecoded, swscale area filter);
- "pyav every frame": the same decoding every frame from the key frame on (what the skipping
  saves: nothing without B-frames, the "h264-bframes" case has them);
- "torchcodec exact" / "torchcodec approximate": a new `VideoDecoder(bytes, seek_mode=...,
  num_ffmpeg_threads=1, transforms=[Resize, CenterCrop])` per clip, as a per-sample `Dataset`
  makes one, then `get_frames_at(frames)` (exact mode scans the whole file first);
- "torchcodec vidx": the same with `custom_frame_mappings` built from fastdata's clip index
  (no scan: what torchcodec inside fastdata's workers would do).

Each round decodes every clip with every decoder, one after the other in a rotated order (a
slow spell of a shared machine falls on all of them); the figure is the median over rounds and
clips, and "x pyav" is a decoder's median time over PyAV's (below 1: faster than PyAV). "diff"
is the mean absolute pixel difference from PyAV's output on one clip (the scaling filters
differ: a few levels), beside "next-frame diff", PyAV's own output for the clip one frame later
(what a decoder returning the wrong frames would show). torchcodec is skipped, with the reason
printed and recorded, where it does not import (not installed, no FFmpeg 4-8 shared libraries,
a torch it was not built for).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from common import print_table, results_dir, save_results  # noqa: I001  (run as a script)
from fastdata_pipelines.env import cpu_description

import fastdata.read.decoders.video as clip_decoder
from fastdata.format.video import ClipIndex, probe
from fastdata.read.decoders.video import decode_clip

SIDE = 112
FRAMES, STRIDE = 8, 2
FPS = 30
#: (codec, width, height, seconds) of the videos timed.
CASES: list[tuple[str, int, int, float]] = [
    (codec, w, h, s)
    for codec in ("h264", "vp9")
    for w, h, s in ((64, 64, 2.0), (160, 120, 10.0), (320, 240, 10.0), (320, 240, 60.0))
] + [("h264-bframes", 320, 240, 10.0)]  # x264's "medium" preset: B-frames, as cameras write
QUICK_CASES: list[tuple[str, int, int, float]] = [("h264", 64, 64, 2.0), ("vp9", 64, 64, 2.0)]
_ENCODERS = {
    "h264": ("libx264", "mp4"),
    "h264-bframes": ("libx264", "mp4"),
    "vp9": ("libvpx-vp9", "webm"),
}


@dataclass(frozen=True)
class Video:
    """One video as the decoders get it: its bytes, its clip index and that index as
    torchcodec's frame mappings JSON (made once, untimed: a shard would store it)."""

    data: bytes
    index: ClipIndex
    mappings: str


Decoder = Callable[[Video, np.ndarray], Any]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median over all)")
    p.add_argument("--clips", type=int, default=12, help="random clips per video per round")
    p.add_argument("--quick", action="store_true", help="two 2 s videos, 2 rounds of 3 clips")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=None, help="results folder (default $OUT or benchmarks/results)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.clips = min(args.rounds, 2), min(args.clips, 3)
    return args


# ----------------------------------------------------------------------------- data


def make_video(folder: Path, codec: str, width: int, height: int, seconds: float) -> Path:
    """A video of a noise texture scrolling diagonally (a key frame every second)."""
    encoder, suffix = _ENCODERS[codec]
    path = folder / f"{codec}-{width}x{height}-{seconds:g}s.{suffix}"
    if codec == "h264":
        options = {"preset": "ultrafast", "keyint_min": str(FPS), "bf": "0"}
    elif codec == "h264-bframes":
        options = {"preset": "medium", "keyint_min": str(FPS), "bf": "3"}
    else:
        options = {"deadline": "realtime", "cpu-used": "8", "keyint_min": str(FPS)}
    seed = width * height + int(seconds)
    return scrolling_video(path, encoder, options, (width, height), seconds, seed, FPS)


def scrolling_video(
    path: Path,
    encoder: str,
    options: dict[str, str],
    size: tuple[int, int],
    seconds: float,
    seed: int,
    fps: int,
) -> Path:
    """Write a noise texture (4x4 blocks: a camera's bitrate, not a flat colour's) scrolling
    diagonally, `fps` frames a second with a key frame a second, encoded by `encoder`."""
    rng = np.random.default_rng(seed)
    width, height = size
    texture = rng.integers(0, 256, (height * 2, width * 2, 3), dtype=np.uint8)
    texture = np.repeat(np.repeat(texture[::4, ::4], 4, 0), 4, 1)
    out = av.open(str(path), "w")
    stream = out.add_stream(encoder, rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.codec_context.gop_size = fps
    stream.options = options
    for i in range(int(seconds * fps)):
        y, x = (2 * i) % height, (3 * i) % width
        frame = av.VideoFrame.from_ndarray(texture[y : y + height, x : x + width], format="rgb24")
        out.mux(stream.encode(frame))
    out.mux(stream.encode())
    out.close()
    return path


def random_clips(index: ClipIndex, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """`count` clips of FRAMES frames STRIDE apart, each from a random start (a frame is left
    after each clip: the check of `time_case` decodes the clip one frame later too)."""
    span = (FRAMES - 1) * STRIDE
    starts = rng.integers(0, index.frames - span - 1, count)
    return [int(s) + STRIDE * np.arange(FRAMES) for s in starts]


# ----------------------------------------------------------------------------- decoders


def torchcodec_status() -> tuple[Any, str]:
    """(the torchcodec module, its version and FFmpeg's), or (None, why it cannot run here)."""
    try:
        import torchcodec
        from torchcodec._core import ops
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError/RuntimeError loading FFmpeg
        return None, f"torchcodec does not import: {type(exc).__name__}: {exc}"[:600]
    ffmpeg = ops.get_ffmpeg_library_versions()
    return torchcodec, f"torchcodec {torchcodec.__version__}, FFmpeg {ffmpeg.get('ffmpeg_version')}"


def _frame_mappings(index: ClipIndex) -> str:
    """torchcodec's `custom_frame_mappings` JSON (ffprobe's frame list) from a clip index."""
    pts = index.pts.tolist()
    durations = np.diff(index.pts).tolist() or [1]
    durations.append(int(statistics.median(durations)))
    keys = set(index.keys.tolist())
    frames = [
        {"pts": p, "duration": d, "key_frame": int(i in keys)}
        for i, (p, d) in enumerate(zip(pts, durations, strict=True))
    ]
    return json.dumps({"frames": frames})


def _every_frame(video: Video, frames: np.ndarray) -> np.ndarray:
    """`decode_clip` decoding every frame from the key frame on (no ``skip_frame="NONREF"``
    for the frames the clip does not keep): what skipping unreferenced frames saves."""
    skipping = clip_decoder._decoded
    clip_decoder._decoded = lambda container, stream, wanted: container.decode(stream)
    try:
        return decode_clip(video.data, video.index, frames, SIDE)
    finally:
        clip_decoder._decoded = skipping


def decoders(torchcodec: Any) -> dict[str, Decoder]:
    """The decoders timed, by name (PyAV's always; torchcodec's where it imports)."""
    found: dict[str, Decoder] = {
        "pyav": lambda video, frames: decode_clip(video.data, video.index, frames, SIDE),
        "pyav every frame": _every_frame,
    }
    if torchcodec is None:
        return found
    from torchcodec.decoders import VideoDecoder
    from torchcodec.transforms import CenterCrop, Resize

    def make(mode: str) -> Decoder:
        def decode(video: Video, frames: np.ndarray) -> torch.Tensor:
            width, height = _cover(video.index)
            options: dict[str, Any] = {"seek_mode": mode}
            if mode == "vidx":  # the JSON parsed per clip, as a worker parses a sample's vidx
                options = {"custom_frame_mappings": video.mappings}
            decoder = VideoDecoder(
                video.data,
                num_ffmpeg_threads=1,
                transforms=[Resize((height, width)), CenterCrop((SIDE, SIDE))],
                **options,
            )
            return decoder.get_frames_at(frames.tolist()).data

        return decode

    for mode in ("exact", "approximate", "vidx"):
        found[f"torchcodec {mode}"] = make(mode)
    return found


def _cover(index: ClipIndex) -> tuple[int, int]:
    """(width, height) that covers SIDE x SIDE keeping the aspect (decode_clip's scaling)."""
    scale = SIDE / min(index.width, index.height)
    return max(SIDE, round(index.width * scale)), max(SIDE, round(index.height * scale))


# ----------------------------------------------------------------------------- measures


def time_case(video: Video, runs: dict[str, Decoder], args: argparse.Namespace) -> dict[str, Any]:
    """Per-clip seconds of every decoder on one video (rounds x clips), and each one's pixels'
    mean absolute difference from PyAV's on a first clip ("diff"; scaling filters differ), beside
    PyAV's own difference to the clip one frame later ("next-frame diff": a wrong frame's)."""
    rng = np.random.default_rng(args.seed)
    first = random_clips(video.index, 1, rng)[0]
    reference = decode_clip(video.data, video.index, first, SIDE).astype(np.float32)
    later = decode_clip(video.data, video.index, first + 1, SIDE).astype(np.float32)
    diff = {"next frame": float(np.abs(later - reference).mean())}
    for name, run in runs.items():  # also the warm-up
        pixels = np.asarray(run(video, first), dtype=np.float32)
        diff[name] = float(np.abs(pixels - reference).mean())
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(args.rounds):
        for k, frames in enumerate(random_clips(video.index, args.clips, rng)):
            turn = (round_ + k) % len(names)  # each clip by every decoder, in a rotated order
            for name in names[turn:] + names[:turn]:
                start = time.perf_counter()
                runs[name](video, frames)
                times[name].append(time.perf_counter() - start)
    return {"times": times, "diff": diff}


def case_rows(case: tuple[str, int, int, float], found: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per decoder of a video: median ms per clip, and its time over PyAV's."""
    codec, width, height, seconds = case
    base = statistics.median(found["times"]["pyav"])
    rows = []
    for name, times in found["times"].items():
        median = statistics.median(times)
        rows.append(
            {
                "video": f"{codec} {width}x{height} {seconds:g} s",
                "decoder": name,
                "clips": len(times),
                "ms/clip": round(median * 1e3, 2),
                "x pyav": round(median / base, 2),
                "diff": round(found["diff"][name], 1),
                "next-frame diff": round(found["diff"]["next frame"], 1),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Make the videos, time every decoder on each, print and save the table."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    torchcodec, status = torchcodec_status()
    print(status if torchcodec is not None else f"torchcodec skipped: {status}")
    runs = decoders(torchcodec)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for case in QUICK_CASES if args.quick else CASES:
            data = make_video(Path(folder), *case).read_bytes()
            index = probe(data)
            video = Video(data, index, _frame_mappings(index))
            rows += case_rows(case, time_case(video, runs, args))
    versions = {
        "pyav": f"PyAV {av.__version__}, FFmpeg {getattr(av, 'ffmpeg_version_info', '?')}",
        "torchcodec": status if torchcodec is not None else None,
        "torchcodec_skipped": None if torchcodec is not None else status,
    }
    cpu = cpu_description().get("model", "unknown CPU")
    title = (
        f"ms per clip of {FRAMES} frames (stride {STRIDE}) to {SIDE} px, one thread, median of "
        f"{args.rounds} rounds x {args.clips} clips; {cpu}; {versions['pyav']}; "
        f"{versions['torchcodec'] or 'torchcodec: skipped'}"
    )
    columns = ["video", "decoder", "clips", "ms/clip", "x pyav", "diff", "next-frame diff"]
    tables = [print_table(rows, columns, title)]
    results = {"args": vars(args), "rows": rows, "decoders": versions, "cpu_model": cpu}
    save_results("bench_video_decoders", results_dir(args.out), results, tables)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
