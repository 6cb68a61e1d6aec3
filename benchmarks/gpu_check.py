"""GPU check of the read backends: decode throughput, CIFAR-100 loader throughput, GPU memory.

    python benchmarks/gpu_check.py                          # one GPU, < 8 min on an H200
    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc  # local dry run, tiny sizes, CPU

Steps (each one is timed and reported on its own; a failing step is recorded, not fatal):

(a) photo: clothing-small JPEGs at 224 random-resized-crop, images/s per process, DALI ``mixed``
    decode (nvJPEG / hardware decoder, augmentation on the GPU) vs the CPU backend (Pillow-SIMD in
    DataLoader workers, then flip + normalize on the GPU). An image counts once it is a normalized
    float on the GPU.
(b) cifar: CIFAR-100 train loader throughput of each backend (cpu, dali, memory) through
    ``ShardDataModule.on_after_batch_transfer``, i.e. augmented batches ready for the model.
(c) memory: for every run of (a) and (b), torch's peak allocation and the device-wide used memory
    (NVML when pynvml is installed, else ``cudaMemGetInfo``) above the level before the run, which
    includes DALI's own pools; for DALI also the used memory after every epoch (the pipeline is
    rebuilt every epoch: it must not grow) and after ``close()``.
(d) trainer: ``python -m pipelines.cifar100 --model resnet9 --epochs N --devices 1`` when that
    entry point exists, else skipped with a note.

Timing: ``--epochs`` timed epochs after ``--warmup`` untimed ones; CUDA is synchronized at the
start and end of every epoch and after the first batch (so "steady" excludes pipeline start-up).
The shards are written to a temporary folder from $FASTDATA_DATA_DIR. Results: ``gpu_check.json``
(versions, host, git revision, arguments, every measurement) and ``gpu_check.md`` in ``--out``
(default $OUT, else the current folder).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout without `pip install -e`

from fastdata._env import data_dir  # noqa: E402
from fastdata.augment import get_preset  # noqa: E402
from fastdata.manifest import Manifest  # noqa: E402
from fastdata.read import LoaderSpec, get_backend  # noqa: E402
from fastdata.sources import open_source  # noqa: E402
from fastdata.write import ShardOptions, write_shards  # noqa: E402

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (dry run)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs before them")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--photo-batch", type=int, default=128)
    p.add_argument("--photo-size", type=int, default=224)
    p.add_argument("--photo-limit", type=int, default=None, help="photos per split (default all)")
    p.add_argument("--cifar-batch", type=int, default=512)
    p.add_argument("--cifar-limit", type=int, default=None, help="CIFAR samples per split")
    p.add_argument("--backends", default="cpu,dali,memory")
    p.add_argument("--trainer-epochs", type=int, default=2)
    p.add_argument("--trainer-timeout", type=int, default=150, help="seconds")
    p.add_argument("--trainer-args", default="", help="extra arguments for the trainer CLI")
    p.add_argument("--skip", default="", help="steps to skip, e.g. 'trainer,photo'")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.epochs, args.warmup, args.workers = 1, 1, min(args.workers, 2)
        args.photo_limit, args.photo_batch, args.photo_size = args.photo_limit or 24, 8, 64
        args.cifar_limit, args.cifar_batch = args.cifar_limit or 256, 64
        args.skip = ",".join(filter(None, [args.skip, "trainer"]))
    return args


# ---------------------------------------------------------------------------- data


class _FirstN:
    """The first `limit` samples of every split of a source (itself a `Source`)."""

    def __init__(self, source: Any, limit: int | None) -> None:
        self.source, self.limit = source, limit
        self.kind, self.classes = source.kind, source.classes

    def splits(self) -> dict[str, int]:
        sizes = self.source.splits()
        return {k: min(v, self.limit) if self.limit else v for k, v in sizes.items()}

    def item(self, split: str, index: int) -> Any:
        return self.source.item(split, index)

    def fingerprint(self) -> dict[str, Any]:
        return {**self.source.fingerprint(), "first_n": self.limit}


def shard(kind: str, path: Path, out: Path, limit: int | None, args) -> tuple[Manifest, float]:
    """Write the shards of a real dataset (or its first `limit` samples per split)."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: set FASTDATA_DATA_DIR to the real-data folder")
    t0 = time.perf_counter()
    source = _FirstN(open_source(kind, path), limit)
    max_count = 200 if kind == "folder" else 10_000  # several shards, so ranks / shuffles mix
    options = ShardOptions(max_count=max_count, workers=args.workers, progress=False)
    return write_shards(source, out, options), time.perf_counter() - t0


# ---------------------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryProbe:
    """Peak torch allocation and device-wide used memory (DALI's pools included) during a run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: list[float] = []
        if device.type != "cuda":
            return
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        self.base = self.used()

    def used(self) -> int:
        try:
            import pynvml  # optional: NVML's view, as nvidia-smi reports it

            pynvml.nvmlInit()
            index = self.device.index or 0
            return int(
                pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used
            )
        except Exception:  # noqa: BLE001 - no pynvml: the CUDA driver's free/total is the same
            free, total = torch.cuda.mem_get_info(self.device)
            return int(total - free)

    def sample(self) -> None:
        if self.device.type == "cuda":
            _sync(self.device)
            self.samples.append((self.used() - self.base) / MiB)

    def result(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {}
        return {
            "torch_peak_alloc_mib": round(torch.cuda.max_memory_allocated(self.device) / MiB, 1),
            "device_used_delta_mib": round(max(self.samples, default=0.0), 1),
            "device_used_after_epoch_mib": [round(s, 1) for s in self.samples],
        }


def time_epochs(
    loader: Any,
    ready: Callable[[Any], torch.Tensor],
    device: torch.device,
    args,
    probe: MemoryProbe,
    set_epoch: bool = True,
) -> dict[str, Any]:
    """Iterate `warmup + epochs` epochs; images/s over the timed ones (and after first batches)."""
    timed = []
    for epoch in range(args.warmup + args.epochs):
        if set_epoch and hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        _sync(device)
        t0 = time.perf_counter()
        images = first_images = 0
        first_s = None
        for batch in loader:
            n = ready(batch).shape[0]
            images += n
            if first_s is None:
                _sync(device)
                first_s, first_images = time.perf_counter() - t0, n
        _sync(device)
        seconds = time.perf_counter() - t0
        probe.sample()
        if epoch >= args.warmup:
            timed.append((images, seconds, first_s or 0.0, first_images))
    n, s = sum(t[0] for t in timed), sum(t[1] for t in timed)
    steady_n = n - sum(t[3] for t in timed)
    steady_s = s - sum(t[2] for t in timed)
    return {
        "images_per_epoch": timed[0][0] if timed else 0,
        "images_per_s": round(n / s, 1) if s else None,
        "steady_images_per_s": round(steady_n / steady_s, 1) if steady_s > 0 else None,
        "epoch_s": [round(t[1], 3) for t in timed],
        "first_batch_s": [round(t[2], 3) for t in timed],
    }


def to_device(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def close(loader: Any, device: torch.device) -> None:
    """Release a loader's memory the way a user would between runs."""
    inner = getattr(loader, "loader", loader)  # ShardDataModule wraps the backend's loader
    if hasattr(inner, "close"):
        inner.close()
    from fastdata.read import memory

    memory.clear_device_cache()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- (a) photo


def photo_run(backend: str, manifest: Manifest, device: torch.device, args) -> dict[str, Any]:
    """One backend on the photo train split: images/s until normalized floats on the device."""
    spec = LoaderSpec(
        manifest=manifest, split="train", train=True, batch_size=args.photo_batch, seed=0,
        num_workers=args.workers, image_size=args.photo_size, preset="photo",
        device=str(device), drop_last=True,
    )  # fmt: skip
    preset = get_preset("photo", args.photo_size)
    probe = MemoryProbe(device)
    t0 = time.perf_counter()
    loader = get_backend(backend)(spec)
    setup_s = time.perf_counter() - t0

    def ready(batch: Any) -> torch.Tensor:
        x, _ = to_device(batch, device)
        return x if loader.augmented else preset.apply(x, train=True)

    result = {"backend": backend, "setup_s": round(setup_s, 3)}
    result.update(time_epochs(loader, ready, device, args, probe))
    close(loader, device)
    probe.sample()
    result.update(probe.result())
    return result


# ---------------------------------------------------------------------------- (b) cifar


def cifar_run(backend: str, root: Path, device: torch.device, args) -> dict[str, Any]:
    """One backend on CIFAR-100 train, through the data module's on_after_batch_transfer."""
    from fastdata.datamodule import ShardDataModule

    probe = MemoryProbe(device)
    t0 = time.perf_counter()
    dm = ShardDataModule(
        root, batch_size=args.cifar_batch, num_workers=args.workers, prefetch_factor=2,
        backend=backend, preset="cifar", seed=0, drop_last=True,
    )  # fmt: skip
    dm.setup("fit")
    loader = dm.train_dataloader()
    setup_s = time.perf_counter() - t0

    def ready(batch: Any) -> torch.Tensor:
        return dm.on_after_batch_transfer(to_device(batch, device), 0)[0]

    result = {"backend": backend, "setup_s": round(setup_s, 3)}
    # The data module advances the epoch itself each time its loader is iterated.
    result.update(time_epochs(loader, ready, device, args, probe, set_epoch=False))
    close(loader, device)
    probe.sample()
    result.update(probe.result())
    return result


# ---------------------------------------------------------------------------- (d) trainer


def trainer_check(cifar_root: Path, args) -> dict[str, Any]:
    """The CIFAR-100 trainer CLI on one device, when it exists."""
    if importlib.util.find_spec("pipelines.cifar100.__main__") is None:
        return {"status": "skipped", "note": "no `python -m pipelines.cifar100` entry point yet"}
    cmd = [sys.executable, "-m", "pipelines.cifar100", "--model", "resnet9"]
    cmd += ["--epochs", str(args.trainer_epochs), "--devices", "1", *args.trainer_args.split()]
    # The data location: $FASTDATA_DATA_DIR (inherited) or `--trainer-args "--data DIR"`.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.trainer_timeout
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        return {"status": "timeout", "cmd": cmd, "wall_s": args.trainer_timeout, "tail": str(tail)}
    return {
        "status": "ok" if proc.returncode == 0 else "failed",
        "cmd": " ".join(cmd),
        "returncode": proc.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
        "tail": (proc.stdout + proc.stderr)[-3000:],
    }


# ---------------------------------------------------------------------------- report


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for name in ("lightning", "numpy", "nvidia.dali"):
        try:
            info[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as exc:  # noqa: BLE001 - a missing optional package is a fact to report
            info[name] = f"unavailable ({type(exc).__name__})"
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
        info["git_revision"] = rev.stdout.strip() or "none (no commit)"
    except OSError:
        info["git_revision"] = "unknown"
    return info


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# GPU check",
        "",
        f"{env['gpu'] or 'CPU only'}, {env['cpus']} CPUs, torch {env['torch']}, "
        f"DALI {env['nvidia.dali']}, git {env['git_revision'][:12]}",
        "",
        "| step | backend | images/s | steady images/s | epoch s | setup s | torch peak MiB "
        "| device used MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for step in ("photo", "cifar"):
        for r in report["steps"].get(step, []):
            if "error" in r:
                lines.append(f"| {step} | {r['backend']} | error: {r['error'][:60]} | | | | | |")
                continue
            lines.append(
                f"| {step} | {r['backend']} | {r['images_per_s']} | {r['steady_images_per_s']} | "
                f"{r['epoch_s']} | {r['setup_s']} | {r.get('torch_peak_alloc_mib', '-')} | "
                f"{r.get('device_used_delta_mib', '-')} |"
            )
    trainer = report["steps"].get("trainer", {})
    lines += ["", f"Trainer check: {trainer.get('status', 'not run')} {trainer.get('note', '')}"]
    lines += [f"Sharding: {report['steps'].get('shard_s', {})}", ""]
    return "\n".join(lines)


def _guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - one failing run must not hide the others
        traceback.print_exc()
        return {"backend": name, "error": f"{type(exc).__name__}: {exc}"}


def _backends(args, device: torch.device) -> Iterable[str]:
    from fastdata.read.dali import dali_available

    for name in args.backends.split(","):
        if name == "dali" and not dali_available():
            print("DALI is not installed: skipping the dali backend")
            continue
        yield name


def main(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda:0")
    if device.type == "cpu" and not args.cpu_smoke:
        print("no CUDA device: measuring the CPU paths only (use --cpu-smoke for tiny sizes)")
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"environment": environment(), "args": dict(vars(args)), "steps": {}}
    report["args"]["out"] = str(args.out)
    steps = report["steps"]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        os.environ.setdefault("FASTDATA_CACHE_DIR", str(Path(tmp) / "cache"))
        photos, shard_photo_s = shard(
            "folder", data_dir() / "clothing-small", Path(tmp) / "photo", args.photo_limit, args
        )
        cifar, shard_cifar_s = shard(
            "cifar100", data_dir() / "cifar-100-python.tar.gz", Path(tmp) / "cifar",
            args.cifar_limit, args,
        )  # fmt: skip
        steps["shard_s"] = {"photo": round(shard_photo_s, 1), "cifar": round(shard_cifar_s, 1)}
        backends = list(_backends(args, device))
        if "photo" not in skip:
            steps["photo"] = [
                _guarded(b, lambda b=b: photo_run(b, photos, device, args))
                for b in backends
                if b in ("cpu", "dali")
            ]
        if "cifar" not in skip:
            steps["cifar"] = [
                _guarded(b, lambda b=b: cifar_run(b, Path(cifar.root), device, args))
                for b in backends
            ]
        if "trainer" in skip:
            steps["trainer"] = {"status": "skipped", "note": "--skip trainer / --cpu-smoke"}
        else:
            steps["trainer"] = trainer_check(Path(cifar.root), args)
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    table = markdown(report)
    (args.out / "gpu_check.md").write_text(table)
    print(table)
    print(f"total {report['total_s']} s; wrote {args.out / 'gpu_check.json'}")
    return report


if __name__ == "__main__":
    main(parse_args())
