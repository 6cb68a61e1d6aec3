"""`LoaderMonitor`: how long training waits for data, and a fix for the next epoch when too long.

What is measured, and why it is the data wait
---------------------------------------------
The data wait of a step is the time spent in the training loader's own ``next()``, timed by
wrapping the trainer's profiler (`fastdata.tune.fetch_timer`, which says why that bracket and
not the gap between steps).

The step time is the interval between two `on_train_batch_start`s (fetch + copy + compute +
callbacks); an interval that holds a validation run is dropped. The data-wait fraction is
sum(wait) / sum(step time) over the epoch. On a GPU the step's kernels run asynchronously, so
host-side wait overlaps queued GPU work: the fraction is an upper bound of the GPU time lost to
data (the GPU utilization reading shows the rest).

Following the load
------------------
At each training epoch's end the monitor calls `fastdata.tune.follow.recheck` with the core load
of other processes measured over the epoch's second half (the recent load; the whole epoch when
shorter than 2 x `MIN_HALF_STEPS` steps; `LoadMeter`: every CPU's busy time less this process
tree's own, loader workers included) and the epoch's data wait, and applies what it
returns for the next epoch: torch's intra-op threads (`torch.set_num_threads`, CPU training only),
and workers / prefetch through `trainer.datamodule.resize_workers(n, prefetch)`
(`ShardDataModule` starts the next epoch's loader with them). Every change is logged with its
reason ("epoch 2: intra-op threads 1 -> 2 (1.9 of 2 cores idle, was 0.9)"), and kept in
`summary["action"]`. DataModules without `resize_workers` are only told, in the log, what to
set. Backends that run no worker processes (`fastdata.read.BACKENDS[name].uses_workers` is
False: memory, dali) are never re-sized: more workers cannot shorten their wait.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import psutil
import torch

from fastdata.tune.energy import GpuReader, energy_delta, rapl_wrap_joules, read_rapl_joules
from fastdata.tune.epoch_stats import EpochStats, batch_bytes, batch_len, summary_line, wait_cv
from fastdata.tune.fetch_timer import FETCH_ACTION, FetchTimer
from fastdata.tune.follow import EpochFigures, Recheck, Sizing, Trial, recheck
from fastdata.tune.load import LoadMeter, last_thread_choice

# GpuReader and energy_delta are re-exported: callers import them from here.
__all__ = ["GpuReader", "LoaderMonitor", "energy_delta"]

log = logging.getLogger(__name__)

#: Epochs of at least twice this many steps have their core load read over the second half.
MIN_HALF_STEPS = 10


class LoaderMonitor(pl.Callback):
    """Measures the data wait per step, logs it with GPU and energy figures, re-sizes workers.

    See the module docstring for what is measured and why. Per-step figures go to the trainer's
    loggers every `log_every_n_steps` steps (`loader/data_wait_ms`, `loader/data_wait_frac`,
    `loader/samples_per_s`, `gpu/util`, `gpu/mem_gib`); the epoch's summary is logged with
    `pl_module.log` (under DDP reduced across ranks: the largest wait, the summed samples/s), kept
    in `summary` (this rank's own figures) and written as a log line.

    Args:
        threshold: data-wait fraction of step time above which the loader is the bottleneck.
        log_every_n_steps: steps between per-step logs (default: the trainer's setting).
        resize: re-size the workers for the next epoch when over the threshold.
        max_workers: given the trainer, the most workers this rank may have (default: the free
            cores measured over the epoch, shared among the node's ranks).
        threads: follow the load with torch's intra-op threads on CPU training: True, False,
            or None to follow only after `fastdata.tune.choose_threads("auto", ...)` chose them
            at start-up (a count the user fixed is left alone).
        load_meter: measures other processes' core load over each epoch (tests inject one).
        clock: seconds, monotonic (tests may inject one).
        gpu_reader: opens NVML figures for a device (None to skip them).
        energy_reader: joules from a counter, used when NVML has no energy (default: RAPL).

    Attributes:
        summary: the last training epoch's figures (data_wait_ms, data_wait_frac, step_ms,
            samples_per_s, first_batch_s, gpu_util, gpu_mem_max_gib, energy_j,
            energy_j_per_1k_samples, energy_source, action, and resized_to after a resize).
        history: the summaries of every training epoch so far.
    """

    def __init__(
        self,
        threshold: float = 0.2,
        log_every_n_steps: int | None = None,
        resize: bool = True,
        max_workers: Callable[[pl.Trainer], int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        gpu_reader: Callable[[torch.device], GpuReader | None] | None = GpuReader.open,
        energy_reader: Callable[[], float | None] = read_rapl_joules,
        threads: bool | None = None,
        load_meter: LoadMeter | None = None,
    ) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be a fraction in (0, 1), got {threshold!r}")
        self.threshold = threshold
        self.log_every_n_steps = log_every_n_steps
        self.resize = resize
        self._max_workers = max_workers
        self.threads = threads
        self._meter = load_meter or LoadMeter()
        self._previous_idle: float | None = None  # idle cores at the last decision, for the log
        self._trial: Trial | None = None  # the worker change the next epoch end judges
        self._lost: frozenset[int] = frozenset()  # worker counts that lost a trial
        self._clock = clock
        self._open_gpu = gpu_reader
        self._read_cpu_energy = energy_reader
        self._gpu: GpuReader | None = None
        self._energy: tuple[str, Callable[[], float | None], float | None] | None = None
        self._epoch: EpochStats | None = None
        self._last_start: float | None = None
        self._fetch_start: float | None = None
        self._fetch_s: float | None = None  # the last training fetch's duration
        self._warned_no_fetch = False
        self._last_samples = 0
        self.summary: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []

    # -- set-up --------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        choice = last_thread_choice()
        if choice is not None and self._previous_idle is None:
            self._previous_idle = choice.load.idle_cores  # "was ..." in the first epoch's log
        if not isinstance(trainer.profiler, FetchTimer):
            trainer.profiler = FetchTimer(trainer.profiler)
        trainer.profiler.listen(FETCH_ACTION, self._fetch_began, self._fetch_ended)
        self._gpu = self._open_gpu(pl_module.device) if self._open_gpu else None
        gpu_energy = self._gpu.energy_j() if self._gpu else None
        if self._gpu is not None and gpu_energy is not None:
            self._energy = ("nvml", self._gpu.energy_j, None)
        elif self._read_cpu_energy() is not None:
            self._energy = ("rapl", self._read_cpu_energy, rapl_wrap_joules())
        else:
            self._energy = None

    # -- per step ------------------------------------------------------------------------------

    def _fetch_began(self) -> None:
        self._fetch_start = self._clock()

    def _fetch_ended(self) -> None:
        if self._fetch_start is not None:
            self._fetch_s = self._clock() - self._fetch_start
        self._fetch_start = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = EpochStats(start=self._clock(), energy_start=self._read_energy())
        self._last_start = None
        self._meter.start()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now, ep = self._clock(), self._epoch
        if ep is None:
            return
        steps = trainer.num_training_batches
        if isinstance(steps, int) and steps >= 2 * MIN_HALF_STEPS and batch_idx == steps // 2:
            # The next epoch's settings follow the recent load: read it over the second half.
            self._meter.start()
        wait, self._fetch_s = self._fetch_s, None
        if ep.first_batch_s is None:
            # From the epoch start: includes starting the workers, so kept out of the mean.
            ep.first_batch_s = now - ep.start
        elif self._last_start is not None:
            if wait is None:
                self._no_fetch_timing()
                wait = 0.0
            ep.waits.append(wait)
            ep.steps.append(now - self._last_start)
            ep.step_samples.append(self._last_samples)
            every = self.log_every_n_steps or trainer.log_every_n_steps or 50
            if len(ep.steps) % every == 0:
                self._log_steps(trainer, ep, every)
        made = getattr(trainer.train_dataloader, "last_stages", None)  # the cpu backend's
        if made is not None:
            ep.made.append(made[0] + made[1])
        self._last_start = now
        self._last_samples = batch_len(batch)
        if not ep.batch_bytes:
            ep.batch_bytes = batch_bytes(batch)
        ep.samples += self._last_samples
        ep.batches += 1

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation run sits between two training steps: that interval is not a step.
        self._last_start = None

    def _no_fetch_timing(self) -> None:
        if not self._warned_no_fetch:
            self._warned_no_fetch = True
            log.warning(
                "LoaderMonitor saw no %r profiler action: this Lightning version fetches batches "
                "differently, so the data wait reads 0",
                FETCH_ACTION,
            )

    def _log_steps(self, trainer: pl.Trainer, ep: EpochStats, n: int) -> None:
        waits, steps = ep.waits[-n:], ep.steps[-n:]
        metrics = {
            "loader/data_wait_ms": 1e3 * statistics.fmean(waits),
            "loader/data_wait_frac": sum(waits) / max(sum(steps), 1e-12),
            "loader/samples_per_s": sum(ep.step_samples[-n:]) / max(sum(steps), 1e-12),
        }
        if self._gpu is not None:
            util, mem = self._gpu.utilization(), self._gpu.memory_used()
            ep.gpu_util.append(util)
            ep.gpu_mem_max = max(ep.gpu_mem_max, mem)
            metrics.update({"gpu/util": util, "gpu/mem_gib": mem / 2**30})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # -- per epoch -----------------------------------------------------------------------------

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ep = self._epoch
        if ep is None or not ep.steps:
            return
        self.summary = self._summarize(trainer, ep)
        self.history.append(self.summary)
        # Under DDP the logged epoch figures are the slowest rank's wait (it holds every rank at
        # the gradient sync) and the ranks' summed throughput; `summary` keeps this rank's own.
        for key, reduce in (
            ("data_wait_ms", "max"),
            ("data_wait_frac", "max"),
            ("samples_per_s", "sum"),
        ):
            value = float(self.summary[key])
            pl_module.log(
                f"loader/{key}",
                value,
                on_step=False,
                on_epoch=True,
                sync_dist=True,
                reduce_fx=reduce,
            )
        if trainer.is_global_zero:
            log.info("%s", summary_line(self.summary))
        self.summary["action"] = self._follow(trainer, pl_module, ep)

    def _summarize(self, trainer: pl.Trainer, ep: EpochStats) -> dict[str, Any]:
        wait, step = sum(ep.waits), sum(ep.steps)
        summary: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "steps": ep.batches,
            "samples": ep.samples,
            "first_batch_s": ep.first_batch_s,
            "data_wait_ms": 1e3 * wait / len(ep.waits),
            "data_wait_frac": wait / max(step, 1e-12),
            "step_ms": 1e3 * step / len(ep.steps),
            "samples_per_s": sum(ep.step_samples) / max(step, 1e-12),
            "gpu_util": statistics.fmean(ep.gpu_util) if ep.gpu_util else None,
            "gpu_mem_max_gib": ep.gpu_mem_max / 2**30 if ep.gpu_util else None,
            "energy_source": self._energy[0] if self._energy else None,
            "energy_j": None,
            "energy_j_per_1k_samples": None,
            "action": None,
        }
        end = self._read_energy()
        if ep.energy_start is not None and end is not None and self._energy is not None:
            joules = energy_delta(ep.energy_start, end, self._energy[2])
            summary["energy_j"] = joules
            summary["energy_j_per_1k_samples"] = 1e3 * joules / max(ep.samples, 1)
        return summary

    def _follow(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, ep: EpochStats
    ) -> str | None:
        """Re-check threads, workers and prefetch for the next epoch; apply and log changes."""
        load = self._meter.read()
        if load is None:
            return None
        workers, prefetch = _current_workers(trainer)
        threads = torch.get_num_threads() if self._follows_threads(pl_module) else None
        figures = EpochFigures(
            epoch=trainer.current_epoch,
            load=load,
            data_wait_frac=self.summary["data_wait_frac"],
            wait_s=statistics.fmean(ep.waits),
            compute_s=(sum(ep.steps) - sum(ep.waits)) / len(ep.steps),
            wait_cv=wait_cv(ep.waits),
            batch_bytes=ep.batch_bytes,
            available_bytes=psutil.virtual_memory().available,
            previous_idle=self._previous_idle,
            batch_cost_s=statistics.fmean(ep.made) if ep.made else None,
            samples_per_s=self.summary["samples_per_s"],
            trial=self._trial,
            lost=self._lost,
        )
        limit = self._max_workers(trainer) if self._max_workers is not None else None
        result = recheck(
            Sizing(threads, workers, prefetch),
            figures,
            self.threshold,
            ranks_per_node=max(1, trainer.num_devices),
            max_workers=limit,
        )
        self._previous_idle = load.idle_cores
        lines = self._apply(trainer, Sizing(threads, workers, prefetch), result)
        # A worker change is judged by the next epoch only when it was made.
        applied = self.summary.get("resized_to") == result.sizing.num_workers
        self._trial, self._lost = (result.trial if applied else None), result.lost
        for line in lines:
            log.warning("%s", line)
        return "; ".join(lines) or None

    def _follows_threads(self, pl_module: pl.LightningModule) -> bool:
        if pl_module.device.type != "cpu":
            return False
        return self.threads if self.threads is not None else last_thread_choice() is not None

    def _apply(self, trainer: pl.Trainer, before: Sizing, result: Recheck) -> list[str]:
        """Set what `recheck` changed; the lines to log (a worker change not made says why)."""
        after = result.sizing
        lines = list(result.notes)
        if after.threads is not None and after.threads != before.threads:
            torch.set_num_threads(after.threads)
        thread_lines = [c for c in result.changes if "intra-op threads" in c]
        loader_lines = [c for c in result.changes if c not in thread_lines]
        lines = thread_lines + lines
        if not loader_lines:
            return lines
        change = "; ".join(loader_lines)
        dm = trainer.datamodule
        backend = _backend_without_workers(dm)
        if backend is not None:
            return [
                *lines,
                f"{change}: the {backend!r} backend runs no worker processes: not re-sized",
            ]
        if not self.resize:
            return [
                *lines,
                f"{change}: {after.num_workers} workers would keep up better (now "
                f"{before.num_workers}); resizing is off",
            ]
        if dm is None or not hasattr(dm, "resize_workers"):
            return [
                *lines,
                f"{change}: set num_workers={after.num_workers}; this DataModule cannot resize",
            ]
        prefetch = (
            after.prefetch_factor if after.prefetch_factor != before.prefetch_factor else None
        )
        if prefetch is None:
            dm.resize_workers(after.num_workers)
        else:
            dm.resize_workers(after.num_workers, prefetch)
        self.summary["resized_to"] = after.num_workers
        return [*lines, f"{change}, from the next epoch"]

    def _read_energy(self) -> float | None:
        return self._energy[1]() if self._energy else None


def _backend_without_workers(datamodule: Any) -> str | None:
    """The DataModule's read backend when it is one that runs no worker processes, else None."""
    name = getattr(datamodule, "backend_name", None) or getattr(datamodule, "backend", None)
    if not isinstance(name, str):
        return None
    from fastdata.read import BACKENDS  # the registry says which backends use workers

    backend = BACKENDS.get(name)
    return name if backend is not None and not backend.uses_workers else None


def _current_workers(trainer: pl.Trainer) -> tuple[int, int]:
    """The loader's (workers, prefetch): the DataModule's when ints (not "auto"), else the train
    loader's spec (ShardDataModule's loaders) or its own figures (a DataLoader)."""
    loader = trainer.train_dataloader
    spec_workers = getattr(getattr(loader, "spec", None), "workers", None)
    owners = (trainer.datamodule, spec_workers, loader)
    found = []
    for name, default in (("num_workers", 0), ("prefetch_factor", 2)):
        values = (getattr(owner, name, None) for owner in owners)
        found.append(next((v for v in values if isinstance(v, int)), default))
    return found[0], found[1]
