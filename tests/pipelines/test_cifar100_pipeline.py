"""The CIFAR-100 pipeline end to end: wiring on tiny synthetic shards, and learning on the real data."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from fastdata_pipelines.env import data_dir

ROOT = Path(__file__).resolve().parents[2]
ARCHIVE = data_dir() / "cifar-100-python.tar.gz"


def _pipeline(out: Path, *options: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        "timeout",
        "-k",
        "10",
        str(timeout),
        sys.executable,
        "-m",
        "pipelines.cifar100",
        "--out",
        str(out),
        *options,
    ]
    done = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def test_pipeline_on_synthetic_shards_prints_table_and_writes_metrics(tmp_path: Path) -> None:
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources.arrays import ArraySource

    rng = np.random.default_rng(0)
    splits = {
        name: (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 100, n))
        for name, n in (("train", 256), ("test", 64))
    }
    out = tmp_path / "run"
    # Shards already in OUT/shards are reused: the pipeline does not need the archive.
    write_shards(
        ArraySource(splits, classes=[f"c{i}" for i in range(100)]),
        out / "shards",
        ShardOptions(max_count=128, workers=1, progress=False),
    )

    done = _pipeline(
        out,
        "--epochs",
        "2",
        "--width",
        "4",
        "--batch-size",
        "64",
        "--checkpoint-every",
        "3",
        timeout=180,
    )

    assert "reusing the shards" in done.stderr
    lines = done.stdout.splitlines()
    header = next(
        i for i, line in enumerate(lines) if line.split()[:3] == ["epoch", "train", "loss"]
    )
    assert [line.split()[0] for line in lines[header + 1 : header + 3]] == ["1", "2"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert [row["epoch"] for row in metrics["epochs"]] == [1, 2]
    assert all(row["img_per_s"] > 0 and 0 <= row["test_top1"] <= 1 for row in metrics["epochs"])
    assert metrics["precision"] in ("32-true", "bf16-mixed", "16-mixed")
    assert (out / "checkpoints" / "last.ckpt").is_file()


def _tiny_cifar100_archive(dest: Path, n_train: int, n_test: int) -> Path:
    """A random CIFAR-100 archive in the official layout (cifar-100-python/{meta,train,test})."""
    rng = np.random.default_rng(0)
    members = {
        "meta": {
            "fine_label_names": [f"c{i}" for i in range(100)],
            "coarse_label_names": [f"s{i}" for i in range(20)],
        }
    }
    for split, n in (("train", n_train), ("test", n_test)):
        members[split] = {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "fine_labels": rng.integers(0, 100, n).tolist(),
            "coarse_labels": rng.integers(0, 20, n).tolist(),
        }
    path = dest / "cifar-100-python.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, obj in members.items():
            data = pickle.dumps(obj, protocol=3)
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


BUDGET_S = 40
# Over the budget allowed to the whole command (interpreter start to exit): the planner keeps 5 s
# for the end of the run; this covers a late burst of load on a shared machine (the planner sizes
# the run from the rates it measured early: 53.6 s measured when a benchmark and a third test
# process started beside the two xdist workers mid-run). A planner that overran by more than a
# third of the budget still fails; `metrics["wall_s"] <= BUDGET_S` below is the run's own account.
BUDGET_TOLERANCE_S = 15


@pytest.mark.slow
def test_budget_run_shards_trains_and_ends_within_the_budget(tmp_path: Path) -> None:
    archive = _tiny_cifar100_archive(tmp_path, n_train=4096, n_test=512)
    out = tmp_path / "run"

    started = time.monotonic()
    done = _pipeline(
        out,
        *("--data", str(archive), "--budget", str(BUDGET_S), "--width", "8"),
        *("--batch-size", "64", "--checkpoint-every", "20"),
        timeout=BUDGET_S * 4,
    )
    wall = time.monotonic() - started

    assert wall <= BUDGET_S + BUDGET_TOLERANCE_S, f"{wall:.1f} s for a {BUDGET_S} s budget"
    assert (out / "shards" / "manifest.json").is_file()  # sharding ran inside the budget
    assert f"budget {BUDGET_S} s, step " in done.stdout and " epochs = " in done.stdout
    assert "planned epochs" in done.stdout  # the table's plan columns
    metrics = json.loads((out / "metrics.json").read_text())
    budget = metrics["budget"]
    assert budget["budget_s"] == BUDGET_S and budget["measured_img_per_s"] > 0
    assert budget["measured_eval_s"] > 0  # the first evaluation was timed and budgeted
    assert budget["steps_run"] == budget["planned_steps"] > 0  # it stopped at the planned step
    assert metrics["epochs"][-1]["planned_steps"] == budget["planned_steps"]
    assert budget["plans"][0]["when"].startswith("step ")  # planned inside epoch 1
    assert metrics["wall_s"] <= BUDGET_S
    # A budget run evaluates once, after its last step (--eval-each-epoch asks for every epoch).
    tops = [row["test_top1"] for row in metrics["epochs"]]
    assert tops[-1] is not None and all(top is None for top in tops[:-1])


@pytest.mark.realdata
@pytest.mark.slow
def test_one_short_epoch_on_cifar100_learns(tmp_path: Path) -> None:
    if not ARCHIVE.is_file():
        pytest.skip(f"no CIFAR-100 archive at {ARCHIVE} (set FASTDATA_DATA_DIR)")
    out = tmp_path / "run"

    args = ("--data", str(ARCHIVE), "--epochs", "1", "--width", "16", "--batch-size", "128")
    _pipeline(out, *args, timeout=600)

    metrics = json.loads((out / "metrics.json").read_text())
    top1 = metrics["final_test_top1"]
    # Chance is 1%. One epoch at width 16 (batch 128) reached 27.3% here with the default recipe
    # (20.0% before the whitening stem and lr 0.5); 10% leaves a wide margin and still fails a
    # pipeline that breaks labels, augmentation, the whitening fit or the schedule.
    assert top1 >= 0.10, f"test top-1 {top1:.2%} after one epoch"
    assert (out / "shards" / "manifest.json").is_file()
