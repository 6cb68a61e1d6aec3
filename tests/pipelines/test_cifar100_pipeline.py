"""The CIFAR-100 pipeline end to end: wiring on tiny synthetic shards, and learning on the real data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastdata._env import data_dir

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
    from fastdata.sources.arrays import ArraySource
    from fastdata.write import ShardOptions, write_shards

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
