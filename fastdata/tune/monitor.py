"""`LoaderMonitor`: how long training waits for data, and a fix for the next epoch when too long.

What is measured, and why it is the data wait
---------------------------------------------
Lightning's training loop (`_TrainingEpochLoop.advance`, Lightning 2.6) does, per step::

    batch = next(data_fetcher)            # -> next(loader iterator), bracketed by
                                          #    trainer.profiler.start/stop("[_TrainingEpochLoop]
                                          #    .train_dataloader_next")
    batch -> device, on_after_batch_transfer
    on_train_batch_start                  # <- the monitor stamps the step
    training_step, backward, optimizer step
    on_train_batch_end                    # other callbacks: checkpoint saves, logging syncs

The data wait of a step is the time spent in the loader's own ``next()``: the monitor wraps the
trainer's profiler (`_FetchTimer`, which passes every call on to the profiler it wraps) and times
the "train_dataloader_next" action, which brackets exactly that call. An earlier version took the
gap between `on_train_batch_end` and the next `on_train_batch_start`; that gap also holds the
callbacks that run after the monitor's `on_train_batch_end` (Lightning runs `ModelCheckpoint`
last), logging syncs and the host-to-device copy, so on millisecond GPU steps it exceeded the
threshold with an instant loader. When the loader keeps up, `next()` returns an already
prefetched batch at once. Our loaders have a length, and with a length Lightning's
`_PrefetchDataFetcher` does not read ahead, so the batch fetched is the one the step uses;
without a length it reads one batch ahead, which leaves the mean over an epoch unchanged.

The step time is the interval between two `on_train_batch_start`s (fetch + copy + compute +
callbacks); an interval that holds a validation run is dropped. The data-wait fraction is
sum(wait) / sum(step time) over the epoch. On a GPU the step's kernels run asynchronously, so
host-side wait overlaps queued GPU work: the fraction is an upper bound of the GPU time lost to
data (the GPU utilization reading shows the rest).

Re-sizing
---------
At the end of an epoch whose data-wait fraction is above `threshold`, the monitor works out how
many workers would have kept up (`suggest_num_workers`), caps that by the free cores it measures
then, and calls `trainer.datamodule.resize_workers(n)`. `ShardDataModule.resize_workers(n)` stores
the new count; the loader of the next epoch starts `n` workers (persistent workers of the old size
are shut down). DataModules without `resize_workers` are only told, in the log, what to set.
Backends that run no worker processes (`fastdata.read.BACKENDS[name].uses_workers` is False:
memory, dali) are never re-sized: more workers cannot shorten their wait.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import Profiler

from fastdata.tune.probe import probe_system
from fastdata.tune.sizing import free_cores

__all__ = ["GpuReader", "LoaderMonitor", "energy_delta", "read_rapl_joules", "suggest_num_workers"]

#: The profiler action that brackets the training loader's ``next()`` (Lightning 2.x).
FETCH_ACTION = "train_dataloader_next"

log = logging.getLogger(__name__)

RAPL_DIR = Path("/sys/class/powercap/intel-rapl:0")


def suggest_num_workers(current: int, wait_s: float, compute_s: float, max_workers: int) -> int:
    """Workers that would have hidden the measured wait, capped by `max_workers`.

    With `current` workers the loader delivered one batch per (compute + wait), so one worker
    makes a batch in current * (compute + wait) seconds (with 0 workers the main process made it
    in `wait`). Hiding the wait needs ceil(batch time / compute) workers; at least one more than
    now, never more than `max_workers`, never fewer than `current`.
    """
    compute = max(compute_s, 1e-6)
    batch_time = wait_s if current == 0 else current * (compute + wait_s)
    needed = max(math.ceil(batch_time / compute), current + 1)
    return max(current, min(needed, max_workers))


def energy_delta(start: float, end: float, wrap: float | None) -> float:
    """Energy between two readings of a counter that wraps to 0 after `wrap` (RAPL does)."""
    if end >= start or wrap is None:
        return end - start
    return end + wrap - start


def read_rapl_joules(folder: Path = RAPL_DIR) -> float | None:
    """The CPU package's RAPL energy counter in joules, or None when unreadable (often root-only).

    RAPL measures the whole socket, other processes included."""
    try:
        return int((folder / "energy_uj").read_text()) / 1e6
    except (OSError, ValueError):
        return None


def _rapl_wrap(folder: Path = RAPL_DIR) -> float | None:
    try:
        return int((folder / "max_energy_range_uj").read_text()) / 1e6
    except (OSError, ValueError):
        return None


class GpuReader:
    """NVML readings of one CUDA device (utilization %, memory used, total energy).

    Args:
        handle: the `pynvml` device handle.
        nvml: the `pynvml` module.
    """

    def __init__(self, handle: Any, nvml: Any) -> None:
        self._handle, self._nvml = handle, nvml

    @classmethod
    def open(cls, device: torch.device) -> GpuReader | None:
        """A reader for `device`, or None (not CUDA, no `pynvml`, or NVML fails)."""
        if device.type != "cuda":
            return None
        try:
            import pynvml  # optional: nvidia-ml-py

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            try:  # NVML numbers GPUs physically; map through CUDA_VISIBLE_DEVICES
                index = torch.cuda._get_nvml_device_index(index)
            except Exception:  # private helper: fall back to the CUDA index
                pass
            return cls(pynvml.nvmlDeviceGetHandleByIndex(index), pynvml)
        except Exception:  # no pynvml or no driver: the monitor runs without GPU figures
            return None

    def utilization(self) -> float:
        return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def memory_used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def energy_j(self) -> float | None:
        """Energy since the driver loaded (Volta and newer), else None."""
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3
        except Exception:
            return None


@dataclass
class _Epoch:
    """Running figures of the current epoch."""

    start: float
    waits: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)
    batches: int = 0
    samples: int = 0
    first_batch_s: float | None = None
    gpu_util: list[float] = field(default_factory=list)
    gpu_mem_max: int = 0
    energy_start: float | None = None


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
            cores measured over 0.1 s, shared among the node's ranks).
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
    ) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be a fraction in (0, 1), got {threshold!r}")
        self.threshold = threshold
        self.log_every_n_steps = log_every_n_steps
        self.resize = resize
        self._max_workers = max_workers or _measured_max_workers
        self._clock = clock
        self._open_gpu = gpu_reader
        self._read_cpu_energy = energy_reader
        self._gpu: GpuReader | None = None
        self._energy: tuple[str, Callable[[], float | None], float | None] | None = None
        self._epoch: _Epoch | None = None
        self._last_start: float | None = None
        self._fetch_start: float | None = None
        self._fetch_s: float | None = None  # the last training fetch's duration
        self._warned_no_fetch = False
        self._last_samples = 0
        self.summary: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []

    # -- set-up --------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.profiler, _FetchTimer):
            trainer.profiler = _FetchTimer(trainer.profiler, self._fetch_began, self._fetch_ended)
        self._gpu = self._open_gpu(pl_module.device) if self._open_gpu else None
        gpu_energy = self._gpu.energy_j() if self._gpu else None
        if self._gpu is not None and gpu_energy is not None:
            self._energy = ("nvml", self._gpu.energy_j, None)
        elif self._read_cpu_energy() is not None:
            self._energy = ("rapl", self._read_cpu_energy, _rapl_wrap())
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
        self._epoch = _Epoch(start=self._clock(), energy_start=self._read_energy())
        self._last_start = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now, ep = self._clock(), self._epoch
        if ep is None:
            return
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
        self._last_start = now
        self._last_samples = _batch_len(batch)
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

    def _log_steps(self, trainer: pl.Trainer, ep: _Epoch, n: int) -> None:
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
            log.info("%s", _summary_line(self.summary))
        if self.summary["data_wait_frac"] > self.threshold:
            self.summary["action"] = self._respond(trainer, ep)
            log.warning("%s", self.summary["action"])

    def _summarize(self, trainer: pl.Trainer, ep: _Epoch) -> dict[str, Any]:
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

    def _respond(self, trainer: pl.Trainer, ep: _Epoch) -> str:
        frac = self.summary["data_wait_frac"]
        head = f"data wait is {frac:.0%} of step time (threshold {self.threshold:.0%})"
        current = _current_workers(trainer)
        compute = (sum(ep.steps) - sum(ep.waits)) / len(ep.steps)
        wait = sum(ep.waits) / len(ep.waits)
        target = suggest_num_workers(current, wait, compute, self._max_workers(trainer))
        if target <= current:
            return f"{head}, but no free core is left for another worker ({current} now)"
        dm = trainer.datamodule
        backend = _backend_without_workers(dm)
        if backend is not None:
            return f"{head}; the {backend!r} backend runs no worker processes: not re-sized"
        if not self.resize:
            return f"{head}: {target} workers would keep up better (now {current}); resizing is off"
        if dm is None or not hasattr(dm, "resize_workers"):
            return (
                f"{head}: set num_workers={target} (now {current}); this DataModule cannot resize"
            )
        dm.resize_workers(target)
        self.summary["resized_to"] = target
        return f"{head}: workers {current} -> {target} from the next epoch"

    def _read_energy(self) -> float | None:
        return self._energy[1]() if self._energy else None


class _FetchTimer(Profiler):
    """The trainer's profiler, passed through, that also reports the training loader's fetches.

    Lightning brackets the training loader's ``next()`` with ``profiler.start/stop`` of an action
    ending in `FETCH_ACTION`; the callbacks run right inside that bracket.

    Args:
        inner: the trainer's own profiler (every call goes on to it).
        began: called when a training fetch starts.
        ended: called when it ends.
    """

    def __init__(
        self, inner: Profiler, began: Callable[[], None], ended: Callable[[], None]
    ) -> None:
        super().__init__()
        self.inner, self._began, self._ended = inner, began, ended

    def start(self, action_name: str) -> None:
        if action_name.endswith(FETCH_ACTION):
            self._began()
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        if action_name.endswith(FETCH_ACTION):
            self._ended()

    def summary(self) -> str:
        return self.inner.summary()

    def describe(self) -> None:
        self.inner.describe()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank, log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    @property
    def _lightning_module(self) -> Any:  # the Trainer sets it on its profiler at every run
        return getattr(self.inner, "_lightning_module", None)

    @_lightning_module.setter
    def _lightning_module(self, module: Any) -> None:
        self.inner._lightning_module = module


def _backend_without_workers(datamodule: Any) -> str | None:
    """The DataModule's read backend when it is one that runs no worker processes, else None."""
    name = getattr(datamodule, "_backend_name", None) or getattr(datamodule, "backend", None)
    if not isinstance(name, str):
        return None
    from fastdata.read import BACKENDS  # the registry says which backends use workers

    backend = BACKENDS.get(name)
    return name if backend is not None and not backend.uses_workers else None


def _measured_max_workers(trainer: pl.Trainer) -> int:
    probe = probe_system(window_s=0.1)
    ranks = max(1, trainer.num_devices)  # Lightning's devices per node = ranks on this node
    return min(probe.usable_cores, math.floor(free_cores(probe, ranks)))


def _current_workers(trainer: pl.Trainer) -> int:
    """The loader's worker count: the DataModule's `num_workers` when an int (not "auto"), else
    the train loader's spec (ShardDataModule's loaders) or its own `num_workers` (a DataLoader)."""
    loader = trainer.train_dataloader
    for owner in (trainer.datamodule, getattr(loader, "spec", None), loader):
        value = getattr(owner, "num_workers", None)
        if isinstance(value, int):
            return value
    return 0


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, tuple | list) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1


def _summary_line(s: dict[str, Any]) -> str:
    parts = [
        f"epoch {s['epoch']}: {s['samples_per_s']:.0f} samples/s",
        f"data wait {s['data_wait_ms']:.1f} ms/step = {s['data_wait_frac']:.0%} of {s['step_ms']:.1f} ms",
        f"first batch {s['first_batch_s']:.2f} s",
    ]
    if s["gpu_util"] is not None:
        parts.append(f"GPU {s['gpu_util']:.0f}% util, {s['gpu_mem_max_gib']:.1f} GiB max")
    if s["energy_j_per_1k_samples"] is not None:
        parts.append(f"{s['energy_j_per_1k_samples']:.1f} J/1k samples ({s['energy_source']})")
    return "; ".join(parts)
