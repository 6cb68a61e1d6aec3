"""The pure parts of benchmarks/bench_load_follow.py and benchmarks/common.py's environment."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their siblings (common)
bench = importlib.import_module("bench_load_follow")
common = importlib.import_module("common")


def _run(rates: list[float], starts: list[float], busy_s: float) -> dict:
    epochs = [
        {"epoch": i + 1, "img_s": rate, "started_s": start}
        for i, (rate, start) in enumerate(zip(rates, starts, strict=True))
    ]
    return {"busy_s": busy_s, "epochs": epochs, "changes": []}


def test_only_epochs_started_after_the_load_count():
    quiet = _run([1000.0, 1000.0, 1000.0, 1000.0], [5, 15, 25, 35], 0.0)
    busy = _run([500.0, 600.0, 900.0, 950.0], [5, 15, 31, 41], 30.0)
    result = bench.compare(quiet, busy)
    assert result["epochs_after_load"] == [3, 4]
    assert result["ratio_after_load"] == (900 + 950) / 2000
    assert result["passed"] is True
    stuck = _run([500.0, 500.0, 480.0, 490.0], [5, 15, 31, 41], 30.0)  # one thread kept
    assert bench.compare(quiet, stuck)["passed"] is False
    never = _run([500.0] * 4, [5, 15, 25, 29], 30.0)
    assert bench.compare(quiet, never) == {
        "epochs_after_load": [],
        "ratio_after_load": None,
        "target": bench.TARGET_RATIO,
        "passed": None,
    }


def test_the_epoch_row_and_monitor_lines_are_recognized():
    from pipelines.cifar100.progress import _format_row

    row = {"epoch": 3, "train_loss": 2.5, "test_top1": 0.31, "img_per_s": 1234.5}
    line = _format_row({**row, "data_wait_frac": 0.012})
    match = bench.ROW.match(line)
    assert match is not None and match[1] == "3" and match[2] == "1,234"
    assert bench.ROW.match(_format_row({**row, "data_wait_frac": None})) is not None
    logged = "epoch 2: intra-op threads 1 -> 2 (1.9 of 2 cores idle, was 0.9)"
    assert bench.CHANGE.search(f"WARNING {logged}")[0] == logged
    assert bench.CHANGE.search("intra-op threads: 1 (0.9 of 2 cores idle over 1.0 s ...)")
    assert bench.CHANGE.search("epoch 0: 900 samples/s; data wait 1.0 ms/step") is None


def test_one_environment_record_with_extra_keys_and_no_cuda_context():
    env = common.environment({"threads": 3, "cpus": 2})
    assert env["threads"] == 3 and env["cpus"] == 2
    assert env["versions"]["torch"] == torch.__version__
    assert {"git_revision", "host", "usable_cores", "memory_gib", "time_utc"} <= set(env)
    assert not torch.cuda.is_initialized()
