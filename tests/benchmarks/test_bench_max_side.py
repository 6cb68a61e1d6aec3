"""benchmarks/bench_max_side.py: a --quick run on a tiny generated JPEG folder, and its pure parts."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))  # the scripts import their siblings (common)
bench = importlib.import_module("bench_max_side")


def _photo_folder(root: Path, per_class: dict[str, int], size=(120, 90)) -> Path:
    """clothing-small's layout (split/class/*.jpg) of smooth JPEGs larger than the sides tested."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, size[0])[None, :, None] * np.linspace(0, 1, size[1])[:, None, None]
    for split, n in per_class.items():
        for c, tint in enumerate([(255, 40, 40), (40, 40, 255)]):
            folder = root / bench.DATASET / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                noise = rng.integers(0, 40, (size[1], size[0], 3))
                pixels = np.clip(ramp * np.array(tint) + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=95)
    return root


def test_quick_run_writes_a_row_per_shard_set(tmp_path: Path):
    data = _photo_folder(tmp_path / "data", {"train": 8, "validation": 3})
    out = tmp_path / "out"
    args = ["--quick", "--data", str(data), "--out", str(out), "--sides", "64,32"]
    args += ["--image-size", "32", "--batch", "4", "--width", "4", "--workers", "0"]
    args += ["--threads", "1", "--seeds", "5,6"]  # --quick keeps the first seed only
    scratch = tmp_path / "tmp"  # the benchmark's temporary shard folders go here
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_max_side.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((out / "max_side.json").read_text())
    assert result["settings"]["epochs"] == 1 and result["settings"]["seeds"] == [5]
    assert "cpu" in result["environment"]
    rows = {row["max_side"]: row for row in result["rows"]}
    assert list(rows) == ["none", "64", "32"]
    for name, row in rows.items():
        assert row["val_images"] == 6, name  # every validation photo counted, none dropped
        assert 0.0 <= row["top1_mean"] <= 100.0 and len(row["top1_per_seed"]) == 1
        assert row["img_per_s"] > 0 and row["shard_s"] > 0
        assert ("delta_mean" in row) == (name != "none")
    # the shrunk sets are smaller, the smaller side the smaller still
    assert rows["none"]["shard_mb"] > rows["64"]["shard_mb"] > rows["32"]["shard_mb"]
    assert rows["none"]["mb_vs_none"] == 1.0 and rows["32"]["mb_vs_none"] < 1.0
    assert "| 64 " in (out / "max_side.md").read_text()
    assert not list(scratch.iterdir())  # the shard sets are removed


def test_paired_deltas_against_the_same_seed():
    base = {
        0: {"top1": 50.0, "img_per_s": 100.0, "val_images": 9},
        1: {"top1": 40.0, "img_per_s": 100.0, "val_images": 9},
    }
    runs = {
        0: {"top1": 48.0, "img_per_s": 120.0, "val_images": 9},
        1: {"top1": 43.0, "img_per_s": 140.0, "val_images": 9},
    }
    row = bench.summarize("128", {"shard_mb": 1.0, "shard_s": 0.5}, runs, base)
    assert row["delta_per_seed"] == [-2.0, 3.0] and row["delta_mean"] == 0.5
    assert row["top1_mean"] == 45.5 and row["top1_spread"] == 5.0 and row["img_per_s"] == 130.0
    assert "delta_mean" not in bench.summarize("none", {}, base, None)


def test_skips_with_a_message_without_the_data(tmp_path: Path, capsys):
    assert bench.main(["--data", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "skipped" in said and str(tmp_path / bench.DATASET) in said
    assert not (tmp_path / "out" / "max_side.json").exists()
