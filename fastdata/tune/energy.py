"""Energy and GPU readings for `LoaderMonitor`: NVML (utilization, memory, energy) and RAPL.

Both are optional: without `pynvml`, a driver or a readable RAPL counter the monitor runs
without these figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["RAPL_DIR", "GpuReader", "energy_delta", "rapl_wrap_joules", "read_rapl_joules"]

RAPL_DIR = Path("/sys/class/powercap/intel-rapl:0")


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


def rapl_wrap_joules(folder: Path = RAPL_DIR) -> float | None:
    """Joules after which the RAPL counter wraps to 0, or None when unreadable."""
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
        """GPU utilization in percent over the driver's last sample period."""
        return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def memory_used(self) -> int:
        """Bytes of device memory in use (all processes)."""
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def energy_j(self) -> float | None:
        """Energy since the driver loaded (Volta and newer), else None."""
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3
        except Exception:
            return None
