#!/usr/bin/env bash
# Install fastdata from scratch into ./.venv: the pinned CPU torch, one PIL distribution, then the
# package with the extras the tests need (DALI runs its CPU operators where there is no GPU).
#
# PIL: FASTDATA_PIL=pillow-simd (the default; docs/PIL.md: what it buys, why it stays) or pillow
# (a wheel: seconds instead of a source build). fastdata names neither as a dependency
# (pyproject.toml), so the one installed here stays the only one; switching an existing .venv
# uninstalls the other first (two distributions writing one PIL folder break each other).
#
# Needs: Python 3.10+, a C compiler and the libjpeg/zlib headers (Pillow-SIMD builds from source,
# and so does fastdata's JPEG region extension, fastdata/read/_jpeg.c: optional, see pyproject).
# `torch==2.13.0` resolves to the CPU build on this project's machines (a local wheel); elsewhere,
# pass PIP_INDEX_URL/PIP_EXTRA_INDEX_URL for PyTorch's CPU wheels, or a plain PyPI install pulls
# the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# .venv-tv (torch + torchvision + plain Pillow + fastdata: .ci/install_tv.sh) builds meanwhile:
# it is download/unpack bound, the Pillow-SIMD build below CPU bound. Waited for at the end.
# FASTDATA_TV=0 skips it (tests/docs/test_torchvision_guide.py then skips, or fails under CI).
if [ "${FASTDATA_TV:-1}" != 0 ]; then
    TV_LOG="$(mktemp "${TMPDIR:-/tmp}/venv-tv-install.XXXXXX")"
    PYTHON="$PYTHON" bash .ci/install_tv.sh >"$TV_LOG" 2>&1 &
    TV_PID=$!
    # A failure below stops the background build too (no pip left writing into .venv-tv).
    trap 'kill "$TV_PID" 2>/dev/null || true' EXIT
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# install --no-compile: pip would byte-compile every file it installs (ray, DALI, botocore: minutes
# of CPU on 2 cores); Python compiles what is imported, once, on first import instead.
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --no-compile --upgrade pip
"${PIP[@]}" install --no-compile "torch==2.13.0"
PIL_DIST="${FASTDATA_PIL:-pillow-simd}"
case "$PIL_DIST" in
    pillow) OTHER=pillow-simd ;;
    pillow-simd) OTHER=pillow ;;
    *) echo "FASTDATA_PIL must be pillow or pillow-simd, got '$PIL_DIST'" >&2; exit 2 ;;
esac
if .venv/bin/python -m pip show -q "$OTHER" >/dev/null 2>&1; then
    # Uninstalling the other removes files both wrote: reinstall the chosen one whole.
    "${PIP[@]}" uninstall -y "$OTHER"
    "${PIP[@]}" install --no-compile --force-reinstall --no-deps "$PIL_DIST>=9.0"
else
    "${PIP[@]}" install --no-compile "$PIL_DIST>=9.0"
fi
# moto[server]: the S3-compatible server the remote tests start on loopback (no Docker).
"${PIP[@]}" install --no-compile -e ".[test,dali,remote,ray,docs,video]" "moto[server]>=5.0"
.venv/bin/python -m pip --disable-pip-version-check check
FASTDATA_PIL="$PIL_DIST" .venv/bin/python - <<'PY'
import importlib.metadata as md
import os
import sys

names = {d.metadata["Name"].lower() for d in md.distributions()}
needed = {"torch", "lightning", "webdataset", os.environ["FASTDATA_PIL"], "psutil", "fastdata",
          "pytest", "pytest-timeout", "import-linter", "nvidia-dali-cuda120", "fsspec", "s3fs", "gcsfs", "aiohttp",
          "moto", "ray", "mkdocs-material", "mkdocstrings", "av"}
if missing := needed - names:
    sys.exit(f"install failed: missing {sorted(missing)}")
import torch

import fastdata

pil = fastdata.pil_info()
if pil.problem or pil.distribution != os.environ["FASTDATA_PIL"]:
    sys.exit(f"PIL is not {os.environ['FASTDATA_PIL']} alone: {pil.describe()} "
             "(find what pulled the other in: pip show pillow pillow-simd)")
# The first import of a fresh venv (bytecode compiled, libraries read from disk) took ~90 s more
# than later ones; done here, it is not counted in the trainer's time budget.
import fastdata.lightning.datamodule
import fastdata_pipelines.cifar100.train  # noqa: F401

from fastdata.read.decoders.image import jpeg_region_decoder

print(f"installed fastdata {fastdata.__version__}, torch {torch.__version__}, {pil.describe()}")
print(f"JPEG region decoder: {jpeg_region_decoder() or 'none (PIL decodes whole images)'}")
PY
if [ -n "${TV_PID:-}" ]; then
    waited=$SECONDS
    status=0
    wait "$TV_PID" || status=$?
    trap - EXIT  # reaped: its id may be reused
    if [ "$status" = 0 ]; then
        # How long .venv took, and how much longer the background build kept CI waiting.
        echo "$(tail -n 1 "$TV_LOG") (.venv done at ${waited} s, .venv-tv at ${SECONDS} s)"
        rm -f "$TV_LOG"
    else
        echo "building .venv-tv failed (exit $status); its log, $TV_LOG:" >&2
        cat "$TV_LOG" >&2
        exit "$status"
    fi
fi
