"""The CIFAR-100 pipeline's progress table: one printed row per training epoch."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["EpochTable"]


class EpochTable(pl.Callback):
    """Prints one row per training epoch and keeps the rows (`rows`) for metrics.json.

    img/s counts training samples over all ranks per second of training (validation excluded);
    data-wait is `fastdata.tune.monitor.LoaderMonitor`'s fraction of step time spent waiting for
    the next batch ("-" when no monitor runs).

    Args:
        monitor: the run's LoaderMonitor, or None.
    """

    HEADER = f"{'epoch':>5}  {'train loss':>10}  {'test top-1':>10}  {'img/s':>8}  {'data-wait':>9}"

    def __init__(self, monitor: pl.Callback | None = None) -> None:
        self.monitor = monitor
        self.rows: list[dict[str, Any]] = []
        self._t0 = self._val_t0 = 0.0
        self._val_s = 0.0
        self._samples = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0, self._val_s, self._samples = time.perf_counter(), 0.0, 0
        if not self.rows and trainer.is_global_zero:
            print(self.HEADER, flush=True)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._samples += len(batch[1]) * trainer.world_size

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_s += time.perf_counter() - self._val_t0

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics
        train_s = max(time.perf_counter() - self._t0 - self._val_s, 1e-9)
        wait = (getattr(self.monitor, "summary", None) or {}).get("data_wait_frac")
        row = {
            "epoch": trainer.current_epoch + 1,
            "train_loss": _item(metrics.get("train/loss")),
            "test_top1": _item(metrics.get("test/top1")),
            "img_per_s": self._samples / train_s,
            "data_wait_frac": wait,
            "train_s": train_s,
            "test_s": self._val_s,
        }
        self.rows.append(row)
        if trainer.is_global_zero:
            print(_format_row(row), flush=True)


def _item(value: torch.Tensor | None) -> float | None:
    return None if value is None else float(value)


def _format_row(row: dict[str, Any]) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return (
        f"{row['epoch']:>5}  {fmt(row['train_loss'], '.3f'):>10}  {fmt(row['test_top1'], '.2%'):>10}  "
        f"{row['img_per_s']:>8,.0f}  {fmt(row['data_wait_frac'], '.1%'):>9}"
    )
