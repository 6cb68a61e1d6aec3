"""The CIFAR-100 pipeline's progress table: one printed row per training epoch."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch

from .budget import BudgetPlanner

__all__ = ["EpochTable"]


class EpochTable(pl.Callback):
    """Prints one row per training epoch and keeps the rows (`rows`) for metrics.json.

    img/s counts training samples over all ranks per second of training (validation excluded);
    data-wait is `fastdata.tune.monitor.LoaderMonitor`'s fraction of step time spent waiting for
    the next batch ("-" when no monitor runs).

    With a `BudgetPlanner` each row also shows the plan made at that epoch's end: the planned
    epochs (the last may be partial), the seconds allowed per evaluation, and the seconds left
    before the deadline.

    Args:
        monitor: the run's LoaderMonitor, or None.
        planner: the run's BudgetPlanner (a time budget), or None (a fixed epoch count).
    """

    HEADER = f"{'epoch':>5}  {'train loss':>10}  {'test top-1':>10}  {'img/s':>8}  {'data-wait':>9}"
    BUDGET_HEADER = f"  {'planned epochs':>14}  {'eval s':>6}  {'left s':>6}"

    def __init__(
        self, monitor: pl.Callback | None = None, planner: BudgetPlanner | None = None
    ) -> None:
        self.monitor = monitor
        self.planner = planner
        self.rows: list[dict[str, Any]] = []
        self._t0 = self._val_t0 = 0.0
        self._val_s = 0.0
        self._samples = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0, self._val_s, self._samples = time.perf_counter(), 0.0, 0
        if not self.rows and trainer.is_global_zero:
            header = self.HEADER + (self.BUDGET_HEADER if self.planner is not None else "")
            print(header, flush=True)

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
        plan = None if self.planner is None else self.planner.plan
        if plan is not None:  # the plan made at this epoch's end (the planner runs first)
            row["planned_epochs"] = plan.epochs
            row["planned_steps"] = plan.total_steps
            row["eval_s"] = plan.eval_s
            row["time_left_s"] = plan.time_left_s
        self.rows.append(row)
        if trainer.is_global_zero:
            print(_format_row(row), flush=True)


def _item(value: torch.Tensor | None) -> float | None:
    return None if value is None else float(value)


def _format_row(row: dict[str, Any]) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    text = (
        f"{row['epoch']:>5}  {fmt(row['train_loss'], '.3f'):>10}  {fmt(row['test_top1'], '.2%'):>10}  "
        f"{row['img_per_s']:>8,.0f}  {fmt(row['data_wait_frac'], '.1%'):>9}"
    )
    if "planned_epochs" in row:
        text += (
            f"  {row['planned_epochs']:>14.2f}  {row['eval_s']:>6.1f}  {row['time_left_s']:>6.0f}"
        )
    return text
