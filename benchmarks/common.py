"""Shared by the benchmark scripts: environment record, timing, tables, JSON results.

Every result file records versions, host and git revision, so a figure can be traced to the code
and machine that produced it. Speed targets are ratios against a baseline measured in the same run
(machines here are noisy; absolute figures are only comparable within one run).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/x.py` from a checkout


def _pipelines_importable() -> None:
    """Make `fastdata_pipelines` importable from a checkout that was never `pip install`-ed.

    `pip install -e .` maps the repository's pipelines/ folder to that name (pyproject); on a bare
    machine (the GPU machine runs a copied tree) a link in a per-user temporary folder does the
    same, on `sys.path` and on PYTHONPATH for the trainer subprocesses.
    """
    import importlib.util
    import tempfile

    if importlib.util.find_spec("fastdata_pipelines") is not None:
        return
    shim = Path(tempfile.gettempdir()) / f"fastdata-pipelines-{os.getuid()}"
    shim.mkdir(exist_ok=True)
    link = shim / "fastdata_pipelines"
    if not link.exists():
        link.symlink_to(REPO / "pipelines", target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(shim), str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )


_pipelines_importable()

__all__ = [
    "REPO",
    "environment",
    "measure_throughput",
    "print_table",
    "results_dir",
    "save_results",
]


#: Distributions whose versions every results file records ("-" when not installed).
VERSIONED = (
    "fastdata",
    "torch",
    "lightning",
    "numpy",
    "psutil",
    "webdataset",
    "pillow",
    "pillow-simd",
    "av",
    "torchcodec",
    "nvidia-dali-cuda120",
    "nvidia-dali-cuda130",
)


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions, host, cores, memory and git revision for a results file; `extra` merged in.

    The one environment record of every benchmark. It creates no CUDA context (the GPU's name
    comes from NVML or nvidia-smi until CUDA is initialized): a benchmark may still fork workers
    after calling it.
    """
    import psutil
    from fastdata_pipelines.env import cpu_description

    return {
        "git_revision": _git_revision(),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_description(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "gpu": _gpu_name(),
        "jpeg_region_decoder": _region_decoder(),
        # Which PIL ran (Pillow or Pillow-SIMD, its libjpeg-turbo, any clash of the two): the
        # per-sample baselines, PNG decoding and sharding run on it.
        "pil": _pil_record(),
        "versions": {name: _version(name) for name in VERSIONED},
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }


def _region_decoder() -> str | None:
    """The CPU JPEG region decoder of this process (fastdata's extension, or none)."""
    from fastdata.read.decoders.image import jpeg_region_decoder
    from fastdata.read.decoders.jpeg_region import DecoderChoiceError

    try:
        return jpeg_region_decoder()
    except DecoderChoiceError as exc:  # a bad $FASTDATA_REGION_DECODER: recorded, the results kept
        return f"error: {exc}"


def _pil_record() -> dict[str, Any]:
    """`fastdata.pil_info()` as JSON: distribution, version, libjpeg-turbo, location, problem."""
    from fastdata import pil_info

    return pil_info().as_dict()


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def _git_revision() -> str:
    """Short revision, "-dirty" when the work tree has changes; "-" outside a checkout."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "-"
    return (rev or "-") + ("-dirty" if rev and dirty else "")


def _gpu_name() -> str | None:
    """The first GPU's name without creating a CUDA context, or None without a GPU."""
    import torch

    if torch.cuda.is_initialized():
        return torch.cuda.get_device_name(0)
    try:
        import pynvml  # optional: nvidia-ml-py

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no pynvml or no driver: ask nvidia-smi
        pass
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = done.stdout.strip().splitlines()
    return names[0].strip() if done.returncode == 0 and names else None


def measure_throughput(
    batches: Iterable[Any],
    consume: Callable[[Any], int],
    warmup: int = 2,
    max_batches: int | None = None,
) -> dict[str, float]:
    """`fastdata.tune.measure_throughput` as a results row (images, batches, seconds, img_per_s).

    Kept for bench_loader.py's calls; the timing itself is fastdata's (one timer for the project).
    """
    from fastdata.tune import measure_throughput as measure

    result = measure(batches, max_batches, warmup=warmup, count=consume)
    return {
        "images": result.samples,
        "batches": result.batches,
        "seconds": round(result.seconds, 3),
        "img_per_s": round(result.samples_per_s, 1),
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


def round_robin(runs: dict[str, Any], baseline: str, rounds: int = 1) -> list[dict[str, Any]]:
    """Run every method `rounds` times, round-robin; a row per method with its median img/s.

    Round-robin, so that a slow spell of the machine falls on every method, not on one; each
    row keeps its rounds' img/s (`rounds_img_per_s`) and each round's ratio to the baseline.
    """
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            if name in errors:
                continue
            try:
                result = run()
            except Exception as exc:  # a failing method is reported, not fatal to the others
                errors[name] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            results[name].append(result)
            gc.collect()  # the finished loader's workers go now, not inside the next one's
            print(f"  {name}: {result['img_per_s']:,.0f} img/s")
    rows = []
    for name, found in results.items():
        if name in errors or not found:
            rows.append({"method": name, "error": errors.get(name, "no result")})
            continue
        rates = [r["img_per_s"] for r in found]
        rows.append(
            {
                "method": name,
                "img_per_s": round(statistics.median(rates), 1),
                "images": sum(r["images"] for r in found),
                "seconds": round(sum(r["seconds"] for r in found), 2),
                "rounds_img_per_s": rates,
            }
        )
    base = next((r for r in rows if r["method"] == baseline and "img_per_s" in r), None)
    for row in rows:
        if base and "img_per_s" in row:
            row["vs_baseline"] = round(row["img_per_s"] / base["img_per_s"], 2)
            pairs = zip(row["rounds_img_per_s"], base["rounds_img_per_s"], strict=False)
            row["rounds_vs_baseline"] = [round(a / b, 2) for a, b in pairs]
            if rounds > 1 and row is not base:
                row["range"] = f"{min(row['rounds_vs_baseline'])}-{max(row['rounds_vs_baseline'])}"
    return rows
