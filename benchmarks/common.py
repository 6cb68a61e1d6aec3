"""Shared by the benchmark scripts: environment record, timing, tables, JSON results.

Every result file records versions, host and git revision, so a figure can be traced to the code
and machine that produced it. Speed targets are ratios against a baseline measured in the same run
(machines here are noisy; absolute figures are only comparable within one run).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/x.py` from a checkout

__all__ = [
    "REPO",
    "environment",
    "measure_throughput",
    "print_table",
    "results_dir",
    "save_results",
]


def environment() -> dict[str, Any]:
    """Versions, host and git revision for a results file."""
    import psutil
    import torch

    def version(name: str) -> str:
        try:
            from importlib.metadata import version as v

            return v(name)
        except Exception:
            return "-"

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
        )
    except OSError:
        rev, dirty = "-", False
    return {
        "git_revision": rev + ("-dirty" if dirty else ""),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": {
            n: version(n)
            for n in (
                "fastdata",
                "torch",
                "lightning",
                "webdataset",
                "pillow-simd",
                "numpy",
                "nvidia-dali-cuda120",
            )
        },
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def measure_throughput(
    batches: Iterable[Any],
    consume: Callable[[Any], int],
    warmup: int = 2,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Images/s over `batches` after `warmup` untimed batches; `consume` returns the batch's images."""
    it = iter(batches)
    for _ in range(warmup):
        consume(next(it))
    images = count = 0
    start = time.perf_counter()
    for batch in it:
        images += consume(batch)
        count += 1
        if max_batches is not None and count >= max_batches:
            break
    elapsed = time.perf_counter() - start
    return {
        "images": images,
        "batches": count,
        "seconds": round(elapsed, 3),
        "img_per_s": round(images / elapsed, 1),
    }


def print_table(rows: list[dict[str, Any]], columns: list[str], title: str) -> str:
    """Print rows as a markdown table and return it."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = [
        f"### {title}",
        "",
        "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row in rows:
        lines.append(
            "| "
            + " | ".join(_fmt(row.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True))
            + " |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    return text


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def results_dir(path: str | None) -> Path:
    """--out, else $OUT, else benchmarks/results/ (git-ignored)."""
    folder = Path(path or os.environ.get("OUT") or REPO / "benchmarks" / "results")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_results(name: str, out: Path, results: dict[str, Any], tables: list[str]) -> Path:
    """Write `<name>.json` (with the environment) and `<name>.md` (the tables)."""
    path = out / f"{name}.json"
    path.write_text(
        json.dumps({"environment": environment(), **results}, indent=1, default=str) + "\n"
    )
    (out / f"{name}.md").write_text("\n".join(tables))
    print(f"wrote {path} and {name}.md")
    return path
