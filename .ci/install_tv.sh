#!/usr/bin/env bash
# Build ./.venv-tv: fastdata beside torchvision, the environment most Lightning users of images
# have. torchvision's PyPI wheels need the torch build they were made with (0.28.0 beside the CPU
# torch 2.13.0 of .venv fails to load its operators), so this venv has its own pair; its PIL is
# the plain Pillow torchvision pulls in, and fastdata (which names no PIL) must leave it alone.
# tests/docs/test_torchvision_guide.py runs docs/guides/torchvision.md here.
#
# .ci/install.sh starts this in the background (it is download/unpack bound, the Pillow-SIMD build
# of .venv is CPU bound); it also runs alone: `bash .ci/install_tv.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv-tv/bin/python ] || "$PYTHON" -m venv .venv-tv
PIP=(.venv-tv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --no-compile --upgrade pip
"${PIP[@]}" install --no-compile "torch==2.14.1" "torchvision==0.29.1"
# Plain fastdata (no [pillow]/[simd] extra): torchvision's Pillow is the PIL it runs on.
"${PIP[@]}" install --no-compile -e .
.venv-tv/bin/python -m pip --disable-pip-version-check check
.venv-tv/bin/python - <<'PY'
import importlib.metadata as md
import sys

names = {d.metadata["Name"].lower() for d in md.distributions()}
if missing := {"torch", "torchvision", "lightning", "pillow", "fastdata"} - names:
    sys.exit(f".venv-tv install failed: missing {sorted(missing)}")
import torch
import torchvision
from torchvision.ops import nms  # loads torchvision's compiled operators (fails on a torch mismatch)

import fastdata

pil = fastdata.pil_info()
if pil.problem or pil.distribution != "pillow":
    sys.exit(f".venv-tv: PIL is not plain Pillow alone: {pil.describe()} "
             "(find what pulled another in: .venv-tv/bin/pip show pillow pillow-simd)")
boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 10.0, 10.0]])
assert nms(boxes, torch.tensor([0.9, 0.8]), 0.5).tolist() == [0]
print(f".venv-tv: fastdata {fastdata.__version__}, torch {torch.__version__}, "
      f"torchvision {torchvision.__version__}, {pil.describe()}")
PY
