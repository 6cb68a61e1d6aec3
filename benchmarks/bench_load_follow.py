"""Does training recover its speed after another process stops using a core?

Issue 11's scenario: a run of `fastdata train cifar100` started while another process briefly
used a core chose one intra-op thread and kept it for every epoch (463-497 img/s against
925-1,080 on a quiet machine). Since then `LoaderMonitor` re-checks threads, workers and
prefetch at each epoch end from the measured core load (`fastdata.tune.follow.recheck`).

This runs the CIFAR-100 pipeline (`python -m pipelines.cifar100`, its defaults: ResNet-9,
threads and workers "auto") twice in one invocation on the same shards:

- quiet: nothing added by the benchmark;
- busy: a busy-loop process pinned to one core for the first `--busy-s` seconds of the run
  (from the pipeline's start, so its start-up thread choice sees the busy core).

It reports img/s per epoch (the pipeline's own table), the settings changes the monitor logged,
and the ratio of the busy run's epochs that started after the load ended to the quiet run's same
epochs (target: >= 0.8, i.e. within 20%). Figures are only comparable within one invocation.

    python benchmarks/bench_load_follow.py --out /tmp/load_follow       # ~6 epochs, a few min
    python benchmarks/bench_load_follow.py --epochs 3 --limit-train-batches 20 --busy-s 10 \\
        --out /tmp/load_follow                                             # smoke run

The CIFAR-100 archive comes from $FASTDATA_DATA_DIR (default ../shared/data) or --data.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import REPO, environment, print_table, results_dir, save_results  # noqa: I001
from fastdata_pipelines.env import data_dir

ARCHIVE = "cifar-100-python.tar.gz"
ROW = re.compile(r"^\s*(\d+)\s+\S+\s+\S+\s+([\d,]+)\s+\S+\s*$")  # epoch, loss, top-1, img/s, wait
# The start-up thread choice and every change the LoaderMonitor logs.
CHANGE = re.compile(
    r"intra-op threads: \d+ .*|epoch \d+: (intra-op threads|workers|prefetch_factor) .*"
)
TARGET_RATIO = 0.8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None, help=f"the {ARCHIVE} (default: data dir)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--limit-train-batches", type=int, default=80, help="steps per epoch")
    p.add_argument("--limit-test-batches", type=int, default=5, help="test batches per epoch")
    p.add_argument("--busy-s", type=float, default=30.0, help="seconds the other process runs")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--out", default=None, help="results folder (default $OUT, else results/)")
    return p.parse_args(argv)


def _spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def run_pipeline(args: argparse.Namespace, shards: Path, out: Path, busy_s: float) -> dict:
    """One pipeline run; epoch rows timed as they are printed, the monitor's changes kept."""
    out.mkdir(parents=True)
    (out / "shards").symlink_to(shards, target_is_directory=True)  # reused, not re-written
    cmd = [
        sys.executable, "-m", "pipelines.cifar100", "--out", str(out),
        "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
        "--limit-train-batches", str(args.limit_train_batches),
        "--limit-test-batches", str(args.limit_test_batches),
        "--checkpoint-every", "1000000",
    ]  # fmt: skip
    spinner, timer = None, None
    start = time.monotonic()
    if busy_s > 0:
        core = min(os.sched_getaffinity(0))
        spinner = mp.get_context("fork").Process(target=_spin, args=(core,), daemon=True)
        spinner.start()
        timer = threading.Timer(busy_s, spinner.terminate)
        timer.start()
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    epochs, changes, tail = [], [], []
    try:
        for line in proc.stdout:
            now = time.monotonic() - start
            tail = (tail + [line.rstrip()])[-40:]
            if (row := ROW.match(line)) is not None:
                epochs.append({"epoch": int(row[1]), "img_s": float(row[2].replace(",", ""))})
                epochs[-1]["ended_s"] = round(now, 1)
            elif (change := CHANGE.search(line)) is not None:
                changes.append(f"t={now:.0f}s {change[0]}")
        proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if spinner is not None:
            spinner.terminate()
            spinner.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(tail))
    metrics = json.loads((out / "metrics.json").read_text())
    for row, measured in zip(epochs, metrics["epochs"], strict=True):
        row["started_s"] = round(row["ended_s"] - measured["train_s"] - measured["test_s"], 1)
    return {"busy_s": busy_s, "epochs": epochs, "changes": changes}


def compare(quiet: dict, busy: dict) -> dict[str, Any]:
    """The busy run's epochs that started after the load ended, against the quiet run's."""
    after = [e["epoch"] for e in busy["epochs"] if e["started_s"] >= busy["busy_s"]]
    quiet_rate = {e["epoch"]: e["img_s"] for e in quiet["epochs"]}
    pairs = [(e["img_s"], quiet_rate[e["epoch"]]) for e in busy["epochs"] if e["epoch"] in after]
    ratio = sum(b for b, _ in pairs) / sum(q for _, q in pairs) if pairs else None
    return {
        "epochs_after_load": after,
        "ratio_after_load": ratio,
        "target": TARGET_RATIO,
        "passed": None if ratio is None else ratio >= TARGET_RATIO,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    archive = args.data or data_dir() / ARCHIVE
    if not archive.exists():
        raise SystemExit(f"no CIFAR-100 archive at {archive}: pass --data or set FASTDATA_DATA_DIR")
    out = results_dir(args.out)
    at_start = environment()
    with tempfile.TemporaryDirectory(prefix="bench_load_follow_") as tmp:
        from fastdata.write import ShardOptions, write_shards
        from fastdata.write.sources import open_source

        shards = Path(tmp) / "shards"
        write_shards(open_source("cifar100", archive), shards, ShardOptions(progress=False))
        runs = {
            "quiet": run_pipeline(args, shards, Path(tmp) / "quiet", 0.0),
            "busy": run_pipeline(args, shards, Path(tmp) / "busy", args.busy_s),
        }
    result = compare(runs["quiet"], runs["busy"])
    rows = [
        {
            "epoch": q["epoch"],
            "quiet img/s": q["img_s"],
            "busy img/s": b["img_s"],
            "busy epoch start s": b["started_s"],
            "after load": b["epoch"] in result["epochs_after_load"],
        }
        for q, b in zip(runs["quiet"]["epochs"], runs["busy"]["epochs"], strict=True)
    ]
    title = (
        f"CIFAR-100 pipeline, one core busy for the first {args.busy_s:.0f} s: ratio after the "
        f"load {_fmt(result['ratio_after_load'])} (target >= {TARGET_RATIO})"
    )
    table = print_table(rows, list(rows[0]), title)
    for name, run in runs.items():
        print(f"{name}: settings changes logged by the LoaderMonitor:")
        for change in run["changes"] or ["(none)"]:
            print(f"  {change}")
    report = {"args": vars(args), "environment_at_start": at_start, "runs": runs, **result}
    save_results("bench_load_follow", out, report, [table])
    return report


def _fmt(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


if __name__ == "__main__":
    main(parse_args())
