#!/usr/bin/env bash
# Install fastdata from scratch into ./.venv: the pinned CPU torch, Pillow-SIMD, then the package
# with the extras the tests need (DALI runs its CPU operators where there is no GPU).
#
# Needs: Python 3.10+, a C compiler and the libjpeg/zlib headers (Pillow-SIMD builds from source,
# and so does fastdata's JPEG region extension, fastdata/read/_jpeg.c: optional, see pyproject).
# `torch==2.13.0` resolves to the CPU build on this project's machines (a local wheel); elsewhere,
# pass PIP_INDEX_URL/PIP_EXTRA_INDEX_URL for PyTorch's CPU wheels, or a plain PyPI install pulls
# the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install "torch==2.13.0"
# Pillow-SIMD first, so that nothing installs plain pillow beside it.
"${PIP[@]}" install "pillow-simd>=9.0"
# moto[server]: the S3-compatible server the remote tests start on loopback (no Docker).
"${PIP[@]}" install -e ".[test,dali,remote]" "moto[server]>=5.0"
.venv/bin/python - <<'PY'
import importlib.metadata as md
import sys

names = {d.metadata["Name"].lower() for d in md.distributions()}
needed = {"torch", "lightning", "webdataset", "pillow-simd", "psutil", "fastdata", "pytest",
          "pytest-timeout", "import-linter", "nvidia-dali-cuda120", "fsspec", "s3fs", "gcsfs", "aiohttp", "moto"}
if missing := needed - names:
    sys.exit(f"install failed: missing {sorted(missing)}")
if "pillow" in names:
    sys.exit("plain pillow was installed beside pillow-simd; find what pulled it in (pip show pillow)")
import PIL
import torch

import fastdata
# The first import of a fresh venv (bytecode compiled, libraries read from disk) took ~90 s more
# than later ones; done here, it is not counted in the trainer's time budget.
import fastdata.lightning.datamodule
import fastdata_pipelines.cifar100.train  # noqa: F401

from fastdata.read.decoders.image import jpeg_region_decoder

print(f"installed fastdata {fastdata.__version__}, torch {torch.__version__}, PIL (SIMD) {PIL.__version__}")
print(f"JPEG region decoder: {jpeg_region_decoder() or 'none (Pillow-SIMD decodes whole images)'}")
PY
