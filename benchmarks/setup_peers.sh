#!/usr/bin/env bash
# Build ./.venv-peers: the peers of benchmarks/bench_peers.py (LitData, MosaicML Streaming) in a venv
# of their own, apart from fastdata's ./.venv.
#
# Why a second venv: Streaming imports torchvision, and PyPI's torchvision does not load beside the
# CPU torch 2.13.0 that .ci/install pins ("operator torchvision::nms does not exist"); torchvision
# also pulls plain pillow, which must not sit beside fastdata's Pillow-SIMD. So the peers get a
# matching torch/torchvision pair (2.14.1 / 0.29.1: a CUDA build from this machine's local wheels,
# ~5.5 GB, that runs on the CPU) and the `[bench]` extra's libraries. fastdata itself is NOT
# installed here: the peer workers (benchmarks/peers_*.py) import `fastdata.augment` (torch only)
# from the checkout, for the engine-only runs. Run from anywhere:
#
#     bash benchmarks/setup_peers.sh          # then: .venv/bin/python benchmarks/bench_peers.py
#
# Elsewhere, set TORCH_SPEC/VISION_SPEC (and PIP_EXTRA_INDEX_URL for PyTorch's CPU wheels) to any
# torch/torchvision pair that loads together.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.14.1}"
VISION_SPEC="${VISION_SPEC:-torchvision==0.29.1}"
[ -x .venv-peers/bin/python ] || "$PYTHON" -m venv .venv-peers
PIP=(.venv-peers/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install "$TORCH_SPEC" "$VISION_SPEC"
# The same libraries as pyproject.toml's [bench] extra (kept in step by hand: the extra installs
# them beside fastdata, this venv installs them without it).
"${PIP[@]}" install "litdata>=0.2.40" "mosaicml-streaming>=0.11" "psutil>=5.9"
.venv-peers/bin/python - <<'PY'
import importlib.metadata as md

import litdata  # noqa: F401
import streaming  # noqa: F401
import torch
import torchvision  # noqa: F401  (fails here when torch and torchvision do not match)

print("peers venv ready:", {n: md.version(n) for n in ("torch", "torchvision", "litdata", "mosaicml-streaming")})
PY
