"""`StageTimer`: each training step's data wait, read, decode, augment and transfer times, in the
trainer's loggers, and at each epoch end one line on what bounds the step and what to change.

Where each time comes from (no extra synchronization; CUDA events only on a GPU):

- **wait**: the training loader's ``next()``, bracketed by the trainer's profiler action
  ``train_dataloader_next`` (`fastdata.tune.fetch_timer`, shared with `LoaderMonitor`).
- **read**, **decode**: where the batch was made. The cpu backend's maker (a loader worker, or
  the training process with 0 workers) times reading the rows' bytes and decoding + collating
  them, and leaves both in a shared-memory ring (`fastdata.read.transport.stage_times`) that the
  training process reads when the batch arrives (`CpuLoader.last_stages`). Other backends say
  nothing: their loading time is the wait.
- **transfer**: the ``transfer_batch_to_device`` hook, **augment**: the DataModule's
  ``on_after_batch_transfer`` (where `ShardDataModule` runs its device augmentation), both
  bracketed by Lightning's profiler actions. On the CPU a clock around the call; on a GPU a pair
  of CUDA events recorded on the current stream, read once the end event has completed (a step
  or two later), so the asynchronous copy and kernels are timed as the GPU ran them.

Per-step figures (means over `log_every_n_steps` steps) go to every logger of the trainer as
``stages/{wait,read,decode,transfer,augment,step}_ms``; the epoch's means are logged with
`pl_module.log` (``stages/epoch_*_ms``), and `fastdata.tune.stage_report.bound` turns them into the
epoch-end line (kept in `lines`, `bounds`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from fastdata.tune.fetch_timer import FETCH_ACTION, FetchTimer
from fastdata.tune.monitor import _current_workers
from fastdata.tune.stage_report import Bound, StageFigures, bound

__all__ = ["StageTimer"]

#: The profiler actions (name endings) of the stages the training process runs.
HOOKS = {
    "wait": FETCH_ACTION,
    "transfer": ".transfer_batch_to_device",
    "augment": ".on_after_batch_transfer",
}
_KEYS = ("wait", "read", "decode", "transfer", "augment", "step")


class _Sums:
    """Running sums of the stage seconds over some steps (read/decode counted apart: a backend
    may not report them)."""

    def __init__(self) -> None:
        self.s = dict.fromkeys(_KEYS, 0.0)
        self.steps = 0
        self.made = 0  # steps whose batch came with read/decode times

    def mean_ms(self, key: str) -> float | None:
        n = self.made if key in ("read", "decode") else self.steps
        return 1e3 * self.s[key] / n if n else None


class StageTimer(pl.Callback):
    """Logs the stage times of each training step and says what bounds the step at epoch end.

    See the module docstring for what is timed and how.

    Args:
        threshold: data-time share of the step above which the step is input-bound.
        log_every_n_steps: steps averaged per logged point (default: the trainer's setting).
        clock: seconds, monotonic (tests may inject one).
        cuda_events: time transfer and augment with CUDA events (None: when the module is on
            a CUDA device).

    Attributes:
        lines: the epoch-end lines so far.
        bounds: the epoch-end `Bound`s so far.
    """

    def __init__(
        self,
        threshold: float = 0.2,
        log_every_n_steps: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        cuda_events: bool | None = None,
    ) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be a fraction in (0, 1), got {threshold!r}")
        self.threshold, self.log_every_n_steps = threshold, log_every_n_steps
        self._clock, self._cuda_events = clock, cuda_events
        self._events = False
        self._open: dict[str, Any] = {}  # stage -> its start (clock value or CUDA event)
        self._now = dict.fromkeys(HOOKS, 0.0)  # this step's stage seconds so far
        self._pending: list[tuple[str, Any, Any]] = []  # CUDA event pairs not yet complete
        self._in_epoch = self._in_validation = False
        self._last_start: float | None = None
        self._epoch, self._window = _Sums(), _Sums()
        self.lines: list[str] = []
        self.bounds: list[Bound] = []

    # -- set-up and the stage brackets ---------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.profiler, FetchTimer):
            trainer.profiler = FetchTimer(trainer.profiler)
        for name, suffix in HOOKS.items():
            trainer.profiler.listen(suffix, self._starter(name), self._stopper(name))
        on_cuda = pl_module.device.type == "cuda"
        self._events = on_cuda if self._cuda_events is None else self._cuda_events

    def _starter(self, stage: str) -> Callable[[], None]:
        return _Bracket(self, stage, True)

    def _stopper(self, stage: str) -> Callable[[], None]:
        return _Bracket(self, stage, False)

    def _began(self, stage: str) -> None:
        if not self._in_epoch or self._in_validation:
            return
        if self._events and stage != "wait":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[stage] = event
        else:
            self._open[stage] = self._clock()

    def _ended(self, stage: str) -> None:
        start = self._open.pop(stage, None)
        if start is None:
            return
        if not self._events or stage == "wait":  # a clock value
            self._now[stage] += self._clock() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((stage, start, end))

    def _resolve_events(self) -> None:
        """Add the CUDA-timed stages whose end event has completed (no wait for the others)."""
        left = []
        for stage, start, end in self._pending:
            if end.query():
                self._now[stage] += start.elapsed_time(end) / 1e3
            else:
                left.append((stage, start, end))
        self._pending = left

    # -- per step ------------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_epoch, self._in_validation, self._last_start = True, False, None
        self._epoch, self._window = _Sums(), _Sums()
        self._now = dict.fromkeys(HOOKS, 0.0)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation batches are not training steps; the interval that holds them is not one.
        self._in_validation, self._last_start = True, None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_validation = False  # a check inside the epoch (val_check_interval) is over

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = self._clock()
        if self._pending:
            self._resolve_events()
        made = getattr(trainer.train_dataloader, "last_stages", None)
        times, self._now = self._now, dict.fromkeys(HOOKS, 0.0)
        last, self._last_start = self._last_start, now
        if last is None:  # the epoch's first batch (workers starting) or one after validation
            return
        times["step"] = now - last
        for sums in (self._epoch, self._window):
            for key, value in times.items():
                sums.s[key] += value
            sums.steps += 1
            if made is not None:
                sums.s["read"] += made[0]
                sums.s["decode"] += made[1]
                sums.made += 1
        every = self.log_every_n_steps or trainer.log_every_n_steps or 50
        if self._window.steps >= every:
            self._log_window(trainer)

    def _log_window(self, trainer: pl.Trainer) -> None:
        window, self._window = self._window, _Sums()
        metrics = {f"stages/{k}_ms": window.mean_ms(k) for k in _KEYS}
        metrics = {k: v for k, v in metrics.items() if v is not None}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # -- per epoch -----------------------------------------------------------------------------

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_epoch = False
        ep = self._epoch
        if not ep.steps:
            return
        for key in _KEYS:
            value = ep.mean_ms(key)
            # Every key on every rank (NaN where a rank did not time a stage): under DDP the
            # ranks reduce their logged keys together, and a key one rank lacks would hang them.
            if value is not None or trainer.world_size > 1:
                pl_module.log(
                    f"stages/epoch_{key}_ms",
                    float("nan") if value is None else value,
                    on_step=False,
                    on_epoch=True,
                    sync_dist=True,
                    reduce_fx="max" if key in ("wait", "step") else "mean",
                )
        result = bound(self._figures(trainer, pl_module, ep), self.threshold)
        self.bounds.append(result)
        self.lines.append(result.line)
        if trainer.is_global_zero:
            rank_zero_info(result.line)

    def _figures(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, ep: _Sums
    ) -> StageFigures:
        def mean_s(key: str) -> float | None:
            ms = ep.mean_ms(key)
            return None if ms is None else ms / 1e3

        workers, _ = _current_workers(trainer)
        return StageFigures(
            epoch=trainer.current_epoch,
            step_s=mean_s("step") or 0.0,
            wait_s=mean_s("wait") or 0.0,
            transfer_s=mean_s("transfer") or 0.0,
            augment_s=mean_s("augment") or 0.0,
            read_s=mean_s("read"),
            decode_s=mean_s("decode"),
            workers=workers,
            usable_cores=len(os.sched_getaffinity(0)),
            on_gpu=pl_module.device.type == "cuda",
        )


class _Bracket:
    """A stage's start or stop callback; equal for the same timer, stage and side, so that a
    second `setup` (fit, then validate) adds no second listener (`FetchTimer.listen`)."""

    __slots__ = ("began", "stage", "timer")

    def __init__(self, timer: StageTimer, stage: str, began: bool) -> None:
        self.timer, self.stage, self.began = timer, stage, began

    def __call__(self) -> None:
        if self.began:
            self.timer._began(self.stage)
        else:
            self.timer._ended(self.stage)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Bracket) and (other.timer, other.stage, other.began) == (
            self.timer,
            self.stage,
            self.began,
        )

    def __hash__(self) -> int:
        return hash((id(self.timer), self.stage, self.began))
