"""GPU check, step "video": clips/s of the DALI video loader (NVDEC) against the cpu one.

`--video-count` H.264 MP4 videos (bench_video.py's: 320x180, 30 fps, a key frame a second,
`--video-seconds` long) are made here with PyAV and sharded; each loader reads 4 random clips
of 8 frames at stride 2 per video at 112 x 112 (bench_video.py's clips) for a warm-up epoch and
a timed one, the clips on the device at the end: cpu (`VideoLoader`, ``--workers`` processes,
PyAV) and dali (`DaliVideoLoader`, ``fn.decoders.video`` on the ``mixed`` backend). The dali
row carries its ``cpu_fallbacks`` (0 expected: NVDEC takes H.264) and its rate over cpu's
(the issue's target: >= 5x the per-sample PyAV baseline).

Skipped, with the reason in the report, without a GPU, without PyAV (the bare GPU machine this
check was written for has none: the clips cannot be made there) or without DALI.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from gpu_steps import sync

__all__ = ["video_step"]


def video_step(check: Any) -> None:
    """One row per backend (cpu, dali), or one skipped row saying what is missing."""
    reason = "--skip video" if "video" in check.skip else _missing(check)
    if reason is not None:
        return check.skipped("video", "*", reason)
    a = check.args
    shards: list[Path] = []

    def make() -> dict[str, Any]:
        from bench_video import make_set  # imports av: only once it is known to be there

        shards.append(make_set(check.tmp / "video" / "videos", a.video_count, a.video_seconds))
        return {"videos": a.video_count, "seconds": a.video_seconds}

    check.step("shard-video", "-", make)
    if not shards:
        return None
    rates: dict[str, float] = {}
    for backend in ("cpu", "dali"):
        result = check.step("video", backend, lambda b=backend: _rate(check, shards[0], b, rates))
        if result is not None:
            rates[backend] = result["clips_per_s"]
    return None


def _missing(check: Any) -> str | None:
    """Why the step cannot run here (None: it can)."""
    if check.device.type != "cuda":
        return "needs a GPU (the DALI video loader's mixed backend)"
    if importlib.util.find_spec("av") is None:
        return "PyAV is not installed: the H.264 clips are made here with it (pip install av)"
    from fastdata.read.backends.dali import dali_status

    ok, why = dali_status()
    return None if ok else f"DALI: {why}"


def _rate(check: Any, shards: Path, backend: str, rates: dict[str, float]) -> dict[str, Any]:
    """Clips/s of `backend` over its second epoch (the first holds the start-up)."""
    from bench_video import SAMPLING, SIDE

    from fastdata.format.manifest_io import load_manifest
    from fastdata.read.base import WorkerSettings
    from fastdata.read.clips import ClipSampling, ClipSpec

    workers = check.args.workers if backend == "cpu" else 4  # dali: its CPU threads
    spec = ClipSpec(
        manifest=load_manifest(shards), split="train", train=True, batch_size=16,
        image_size=SIDE, clips=ClipSampling(clips=4, **SAMPLING), device=str(check.device),
        workers=WorkerSettings(num_workers=workers, persistent_workers=True),
    )  # fmt: skip
    loader = _loader(spec, backend)
    row: dict[str, Any] = {"workers": workers}
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        start, clips = time.perf_counter(), 0
        for batch in loader:
            x = batch[0].to(check.device, non_blocking=True)
            clips += len(x)
        sync(check.device)
        row[f"epoch{epoch}_s"] = round(time.perf_counter() - start, 2)
    row.update(clips=clips, clips_per_s=round(clips / row["epoch1_s"], 1))
    if backend == "dali":
        row["cpu_fallbacks"] = loader.cpu_fallbacks
        if rates.get("cpu"):
            row["x_cpu"] = round(row["clips_per_s"] / rates["cpu"], 2)
    return row


def _loader(spec: Any, backend: str) -> Any:
    if backend == "dali":
        from fastdata.read.backends.dali.video import make_dali_video_loader

        return make_dali_video_loader(spec)
    from fastdata.read.backends.video import make_video_loader

    return make_video_loader(spec)
