"""The Ray engine's overhead against the one-machine command, and the list source's peak memory.

    python benchmarks/bench_engine.py [--out DIR] [--rounds N] [--cpus 2]
                                      [--rss-rows 100000,1000000,3000000] [--skip-time]

1. Conversion time, each round alternating (same run, same machine, same inputs):
   - `fastdata shard KIND INPUT OUT --workers CPUS` (the one-machine command);
   - `... --engine ray --address ADDR` on a Ray cluster of CPUS CPUs that this script started
     once (the engine's own overhead: task hand-off, the source through the object store);
   - `... --engine ray` without --address: a local cluster started and stopped by the command
     (what a user pays on one machine without a cluster);
   - `write_shards(source, OUT, engine=RayEngine())` from this script's process, on the same
     cluster (the engine without a driver's start-up; the source is opened untimed, so this
     row is a lower bound).
   Every run is a subprocess (interpreter and imports included, as a user runs it); each
   engine run's output is checked to be byte-identical to the one-machine run's. Datasets: real
   CIFAR-100 and clothing-small from FASTDATA_DATA_DIR when present.
2. Peak RSS of `fastdata shard list LIST OUT --workers 1` (one process: driver and writer) for
   lists of N rows pointing at four tiny PNG files, repeated (`/usr/bin/time -f %M`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import REPO, print_table, results_dir, save_results  # noqa: I001  (run as a script)
from fastdata_pipelines.env import cpu_description, data_dir


def _run(words: list[str], rss_file: Path | None = None) -> float:
    """Seconds of `python -m fastdata WORDS` in a subprocess; with `rss_file`, run under
    `/usr/bin/time -f %M -o RSS_FILE` (the command's own peak RSS in KiB: os.wait4's
    ru_maxrss would count this big process, which the child is forked from, before exec)."""
    # The environment as it is now: ray.init sets what a joining driver needs (RAY_AUTH_MODE).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "fastdata", *words]
    if rss_file is not None:
        command = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *command]
    start = time.perf_counter()
    subprocess.run(command, env=env, stdout=subprocess.DEVNULL, check=True, timeout=7200)
    return time.perf_counter() - start


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def engine_times(cpus: int, rounds: int, scratch: Path) -> list[dict[str, Any]]:
    """A row per (dataset, method): median seconds over the rounds, ratio to the command."""
    import ray

    root = data_dir()
    datasets = {
        "cifar100": root / "cifar-100-python.tar.gz",
        "folder": root / "clothing-small",
    }
    datasets = {kind: path for kind, path in datasets.items() if path.exists()}
    if not datasets:
        print(f"no real data in {root}: set FASTDATA_DATA_DIR; skipping the timing")
        return []
    start = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    cluster_start = time.perf_counter() - start
    address = ray.get_runtime_context().gcs_address
    commands = {
        "command --workers": ["--workers", str(cpus)],
        "engine ray (running cluster)": ["--engine", "ray", "--address", address],
        "engine ray (local cluster started)": ["--engine", "ray"],
    }
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(rounds):
            for kind, path in datasets.items():
                reference = None
                runs = {name: _command(kind, path, flags) for name, flags in commands.items()}
                runs["engine ray (in-process driver)"] = _in_process(kind, path)
                for name, run in runs.items():
                    out = scratch / f"{kind}-{len(times)}"
                    seconds = run(out)
                    times.setdefault((kind, name), []).append(seconds)
                    found = _digests(out)
                    reference = reference or found
                    if found != reference:
                        raise RuntimeError(f"{name} wrote other bytes than the command ({kind})")
                    shutil.rmtree(out)
                    print(f"  {kind} {name}: {seconds:.1f} s")
    finally:
        ray.shutdown()
    rows = []
    for (kind, name), found in times.items():
        base = statistics.median(times[(kind, "command --workers")])
        rows.append(
            {
                "dataset": kind,
                "method": name,
                "seconds": round(statistics.median(found), 2),
                "vs_command": round(statistics.median(found) / base, 2),
                "rounds_s": [round(s, 2) for s in found],
            }
        )
    rows.append({"dataset": "-", "method": "ray.init (this script)", "seconds": cluster_start})
    return rows


def _command(kind: str, path: Path, flags: list[str]) -> Callable[[Path], float]:
    """A run of `fastdata shard KIND PATH OUT FLAGS` in a subprocess; returns its seconds."""
    return lambda out: _run(["shard", kind, str(path), str(out), "--no-progress", *flags])


def _in_process(kind: str, path: Path) -> Callable[[Path], float]:
    """`write_shards(..., engine=RayEngine())` from this process (its Ray workers stay warm
    between rounds): the engine without a new driver's start-up; the source opened untimed."""
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.engines.ray import RayEngine
    from fastdata.write.sources import open_source

    source = open_source(kind, path)

    def run(out: Path) -> float:
        start = time.perf_counter()
        write_shards(source, out, ShardOptions(progress=False), engine=RayEngine())
        return time.perf_counter() - start

    return run


def list_rss(row_counts: list[int], scratch: Path) -> list[dict[str, Any]]:
    """Peak RSS of `fastdata shard list` for each row count (one process, --workers 1)."""
    import numpy as np
    from PIL import Image

    images = scratch / "images"
    images.mkdir(exist_ok=True)
    for i in range(4):
        Image.fromarray(np.full((8, 8, 3), 60 * i, np.uint8)).save(images / f"img{i}.png")
    rows = []
    for count in row_counts:
        listing = scratch / f"list-{count}.csv"
        with open(listing, "w") as f:
            f.write("path,label\n")
            f.writelines(f"images/img{r % 4}.png,{r % 10}\n" for r in range(count))
        out = scratch / f"list-out-{count}"
        words = ["shard", "list", str(listing), str(out), "--no-progress", "--workers", "1"]
        seconds = _run(words, rss_file=scratch / "rss.txt")
        rss = int((scratch / "rss.txt").read_text().split()[-1]) // 1024
        rows.append({"rows": count, "peak_rss_mib": rss, "seconds": round(seconds, 1)})
        print(f"  list of {count:,} rows: peak RSS {rss} MiB, {seconds:.0f} s")
        shutil.rmtree(out)
        listing.unlink()
    first = rows[0]["peak_rss_mib"] if rows else 0
    for row in rows:
        row["vs_first"] = round(row["peak_rss_mib"] / first, 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results folder (default: $OUT or results/)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the Ray cluster and --workers")
    parser.add_argument("--rss-rows", default="100000,1000000,3000000")
    parser.add_argument("--skip-time", action="store_true", help="only the RSS figures")
    args = parser.parse_args()
    out = results_dir(args.out)
    tables, results = [], {"cpu": cpu_description()}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        scratch = Path(tmp)
        if not args.skip_time:
            rows = engine_times(args.cpus, args.rounds, scratch)
            results["engine"] = rows
            if rows:
                columns = ["dataset", "method", "seconds", "vs_command", "rounds_s"]
                tables.append(print_table(rows, columns, f"Conversion on {args.cpus} CPUs"))
        counts = [int(n) for n in args.rss_rows.split(",") if n]
        rss = list_rss(counts, scratch)
        results["list_rss"] = rss
        columns = ["rows", "peak_rss_mib", "vs_first", "seconds"]
        tables.append(print_table(rss, columns, "Peak RSS of `fastdata shard list`"))
    save_results("bench_engine", out, results, tables)


if __name__ == "__main__":
    main()
