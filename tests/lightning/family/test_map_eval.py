"""docs/detection_eval.md runs as written: its tiny COCO dataset is sharded, and its
`evaluate_map.py` gives the same torchmetrics mAP on 1 and on 2 DDP processes (CPU, gloo), each
image evaluated once (padding rows left out by their key `None`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "detection_eval.md"
pytestmark = pytest.mark.slow

pytest.importorskip("pycocotools")  # torchmetrics' mAP backend (the `test` extra)


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _python(args: list[str], cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_docs_map_example_gives_the_same_map_on_one_and_two_ranks(tmp_path):
    make, evaluate = _blocks()
    (tmp_path / "make_dataset.py").write_text(make)
    (tmp_path / "evaluate_map.py").write_text(evaluate)
    _python(["make_dataset.py"], tmp_path)
    manifest = json.loads((tmp_path / "tiny-coco-shards" / "manifest.json").read_text())
    assert manifest["class_ids"] == [3, 7]
    runs = {}
    for devices in (1, 2):
        lines = _python(["evaluate_map.py", str(devices)], tmp_path).splitlines()
        runs[devices] = json.loads(next(ln for ln in reversed(lines) if ln.startswith("{")))
        print(f"{devices} rank(s): {runs[devices]}")
    one, two = runs[1], runs[2]
    assert one["images"] == two["images"] == list(range(1, 8))  # COCO image ids, each once
    assert one["results"] == two["results"]
    assert 0.3 < one["map"] < 1.0  # a real figure: neither perfect nor nothing
    assert two["map"] == pytest.approx(one["map"], abs=1e-9)
