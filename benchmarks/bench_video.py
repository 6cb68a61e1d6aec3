"""Video clips/s: fastdata's video loader against the loader most users write, and worker memory.

    python benchmarks/bench_video.py [--videos 16] [--seconds 8] [--workers 2] [--out DIR]

1. Throughput. `--videos` H.264 MP4 videos (320x180, 30 fps, a key frame a second, a scrolling
   noise texture so the bitrate is a camera's, not a flat colour's) are made here and sharded
   with `fastdata shard video`. Each epoch reads `--clips` random clips of 8 frames at stride 2
   per video, decoded to 112x112:
   - fastdata: `VideoLoader` (the cpu backend's workers; seek to the key frame before the clip,
     decode forward, swscale to the output size; whole batches from each worker);
   - baseline "pyav": the loader most users write, a map-style `Dataset` whose `__getitem__`
     opens the video file with PyAV, decodes frames from the start up to the clip's last frame
     (`container.decode(video=0)`, `to_ndarray(format="rgb24")`), keeps the clip's frames and
     resizes them with torch, in a `DataLoader` with the same workers and batch size;
   - baseline "pyav-seek": the same, but seeking to the clip's start first (`container.seek`),
     as `torchvision.io.read_video(start_pts=...)` does;
   - baseline "torchcodec" (where torchcodec imports; otherwise skipped, the reason printed and
     in the table): the same `Dataset` with torchcodec, a `VideoDecoder(path,
     num_ffmpeg_threads=1)` per sample (its default exact seek mode) and `get_frames_at` the
     clip's frames, resized with torch as above.
   The baselines read exactly the clips fastdata read in its timed epoch (same videos, frames).
   Each loader runs a warm-up epoch (workers start), then a timed one; rounds alternate.
2. Memory. One worker decodes clips of a long video and of a short one (fastdata and "pyav");
   its peak RSS (VmHWM) is the figure: fastdata's should not grow with the video's length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from bench_video_decoders import scrolling_video, torchcodec_status  # noqa: I001  (script)
from common import print_table, results_dir, save_results
from fastdata_pipelines.env import cpu_description
from torch.utils.data import DataLoader, Dataset

from fastdata.format.manifest_io import load_manifest
from fastdata.read.backends.video import make_video_loader
from fastdata.read.base import WorkerSettings
from fastdata.read.clips import ClipSampling, ClipSpec
from fastdata.read.source_ids import load_source_ids
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source

SIDE = 112
SAMPLING = dict(frames=8, stride=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--videos", type=int, default=16, help="videos in the throughput set")
    p.add_argument("--seconds", type=float, default=8.0, help="length of each of those videos")
    p.add_argument("--clips", type=int, default=4, help="clips per video per epoch")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of every loader")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="timed epochs per loader (median)")
    p.add_argument("--long-seconds", type=float, default=60.0, help="the long video (memory)")
    p.add_argument(
        "--out", default=None, help="results folder (default $OUT or benchmarks/results)"
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def make_video(path: Path, seconds: float, seed: int, size=(320, 180), fps: int = 30) -> Path:
    """An H.264 MP4 of a noise texture scrolling diagonally (a key frame every second)."""
    options = {"preset": "ultrafast", "keyint_min": str(fps), "bf": "0"}
    return scrolling_video(path, "libx264", options, size, seconds, seed, fps)


def shard(videos: list[Path], root: Path, out: Path) -> Path:
    """Shard `videos` (all in class "a" under `root`) with `fastdata shard video`."""
    write_shards(open_source("video", root), out, ShardOptions(workers=1, progress=False))
    return out


def make_set(root: Path, count: int, seconds: float, seed: int = 0) -> Path:
    (root / "a").mkdir(parents=True, exist_ok=True)
    videos = [make_video(root / "a" / f"{i:03d}.mp4", seconds, seed + i) for i in range(count)]
    return shard(videos, root, root.parent / f"{root.name}-shards")


# ----------------------------------------------------------------------------- loaders


def fastdata_loader(out: Path, args: argparse.Namespace, workers: int, clips: int) -> Any:
    spec = ClipSpec(
        manifest=load_manifest(out),
        split="train",
        train=True,
        batch_size=args.batch_size,
        image_size=SIDE,
        keys=True,
        clips=ClipSampling(clips=clips, **SAMPLING),
        workers=WorkerSettings(num_workers=workers, persistent_workers=True),
    )
    return make_video_loader(spec)


class PyAVClips(Dataset):
    """The loader most users write: open, decode, keep the clip's frames, resize (see above)."""

    def __init__(self, items: list[tuple[str, list[int]]], seek: bool) -> None:
        self.items, self.seek = items, seek

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        path, frames = self.items[i]
        wanted = set(frames)
        kept: dict[int, np.ndarray] = {}
        with av.open(path) as container:
            stream = container.streams.video[0]
            step = 1 / float(stream.average_rate)
            if self.seek and frames[0] > 0:
                start = int(frames[0] * step / stream.time_base)
                container.seek(start, stream=stream, backward=True)
            for frame in container.decode(stream):
                number = round(float(frame.pts * stream.time_base) / step)
                if number in wanted:
                    kept[number] = frame.to_ndarray(format="rgb24")
                if number >= frames[-1]:
                    break
        return resize_crop(
            torch.from_numpy(np.stack([kept[f] for f in frames])).permute(0, 3, 1, 2)
        )


class TorchCodecClips(PyAVClips):
    """The same loader with torchcodec: a decoder per sample, the clip's frames, torch resize."""

    def __getitem__(self, i: int) -> torch.Tensor:
        from torchcodec.decoders import VideoDecoder

        path, frames = self.items[i]
        return resize_crop(VideoDecoder(path, num_ffmpeg_threads=1).get_frames_at(frames).data)


def resize_crop(x: torch.Tensor) -> torch.Tensor:
    """uint8 (T, 3, H, W) frames scaled to cover SIDE x SIDE (bilinear, antialiased), centre crop."""
    x = x.float()
    scale = SIDE / min(x.shape[-2:])
    x = torch.nn.functional.interpolate(x, scale_factor=scale, mode="bilinear", antialias=True)
    top, left = (x.shape[-2] - SIDE) // 2, (x.shape[-1] - SIDE) // 2
    return x[..., top : top + SIDE, left : left + SIDE].round().clamp(0, 255).to(torch.uint8)


def baseline_loader(
    items, args: argparse.Namespace, workers: int, seek: bool, kind: type = PyAVClips
) -> DataLoader:
    return DataLoader(
        kind(items, seek),
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def clip_items(out: Path, keys: list[dict[str, list]]) -> list[tuple[str, list[int]]]:
    """(video file, frame numbers) of the clips fastdata read, in its order."""
    manifest = load_manifest(out)
    ids = load_source_ids(manifest, "train")
    root = Path(manifest.source["fingerprint"]["root"])
    items = []
    for batch in keys:
        for key, start in zip(batch["key"], batch["start"], strict=True):
            frames = [start + k * SAMPLING["stride"] for k in range(SAMPLING["frames"])]
            items.append((str(root / ids.ids[key]), frames))
    return items


# ----------------------------------------------------------------------------- measures


def epoch(loader: Any, keys: list | None = None) -> tuple[float, int]:
    """(seconds, clips) of one pass over `loader`."""
    start, count = time.perf_counter(), 0
    for batch in loader:
        x = batch[0]
        count += len(x)
        if keys is not None:
            keys.append(batch[2])
    return time.perf_counter() - start, count


def throughput(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    out = make_set(tmp / "set", args.videos, args.seconds)
    fast = fastdata_loader(out, args, args.workers, args.clips)
    fast.set_epoch(0)
    epoch(fast)  # warm-up: workers start
    keys: list = []
    fast.set_epoch(1)
    times = {"fastdata": [epoch(fast, keys)[0]]}
    items = clip_items(out, keys)
    loaders = {
        "pyav": baseline_loader(items, args, args.workers, seek=False),
        "pyav-seek": baseline_loader(items, args, args.workers, seek=True),
    }
    torchcodec, status = torchcodec_status()
    print(status if torchcodec is not None else f"torchcodec skipped: {status}")
    if torchcodec is not None:
        loaders["torchcodec"] = baseline_loader(items, args, args.workers, True, TorchCodecClips)
    for loader in loaders.values():
        epoch(loader)  # warm-up
    for round_ in range(args.rounds):
        if round_:
            fast.set_epoch(1)
            times["fastdata"].append(epoch(fast)[0])
        for name, loader in loaders.items():
            times.setdefault(name, []).append(epoch(loader)[0])
    fast.close()
    clips = len(items)
    rates = {name: clips / statistics.median(t) for name, t in times.items()}
    rows = [
        {
            "loader": name,
            "clips": clips,
            "clips/s": round(rate, 1),
            "fastdata x": round(rates["fastdata"] / rate, 2),
            "note": status if name == "torchcodec" else "",
        }
        for name, rate in rates.items()
    ]
    if torchcodec is None:
        rows.append({"loader": "torchcodec", "note": f"skipped: {status}"})
    return rows


def _rss_kb(pid: int) -> dict[str, int]:
    """The process's peak RSS (VmHWM) and its current anonymous and file-backed RSS, in kB."""
    found = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "RssAnon", "RssFile"):
                found[name] = int(value.split()[0])
    return found


def memory(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Peak RSS of one worker decoding 8 clips (random starts) of a long and a short video."""
    rows = []
    for name, seconds in (("short", 2.0), ("long", args.long_seconds)):
        out = make_set(tmp / name, 1, seconds, seed=7)
        for loader_name in ("fastdata", "pyav"):
            fast = fastdata_loader(out, argparse.Namespace(batch_size=1), 1, 8)
            fast.set_epoch(0)
            keys: list = []
            if loader_name == "fastdata":
                for _ in fast:  # the one worker's figures after each batch
                    peak = _rss_kb(fast._iterator()._workers[0].pid)
            else:
                epoch(fast, keys)
                items = clip_items(out, keys)
                loader = DataLoader(PyAVClips(items, seek=False), batch_size=1, num_workers=1)
                iterator = iter(loader)
                for _ in iterator:
                    peak = _rss_kb(iterator._workers[0].pid)
            fast.close()
            rows.append(
                {
                    "loader": loader_name,
                    "video": f"{name} ({seconds:g} s, {int(seconds * 30)} frames)",
                    "bytes": sum(p.stat().st_size for p in out.glob("*.tar")),
                    "worker peak RSS MB": round(peak["VmHWM"] / 1024, 1),
                    "anon MB": round(peak["RssAnon"] / 1024, 1),
                    "file-backed MB": round(peak["RssFile"] / 1024, 1),
                }
            )
    return rows


def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        speed = throughput(args, tmp)
        rss = memory(args, tmp)
    cpu = cpu_description().get("model", "unknown CPU")
    codec = ".".join(map(str, av.library_versions["libavcodec"]))
    decoder = f"PyAV {av.__version__}, libavcodec {codec}: FFmpeg's software H.264 decoder"
    title = (
        f"clips/s, {args.videos} videos x {args.clips} clips of 8 frames (stride 2) at {SIDE} "
        f"px, {args.workers} workers; {cpu}; {decoder}"
    )
    tables = [
        print_table(speed, ["loader", "clips", "clips/s", "fastdata x", "note"], title),
        print_table(
            rss,
            ["loader", "video", "bytes", "worker peak RSS MB", "anon MB", "file-backed MB"],
            "worker memory",
        ),
    ]
    results = {"args": vars(args), "throughput": speed, "memory": rss, "decoder": decoder}
    save_results("bench_video", results_dir(args.out), results, tables)
    return results


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
