"""The cpu backend never touches CUDA: no NVIDIA module imported, no CUDA context, in its workers
or in the process that decodes in-line.

The GPU check of 2026-12-04 saw the cpu row take 3.3 GB of device memory where DALI (and with it
nvImageCodec) was installed, 188 MB without: its workers had loaded nvImageCodec as their JPEG
region decoder. The cpu path now has no NVIDIA decoder to load. These tests block every
``nvidia.*`` import and CUDA's initialization, and record any attempt; a machine without
fastdata's own region decoder (the extension not built) is the case that reached for
nvImageCodec before, so it is simulated too.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from fastdata.format.manifest_io import load_manifest
from fastdata.read import WorkerSettings
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.base import LoaderSpec
from fastdata.read.decoders import jpeg_region
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.folder import FolderSource
from tests.conftest import write_jpeg_folder


class _Tripwire(importlib.abc.MetaPathFinder):
    """Refuses ``nvidia`` and ``nvidia.*`` imports, appending each attempt (and the pid) to a
    file: a forked worker's attempts reach the test that way."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def record(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {what}\n")

    def find_spec(self, name, path, target=None):
        if name == "nvidia" or name.startswith("nvidia."):
            self.record(f"import {name}")
            raise ImportError(f"{name}: refused by the test (cpu backend)")
        return None


@pytest.fixture
def tripwire(tmp_path, monkeypatch):
    log = tmp_path / "attempts.txt"
    log.write_text("")
    wire = _Tripwire(log)
    for name in [n for n in sys.modules if n == "nvidia" or n.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [wire, *sys.meta_path])

    def no_cuda(*args, **kwargs):
        wire.record("torch.cuda init")
        raise RuntimeError("CUDA initialized by the cpu backend")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    # No region decoder built: today's fallback chain reached nvImageCodec from here.
    monkeypatch.setattr(jpeg_region, "_local", threading.local())

    def not_built(self):
        raise ImportError("fastdata.read._jpeg: not built (simulated)")

    monkeypatch.setattr(jpeg_region.LibjpegDecoder, "__init__", not_built)
    return log


@pytest.fixture
def photo_shards(tmp_path) -> Path:
    folder = write_jpeg_folder(tmp_path / "images", classes=2, per_class=8)
    out = tmp_path / "shards"
    write_shards(FolderSource(folder), out, ShardOptions(max_count=8, workers=1, progress=False))
    return out


def _spec(root: Path, workers: WorkerSettings) -> LoaderSpec:
    manifest = load_manifest(root)
    return LoaderSpec(
        manifest=manifest, split=next(iter(manifest.splits)), train=True, batch_size=4,
        preset="photo", image_size=24, workers=workers,
    )  # fmt: skip


def test_in_line_decoding_imports_nothing_of_nvidias(photo_shards, tripwire):
    loader = make_cpu_loader(_spec(photo_shards, WorkerSettings(num_workers=0)))
    batches = list(loader)
    assert batches and batches[0][0].shape[1:] == (3, 24, 24)
    assert tripwire.read_text() == ""
    assert jpeg_region.region_decoder() is None  # Pillow decodes whole JPEGs, as documented


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_worker_processes_import_nothing_of_nvidias(photo_shards, tripwire):
    workers = WorkerSettings(num_workers=2, mp_context="fork", persistent_workers=False)
    loader = make_cpu_loader(_spec(photo_shards, workers))
    assert len(list(loader)) == len(loader)
    assert tripwire.read_text() == ""  # nor in the workers (forked: the tripwire goes with them)


def _compute_apps() -> dict[int, float]:
    """pid -> device MiB of every process with a CUDA context (nvidia-smi)."""
    import subprocess

    cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    rows = [line.split(",") for line in text.splitlines() if line.strip()]
    return {int(pid): float(mib) for pid, mib in rows}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_machine_no_worker_holds_device_memory(photo_shards):
    """The 2026-12-04 cpu row: 3.3 GB of device memory with DALI installed. Every worker of a
    cpu loader training on the GPU is checked while it runs."""
    import psutil

    torch.zeros(1, device="cuda")  # the training process has its context, as in training
    workers = WorkerSettings(num_workers=2, mp_context="forkserver", persistent_workers=True)
    loader = make_cpu_loader(_spec(photo_shards, workers))
    batches = iter(loader)
    next(batches)  # the workers are up and decoding
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    apps = _compute_apps()
    assert children and not children & set(apps), {p: apps[p] for p in children & set(apps)}
    list(batches)
