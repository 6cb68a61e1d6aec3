#!/usr/bin/env bash
# Install fastdata from scratch into ./.venv: the pinned CPU torch, Pillow-SIMD, then the package
# with the extras the tests need (DALI runs its CPU operators where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip 2>&1 | grep -v "is ignored" || true
# A plain `torch` would pull a multi-GB CUDA build; this pin is the CPU build.
"${PIP[@]}" install "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
# Pillow-SIMD first, so that nothing installs plain pillow beside it.
"${PIP[@]}" install "pillow-simd>=9.0" 2>&1 | grep -v "is ignored" || true
"${PIP[@]}" install -e ".[test,dali]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python - <<'PY'
import importlib.metadata as md
import sys
names = {d.metadata["Name"].lower() for d in md.distributions()}
missing = {"torch", "lightning", "webdataset", "pillow-simd", "psutil", "fastdata"} - names
if missing:
    sys.exit(f"install failed: missing {sorted(missing)}")
if "pillow" in names:
    sys.exit("plain pillow was installed beside pillow-simd; find what pulled it in (pip show pillow)")
import fastdata, torch, PIL
print(f"installed fastdata {fastdata.__version__}, torch {torch.__version__}, PIL (SIMD) {PIL.__version__}")
PY
