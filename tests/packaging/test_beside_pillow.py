"""Installing fastdata into a user's environment keeps its one PIL (issue 28).

A fresh venv gets this environment's torch build, Pillow and matplotlib (a Pillow-dependent package,
standing in for torchvision); then this checkout is installed as a user installs it (`pip install
PATH`, dependencies resolved). There must be exactly one PIL distribution, `pip check` clean, both
packages working, and PIL still whole after `pip uninstall fastdata`. Before issue 28, fastdata
required `pillow-simd`, which pip wrote over Pillow's files: two distributions claiming one `PIL`.

Slow (about a minute from pip's cache; the first run downloads fastdata's dependencies): it needs
an index with Pillow, matplotlib and fastdata's dependencies (PyPI, or this machine's local mirror).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PIL_NAMES = {"pillow", "pillow-simd"}

pytestmark = pytest.mark.slow

# Run in the new venv: fastdata decodes a JPEG crop and the PNG matplotlib wrote, and reports PIL.
FASTDATA_WORKS = """
import io, sys
import numpy as np
from PIL import Image
import fastdata
from fastdata.read.decoders.image import Geometry, decode_image

png = open(sys.argv[1], "rb").read()
rng = np.random.default_rng(0)
pixels = decode_image(png, Geometry(), rng)
assert pixels.shape == (60, 80, 3) and pixels.dtype == np.uint8, pixels.shape
buf = io.BytesIO()
Image.fromarray(np.full((64, 96, 3), 200, np.uint8)).save(buf, format="JPEG")
crop = decode_image(buf.getvalue(), Geometry(kind="rrc", size=32, flip_p=0.5), rng)
assert crop.shape == (32, 32, 3) and abs(int(crop.mean()) - 200) <= 2, crop.mean()
info = fastdata.pil_info()
assert info.distribution == "pillow" and info.problem is None, info
print(info.describe())
"""

MATPLOTLIB_WORKS = """
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from PIL import Image
fig = plt.figure(figsize=(0.8, 0.6), dpi=100)
plt.plot([0, 1], [1, 0])
fig.savefig(sys.argv[1])
assert Image.open(sys.argv[1]).size == (80, 60)
"""


def _run(command: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([str(python), "-m", "pip", "--disable-pip-version-check", *args])


def _pil_state(python: Path) -> tuple[set[str], list[str]]:
    """(installed PIL distributions by pip's list, distributions claiming the `PIL` package)."""
    listed = json.loads(_pip(python, "list", "--format=json").stdout)
    names = {row["name"].lower().replace("_", "-") for row in listed} & PIL_NAMES
    code = "import importlib.metadata as m, json; print(json.dumps(m.packages_distributions().get('PIL', [])))"
    claims = json.loads(_run([str(python), "-c", code]).stdout)
    return names, claims


def _checkout(dest: Path) -> Path:
    """The files a build of fastdata reads, copied: pip's in-tree build leaves nothing here."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for folder in ("fastdata", "pipelines"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=skip)
    return dest


def test_fastdata_installs_beside_pillow_and_matplotlib_with_one_pil(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = venv / "bin" / "python"
    # This environment's torch build (the CPU one here; resolvable wherever this venv's came from).
    torch_spec = f"torch=={torch.__version__}"
    _pip(python, "install", "-q", "--no-compile", torch_spec, "pillow", "matplotlib")
    before = _pil_state(python)
    assert before == ({"pillow"}, ["pillow"]), before

    source = _checkout(tmp_path / "src")
    _pip(python, "install", "-q", "--no-compile", str(source))
    names, claims = _pil_state(python)
    assert names == {"pillow"}, f"installing fastdata changed the PIL distributions: {names}"
    assert [c.lower() for c in claims] == ["pillow"], claims
    _pip(python, "check")

    png = tmp_path / "plot.png"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's fastdata only
    _run([str(python), "-c", MATPLOTLIB_WORKS, str(png)], env=env, cwd=tmp_path)
    described = _run([str(python), "-c", FASTDATA_WORKS, str(png)], env=env, cwd=tmp_path)
    assert described.stdout.startswith("Pillow "), described.stdout

    _pip(python, "uninstall", "-y", "fastdata")
    assert _pil_state(python) == ({"pillow"}, ["pillow"])
    _pip(python, "check")
    png.unlink()
    _run([str(python), "-c", MATPLOTLIB_WORKS, str(png)], env=env, cwd=tmp_path)
    shutil.rmtree(venv)  # ~1.5 GB with torch; a failed run keeps it to look into
