"""Running figures of a training epoch for `LoaderMonitor`, and how they are summarized."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["EpochStats", "batch_bytes", "batch_len", "summary_line", "wait_cv"]


@dataclass
class EpochStats:
    """Running figures of the current training epoch (`LoaderMonitor` fills them in)."""

    start: float
    waits: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)
    batch_bytes: int = 0
    batches: int = 0
    samples: int = 0
    first_batch_s: float | None = None
    gpu_util: list[float] = field(default_factory=list)
    gpu_mem_max: int = 0
    energy_start: float | None = None
    made: list[float] = field(default_factory=list)  # each batch's read + decode s, when known


def batch_bytes(batch: Any) -> int:
    """Bytes of the tensors of a batch (0 for anything else)."""
    parts = batch if isinstance(batch, tuple | list) else [batch]
    return sum(t.element_size() * t.numel() for t in parts if isinstance(t, torch.Tensor))


def wait_cv(values: list[float]) -> float:
    """Coefficient of variation (stdev / mean) of `values`; 0 for fewer than 2 or a zero mean."""
    mean = statistics.fmean(values) if values else 0.0
    return statistics.pstdev(values) / mean if len(values) > 1 and mean > 0 else 0.0


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first tensor's first dimension (1 for anything else)."""
    first = batch[0] if isinstance(batch, tuple | list) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1


def summary_line(s: dict[str, Any]) -> str:
    """An epoch's `LoaderMonitor.summary` on one log line."""
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
