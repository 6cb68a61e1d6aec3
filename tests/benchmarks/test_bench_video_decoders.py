"""benchmarks/bench_video_decoders.py: a --quick run (PyAV always; torchcodec or its reason), and
the frame mappings it hands torchcodec."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))  # the scripts import their siblings (common)
bench = importlib.import_module("bench_video_decoders")


def test_quick_run_times_pyav_and_says_why_torchcodec_is_skipped(tmp_path: Path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_video_decoders.py"), "--quick", "--out", str(out)],
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((out / "bench_video_decoders.json").read_text())
    assert result["args"]["rounds"] == 2 and result["args"]["clips"] == 3
    assert "cpu" in result["environment"] and result["cpu_model"]
    rows = result["rows"]
    pyav = [row for row in rows if row["decoder"] == "pyav"]
    assert [row["video"] for row in pyav] == ["h264 64x64 2 s", "vp9 64x64 2 s"]
    for row in rows:
        assert row["clips"] == 6 and row["ms/clip"] > 0
        assert row["diff"] < row["next-frame diff"] / 2, row  # the clip's frames, not neighbours
    decoders = result["decoders"]
    if decoders["torchcodec"] is None:  # skipped: the reason is printed and recorded
        assert "torchcodec skipped" in done.stdout and decoders["torchcodec_skipped"]
        assert {row["decoder"] for row in rows} == {"pyav", "pyav every frame"}
    else:
        assert len(rows) == 10 and decoders["torchcodec"].startswith("torchcodec ")
    assert "| h264 64x64 2 s" in (out / "bench_video_decoders.md").read_text()


def test_frame_mappings_from_a_clip_index():
    index = bench.ClipIndex(
        codec="h264",
        width=64,
        height=48,
        rotation=0,
        time_base=(1, 15360),
        pts=np.array([0, 512, 1024, 1536], np.int64),
        keys=np.array([0, 2], np.int64),
        fps=30.0,
    )
    frames = json.loads(bench._frame_mappings(index))["frames"]
    assert [f["pts"] for f in frames] == [0, 512, 1024, 1536]
    assert [f["duration"] for f in frames] == [512, 512, 512, 512]
    assert [f["key_frame"] for f in frames] == [1, 0, 1, 0]
    assert bench._cover(index) == (149, 112)  # covers 112 x 112, aspect kept
