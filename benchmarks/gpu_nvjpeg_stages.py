"""Where the nvjpeg backend's time goes: read, GPU decode, box draws, crop + resize, per batch.

    python benchmarks/gpu_nvjpeg_stages.py --out $OUT            # on the GPU machine
    python benchmarks/gpu_nvjpeg_stages.py --device cpu --batches 3 --out /tmp/st   # dry run

The GPU check found the nvjpeg backend at 2.8x the cpu backend on clothing-small (target 5x). This
script times each stage of `NvjpegLoader.decode_batch` on the same shards, with a CUDA sync after
each stage, and times the crop + resize stage three ways on the same decoded images and boxes:

- ``loop``: the implementation before 2026-12-04 (interpolate, round, clamp, flip, cast per image);
- ``batched``: `fastdata.read.backends.crop_resize.crop_resize` today: the antialiased filter's
  weights as matrices, two batched matmuls per distinct image size (pixels within one level);
- ``roi``: torchvision's ``roi_align`` on the batch padded to its largest image (one kernel for
  every crop; an area-average resampler, so pixels differ: the mean absolute difference to
  ``loop`` is reported).

On the CPU (``--device cpu``: no nvJPEG) the decode stage uses Pillow, so the figures only check
that the script runs. Writes ``nvjpeg_stages.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401 - sys.path and fastdata_pipelines for a bare checkout

from fastdata.format.manifest_io import load_manifest  # noqa: E402
from fastdata.read.backends import nvjpeg  # noqa: E402
from fastdata.read.base import LoaderSpec  # noqa: E402
from fastdata.read.shardio import ShardReader  # noqa: E402
from fastdata.write import ShardOptions, write_shards  # noqa: E402
from fastdata.write.sources.folder import FolderSource  # noqa: E402


def crop_resize_per_image(images, boxes, out_hw, flips) -> torch.Tensor:
    """The crop + resize before 2026-12-04: rounding, clamping, flip and cast per image."""
    out = torch.empty((len(images), 3, *out_hw), dtype=torch.uint8, device=images[0].device)
    for i, (image, box, flip) in enumerate(zip(images, boxes, flips, strict=True)):
        left, top, right, bottom = box
        h, w = bottom - top, right - left
        crop = image[:3, top:bottom, left:right].unsqueeze(0)
        if (h, w) != tuple(out_hw):
            crop = F.interpolate(
                crop.float(), size=out_hw, mode="bilinear", antialias=True, align_corners=False
            )
            crop = crop.round_().clamp_(0, 255)
        out[i] = crop[0].flip(-1) if flip else crop[0]
    return out


def crop_resize_roi(images, boxes, out_hw, flips) -> torch.Tensor:
    """One roi_align over the batch padded to its largest image (area-average resampling)."""
    from torchvision.ops import roi_align

    hmax = max(int(im.shape[1]) for im in images)
    wmax = max(int(im.shape[2]) for im in images)
    padded = torch.zeros((len(images), 3, hmax, wmax), dtype=torch.uint8, device=images[0].device)
    for i, image in enumerate(images):
        padded[i, :, : image.shape[1], : image.shape[2]] = image[:3]
    rois = torch.tensor(
        [[i, *box] for i, box in enumerate(boxes)],
        dtype=torch.float32,
        device=padded.device,
    )
    out = roi_align(
        padded.float(), rois, out_hw, spatial_scale=1.0, sampling_ratio=-1, aligned=True
    )
    flip = torch.tensor(flips, dtype=torch.bool, device=out.device)
    out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def pil_decoder(device: torch.device):
    from fastdata.read.decoders.image import Geometry, decode_image

    def decode(data: list[torch.Tensor]) -> list[torch.Tensor]:
        rng = np.random.default_rng(0)
        return [
            torch.from_numpy(decode_image(t.numpy().tobytes(), Geometry("none"), rng))
            .permute(2, 0, 1)
            .to(device)
            for t in data
        ]

    return decode


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, {}

    def __call__(self, name, fn, *args):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        result = fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.setdefault(name, []).append(time.perf_counter() - t0)
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--size", type=int, default=224)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from fastdata_pipelines.env import data_dir

    folder = data_dir() / "clothing-small"
    if not folder.is_dir():
        sys.exit(f"needs clothing-small at {folder} (FASTDATA_DATA_DIR)")
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="nvjpeg-stages-"))
    write_shards(FolderSource(folder), tmp / "shards", ShardOptions(progress=False))
    manifest = load_manifest(tmp / "shards")
    from fastdata.augment.presets import get_preset

    spec = LoaderSpec(
        manifest=manifest, split="train", batch_size=args.batch, train=True, seed=0,
        device=str(device), image_size=args.size, preset=get_preset("photo"), drop_last=True,
    )  # fmt: skip
    decoder = None if device.type == "cuda" else pil_decoder(device)
    loader = nvjpeg.NvjpegLoader(spec, decoder=decoder)
    plan = spec.plan(0)
    reader = ShardReader(manifest, "train")
    clock = Clock(device)
    diffs, n = [], 0
    for number in range(min(args.batches, len(plan.rows))):
        batch = clock("read", nvjpeg.read_batch, reader, spec, plan, number)
        clock("read_and_draw", nvjpeg.read_batch, reader, spec, plan, number, loader.geometry)
        images = clock("decode", loader._decode_all, batch, reader)

        def draw(images=images, batch=batch):
            boxes, flips = [], []
            for image, position in zip(images, batch.positions, strict=True):
                size = (int(image.shape[1]), int(image.shape[2]))
                box, flip = nvjpeg.draw_box(size, loader.geometry, spec, 0, position)
                boxes.append(box)
                flips.append(flip)
            return boxes, flips

        boxes, flips = clock("boxes", draw)
        hw = loader.geometry.out_hw
        loop = clock("crop_loop", crop_resize_per_image, images, boxes, hw, flips)
        tail = clock("crop_batched", nvjpeg.crop_resize, images, boxes, hw, flips)
        worst = float((loop.float() - tail.float()).abs().max())
        assert worst <= 1, f"the batched crop + resize is {worst} levels off the loop's pixels"
        try:
            roi = clock("crop_roi", crop_resize_roi, images, boxes, hw, flips)
            diffs.append(float((roi.float() - loop.float()).abs().mean()))
        except ImportError:
            pass
        n += len(batch.labels)
    reader.close()
    skip = 2 if len(clock.times["read"]) > 4 else 0  # warm-up batches (CUDA init, cuDNN)
    per_batch = {k: float(np.median(v[skip:])) * 1e3 for k, v in clock.times.items()}
    result = {
        "environment": common.environment(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "batch": args.batch,
        "images": n,
        "median_ms_per_batch": {k: round(v, 3) for k, v in per_batch.items()},
        "img_per_s_if_alone": {k: round(args.batch / (v / 1e3)) for k, v in per_batch.items()},
        "roi_vs_loop_mean_abs_diff": round(float(np.mean(diffs)), 3) if diffs else None,
    }
    (args.out / "nvjpeg_stages.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main()
