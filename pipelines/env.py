"""Where the real data for the pipelines, tests and benchmarks lives (FASTDATA_DATA_DIR, default
../shared/data): the applications' helper, outside the library (`fastdata` never imports it)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "cpu_description", "data_dir"]

DATA_DIR_ENV = "FASTDATA_DATA_DIR"


def data_dir() -> Path:
    """The real-data folder: $FASTDATA_DATA_DIR, else `../shared/data` beside the project root."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data"


#: CPU features that change which kernels torch, Pillow-SIMD and libjpeg-turbo run (a ratio
#: measured on one CPU can fail on another: a benchmark's record says which it ran on).
CPU_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve",
)  # fmt: skip


def cpu_description(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> dict[str, object]:
    """The CPU's model name and its vector / matrix features, for a benchmark's results.

    Args:
        cpuinfo: the file to read (Linux's /proc/cpuinfo); elsewhere, or if it is unreadable,
            the model is `platform.processor()` and the flags are unknown (None).

    Returns:
        {"model": str, "machine": str, "flags": sorted list of the `CPU_FLAGS` present, or None}.
    """
    model, flags = "", None
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if not model and key in ("model name", "hardware", "cpu model", "processor") and value:
            if not value.isdigit():  # ARM's "processor : 0" is an index, not a name
                model = value
        elif flags is None and key in ("flags", "features"):
            present = set(value.split())
            flags = sorted(f for f in CPU_FLAGS if f in present)
    return {
        "model": model or platform.processor() or "unknown",
        "machine": platform.machine(),
        "flags": flags,
    }
