"""What `fastdata shard --max-side N` costs in accuracy (and what it saves), on clothing-small.

    python benchmarks/bench_max_side.py [--sides 256,128] [--seeds 0,1,2] [--out DIR] [--quick]

clothing-small's train (800 photos, mostly 400 x 533) and validation (341) splits are sharded once
as they are and once per N of `--sides` (`ShardOptions(max_side=N)`: the longer side shrunk to N,
re-encoded as JPEG at quality 90; the unshrunk set keeps the source's JPEG bytes), into a temporary
folder: a row records the shards' bytes and the sharding seconds. On each shard set the same small
ResNet (`SmallResNet`, plain torch, defined here) is trained from scratch with
`ShardDataModule(backend="cpu", train_transforms="photo", image_size=S)` (random-resized crop,
scale 0.08-1, + flip in training; resize + centre crop in validation, on the same shrunk shards, as
a user who shards with `--max-side` would) and a plain Lightning `Trainer(accelerator="cpu")`,
once per seed of `--seeds` (the same seeds, hence the same initial weights and epoch plans, on
every shard set). A row gives the validation top-1 after the last epoch (per seed, mean, spread),
its paired difference from the unshrunk set's run of the same seed, and the training img/s
(epochs after the first; validation not counted; on a busy machine this is mostly the load).

The default setting (S = 112, 12 epochs, width 16, batch 64, AdamW one-cycle to 4e-3, 3 seeds, 1
loader worker, 2 threads) took 374 s to 706 s at nice 19 on 2 cores shared with other benchmarks
(load average 2.1 to 3.1), about 9 x 40-75 s of training. Transfer to 224 px training: what matters is the stored side
against the training size, so a side N at S = 112 stands for 2N at S = 224. The default sides are
256 (shorter side 192 = 1.7 x S: crops seldom upsample) and 128 (shorter side 96, below S: every
centre crop and most training crops upsample), i.e. `--max-side` 512 and 256 for a 224 px model.
It does not transfer in accuracy level: a small model trained for minutes on 800 photos is far
from converged (about 30% top-1 on 10 classes; the largest class is 24% of validation), and its
top-1 varies by several points from seed to seed, so only a paired difference larger than that
spread means anything; the per-seed values are kept for that reason.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import print_table, results_dir, save_results  # noqa: I001
from fastdata_pipelines.cifar100.model import BasicBlock  # the pipeline's ResNet block
from fastdata_pipelines.env import data_dir
from torch import nn

from fastdata import WorkerSettings
from fastdata.lightning.datamodule import ShardDataModule
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source

DATASET = "clothing-small"
SPLITS = ["train", "validation"]
BASELINE = "none"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=data_dir(), help=f"folder holding {DATASET}/")
    p.add_argument("--sides", type=ints, default=[256, 128], help="--max-side values")
    p.add_argument("--seeds", type=ints, default=[0, 1, 2], help="training seeds (every shard set)")
    p.add_argument("--image-size", type=int, default=112, help="training side S")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--width", type=int, default=16, help="channels of the model's first stage")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=4e-3, help="AdamW one-cycle peak")
    p.add_argument("--workers", type=int, default=1, help="loader processes")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--shard-workers", type=int, default=1, help="sharding processes")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 epoch, first seed")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = 1, args.seeds[:1]
    if not args.seeds or any(n < 1 for n in args.sides) or args.epochs < 1:
        p.error("need >= 1 seed, sides >= 1 and epochs >= 1")
    return args


# ------------------------------------------------------------------ model


class SmallResNet(nn.Module):
    """A ResNet-10-like classifier: a stride-2 stem, four one-block stages (S/2 .. S/16), pool, fc."""

    def __init__(self, classes: int, width: int = 16) -> None:
        super().__init__()
        w = width
        self.net = nn.Sequential(
            nn.Conv2d(3, w, 3, 2, 1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
            BasicBlock(w, w, 1),
            BasicBlock(w, 2 * w, 2),
            BasicBlock(2 * w, 4 * w, 2),
            BasicBlock(4 * w, 8 * w, 2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8 * w, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Classifier(pl.LightningModule):
    """SmallResNet, cross-entropy (label smoothing 0.1), AdamW with a one-cycle LR; counts top-1."""

    def __init__(self, classes: int, width: int, lr: float, steps: int) -> None:
        super().__init__()
        self.model = SmallResNet(classes, width)
        self.lr, self.steps = lr, steps
        self.loss = nn.CrossEntropyLoss(label_smoothing=0.1)
        self.correct = self.seen = 0
        self.top1: float | None = None  # of the latest validation

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self.model(x), y)

    def on_validation_epoch_start(self) -> None:
        self.correct = self.seen = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.correct += int((self.model(x).argmax(1) == y).sum())
        self.seen += int(y.numel())

    def on_validation_epoch_end(self) -> None:
        self.top1 = self.correct / max(self.seen, 1)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, self.lr, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class EpochTimer(pl.Callback):
    """Seconds and images of every training epoch (validation not counted)."""

    def __init__(self) -> None:
        self.epochs: list[tuple[int, float]] = []  # (images, seconds)
        self._start = 0.0
        self._images = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._start, self._images = time.perf_counter(), 0

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._images += int(batch[0].shape[0])

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.epochs.append((self._images, time.perf_counter() - self._start))

    def img_per_s(self) -> float:
        """Over the epochs after the first (its worker start-up), or the first when alone."""
        timed = self.epochs[1:] or self.epochs
        return sum(n for n, _ in timed) / max(sum(s for _, s in timed), 1e-9)


# ------------------------------------------------------------------ runs


def shard(source_dir: Path, out: Path, side: int | None, workers: int) -> dict[str, Any]:
    """Shard train + validation of `source_dir` into `out`; bytes and seconds as a row."""
    source = open_source("folder", source_dir, splits=SPLITS)
    start = time.perf_counter()
    options = ShardOptions(max_side=side, workers=workers, progress=False)
    write_shards(source, out, options)
    seconds = time.perf_counter() - start
    return {
        "shard_mb": round(sum(f.stat().st_size for f in out.glob("*.tar")) / 1e6, 2),
        "shard_s": round(seconds, 2),
    }


def train(shards: Path, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One training run from scratch on `shards`; its validation top-1 and training img/s."""
    pl.seed_everything(seed, workers=True, verbose=False)
    dm = ShardDataModule(
        shards,
        batch_size=args.batch,
        backend="cpu",
        train_transforms="photo",
        image_size=args.image_size,
        seed=seed,
        workers=WorkerSettings(num_workers=args.workers, prefetch_factor="auto"),
    )
    dm.setup("fit")
    steps = len(dm.train_dataloader()) * args.epochs
    module = Classifier(len(dm.manifest.classes), args.width, args.lr, steps)
    timer = EpochTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        check_val_every_n_epoch=args.epochs,  # one validation, after the last epoch
        num_sanity_val_steps=0,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)
    if module.top1 is None:
        raise RuntimeError(f"{shards}: no validation ran (does the shard set hold 'validation'?)")
    return {
        "top1": round(100 * module.top1, 2),
        "val_images": module.seen,
        "img_per_s": round(timer.img_per_s(), 1),
    }


def summarize(
    name: str,
    shard_row: dict[str, Any],
    runs: dict[int, dict[str, Any]],
    base: dict[int, dict[str, Any]] | None,
) -> dict[str, Any]:
    """A table row of one shard set: its runs' top-1 per seed and mean, paired deltas, img/s."""
    top1 = [runs[s]["top1"] for s in sorted(runs)]
    row: dict[str, Any] = {
        "max_side": name,
        **shard_row,
        "top1_mean": round(statistics.fmean(top1), 2),
        "top1_per_seed": top1,
        "top1_spread": round(max(top1) - min(top1), 2),
        "img_per_s": round(statistics.fmean(runs[s]["img_per_s"] for s in runs), 1),
        "val_images": runs[min(runs)]["val_images"],
    }
    if base is not None:
        deltas = [round(runs[s]["top1"] - base[s]["top1"], 2) for s in sorted(runs)]
        row["delta_per_seed"] = deltas
        row["delta_mean"] = round(statistics.fmean(deltas), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source_dir = args.data / DATASET
    if not (source_dir / "train").is_dir() or not (source_dir / "validation").is_dir():
        print(
            f"skipped: {source_dir} has no train/ and validation/ class folders; pass --data "
            f"with the folder holding {DATASET}/ or set FASTDATA_DATA_DIR"
        )
        return 0
    torch.set_num_threads(args.threads)
    out = results_dir(args.out)
    settings = {
        k: getattr(args, k)
        for k in ("sides", "seeds", "image_size", "epochs", "width", "batch", "lr", "workers")
    }
    settings |= {"threads": args.threads, "quick": args.quick, "data": str(source_dir)}
    print(f"max-side accuracy: {settings}")
    work = Path(tempfile.mkdtemp(prefix="fastdata-max-side-"))
    rows: list[dict[str, Any]] = []
    runs_by_set: dict[str, dict[int, dict[str, Any]]] = {}
    wall = time.perf_counter()
    try:
        for side in [None, *args.sides]:
            name = BASELINE if side is None else str(side)
            folder = work / f"side-{name}"
            shard_row = shard(source_dir, folder, side, args.shard_workers)
            print(f"  shards {name}: {shard_row['shard_mb']} MB in {shard_row['shard_s']} s")
            runs: dict[int, dict[str, Any]] = {}
            for seed in args.seeds:
                runs[seed] = train(folder, seed, args)
                print(f"  {name} seed {seed}: {runs[seed]}")
            runs_by_set[name] = runs
            base = None if side is None else runs_by_set[BASELINE]
            rows.append(summarize(name, shard_row, runs, base))
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    none_mb = rows[0]["shard_mb"]
    for row in rows:
        row["mb_vs_none"] = round(row["shard_mb"] / none_mb, 2) if none_mb else None
    columns = [
        "max_side", "shard_mb", "mb_vs_none", "shard_s", "img_per_s",
        "top1_mean", "top1_per_seed", "top1_spread", "delta_per_seed", "delta_mean",
    ]  # fmt: skip
    title = (
        f"--max-side on {DATASET}: validation top-1 (%) after {args.epochs} epochs at "
        f"{args.image_size} px, seeds {args.seeds}"
    )
    table = print_table(rows, columns, title)
    wall_s = round(time.perf_counter() - wall, 1)
    print(f"wall time {wall_s} s")
    save_results("max_side", out, {"settings": settings, "wall_s": wall_s, "rows": rows}, [table])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
