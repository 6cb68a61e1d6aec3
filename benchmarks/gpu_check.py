"""GPU check: steady loader rates per backend, start-up, CPU cost, device memory, auto, trainer.

    python benchmarks/gpu_check.py --out $OUT --budget-s 420    # one GPU (H100/H200: <= 8 min)
    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc     # dry run on the CPU, tiny sizes

How to bring the real data and DALI to a bare, offline GPU machine: `benchmarks/gpu_parts.py`
(the DALI wheels travel in parts < 60 MiB, stashed across calls of a warm machine).

Steps, in order (each one guarded: a failing, skipped or timed-out step is a row of the report,
never the end of the check; the report is rewritten after every step and at exit):

1. shard-photo: clothing-small (``$FASTDATA_DATA_DIR/clothing-small``; without it synthetic JPEGs
   of mixed sizes, labelled "synthetic") with its training photos linked over and over to
   ``--min-photos`` (25,600: 200 batches of 128; at 800 photos an epoch is 6 batches, all of
   them start-up and prefetched backlog), then sharded.
2. shard-cifar: ``cifar-100-python.tar.gz`` -> raw shards; without it, synthetic 32 x 32 arrays.
   Both are written before CUDA is first touched: the shard writer forks its workers.
3. photo: each backend on the train split at ``--photo-size`` random-resized crop until
   normalized floats are on the device: cpu (the baseline: ``--workers``, every core by
   default, its JPEG decoder named in its row), nvjpeg, dali. One loader is kept for two
   epochs (`gpu_steps.loader_run`): the first holds the start-up (a row of its own: setup,
   first batch, and the second epoch's first batch); the second gives the steady rate
   (`fastdata.read.steady.steady_rate`: after ``workers x prefetch`` + ``--warmup`` batches,
   over ``--measure`` = 150), the CPU core-seconds per 1,000 images of the process and its
   workers, and the device memory of each (nvidia-smi's compute apps, mid-window).
4. auto: what ``backend="auto"`` picks for those shards here, and its probe's figures.
5. cifar: CIFAR-100 train of cpu, memory and dali, the same way.
6. trainer: ``python -m pipelines.cifar100`` (module resolved at run time; ``--trainer-module``)
   on the shards of step 2, its output in a temporary folder; its metrics.json and log tail are
   copied to ``--out``.
7. video: clips/s of the DALI video loader (NVDEC) against the cpu one on H.264 clips made
   here (`gpu_video`); skipped with the reason without a GPU, PyAV or DALI.

Targets (`gpu_report.TARGETS`; pass / fail / not measured) are judged on steady rates only.

Time: ``--budget-s`` is checked between steps; a first epoch stops early past half the budget
left; every step also runs under a watchdog (``--step-timeout-s``, cut to the budget left) that,
when it fires, records the step as timed out, writes the report and ends the process, so a hung
loader loses nothing done before. Results in ``--out`` (default $OUT, else the current folder):
``gpu_check.json`` (environment, arguments, rows, targets) and ``gpu_check.md``.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # a checkout without `pip install -e`

import common  # noqa: E402
from fastdata_pipelines.env import data_dir  # noqa: E402
from gpu_report import Report, evaluate_targets  # noqa: E402
from gpu_steps import (  # noqa: E402
    Dataset,
    RunSettings,
    loader_run,
    open_real,
    replicate_photos,
    shard_dataset,
    synthetic_cifar,
    synthetic_photos,
)
from gpu_video import video_step  # noqa: E402

# The trainer recipe the 75%-in-10-s target is checked with (one H200, bf16, memory backend).
GPU_TRAINER_ARGS = (
    "--model resnet9 --width 64 --no-stem-pool --batch-size 512 --epochs 12 --lr 0.4 "
    "--backend memory --precision bf16-mixed --workers 0 --checkpoint-every 100000"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (dry run)")
    p.add_argument("--data-dir", type=Path, default=None, help="default: FASTDATA_DATA_DIR")
    p.add_argument("--budget-s", type=float, default=480.0, help="whole check, seconds")
    p.add_argument("--step-timeout-s", type=float, default=240.0, help="watchdog per step")
    p.add_argument("--loader-timeout-s", type=float, default=120.0, help="DataLoader timeout")
    p.add_argument("--measure", type=int, default=150, help="timed batches (second epoch)")
    p.add_argument("--warmup", type=int, default=4, help="batches skipped after the backlog")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="cpu: all cores")
    p.add_argument(
        "--min-photos", type=int, default=25_600,
        help="photos are replicated to at least this many training images (>= backlog + "
        "warm-up + measured batches)",
    )  # fmt: skip
    p.add_argument("--photo-batch", type=int, default=128)
    p.add_argument("--photo-size", type=int, default=224)
    p.add_argument("--photo-limit", type=int, default=None, help="synthetic photos (no real data)")
    p.add_argument("--cifar-batch", type=int, default=512)
    p.add_argument("--cifar-limit", type=int, default=None, help="CIFAR samples per split")
    p.add_argument(
        "--backends",
        default=",".join(_backend_order()),
        help="comma-separated registered backends (default: every one in fastdata.read.BACKENDS, "
        "cpu first)",
    )
    p.add_argument("--skip", default="", help="steps to skip, e.g. 'trainer,photo'")
    p.add_argument("--video-count", type=int, default=32, help="H.264 videos (step video)")
    p.add_argument("--video-seconds", type=float, default=8.0, help="length of each")
    p.add_argument("--trainer-module", default="pipelines.cifar100")
    p.add_argument("--trainer-args", default=GPU_TRAINER_ARGS)
    p.add_argument("--trainer-timeout", type=float, default=180.0, help="seconds")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.measure, args.warmup, args.workers = 4, 1, min(args.workers, 2)
        args.photo_limit, args.photo_batch, args.photo_size = args.photo_limit or 24, 8, 64
        args.min_photos = min(args.min_photos, 96)
        args.cifar_limit, args.cifar_batch = args.cifar_limit or 640, 64
        args.skip = ",".join(filter(None, [args.skip, "trainer"]))
    return args


# ---------------------------------------------------------------------------- guard


class Watchdog:
    """Ends the process when one step overruns: records it, writes the report, then exits."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self._timer: threading.Timer | None = None

    def arm(self, row: dict[str, Any], seconds: float) -> None:
        def fire() -> None:
            faulthandler.dump_traceback(all_threads=True)
            self.report.add({**row, "status": "timeout", "reason": f"watchdog: > {seconds:.0f} s"})
            self.report.finish(interrupted=f"{row['step']}/{row['backend']} hung")
            os._exit(3)

        self._timer = threading.Timer(max(seconds, 1.0), fire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class Check:
    """The run: arguments, device, report, budget, and the guarded steps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.skip = set(filter(None, args.skip.split(",")))
        gpu = torch.cuda.device_count() > 0 and not args.cpu_smoke  # NVML: no CUDA context yet
        self.device = torch.device("cuda:0" if gpu else "cpu")
        self.report = Report(args.out, environment(), vars(args))
        self.watchdog = Watchdog(self.report)
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        os.environ.setdefault("FASTDATA_CACHE_DIR", str(self.tmp / "cache"))

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def step(self, step: str, backend: str, fn: Callable[[], dict[str, Any]], **labels) -> Any:
        """Run one guarded step; returns fn's result (or None), after recording its row."""
        row = {"step": step, "backend": backend, **labels}
        if step in self.skip:
            return self.report.add({**row, "status": "skipped", "reason": f"--skip {step}"})
        if self.left_s() < 5:
            reason = f"budget: {self.args.budget_s:.0f} s spent"
            return self.report.add({**row, "status": "skipped", "reason": reason})
        self.watchdog.arm(row, min(self.args.step_timeout_s, self.left_s()))
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - one failing step must not hide the others
            traceback.print_exc()
            result = None
            row.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            self.watchdog.disarm()
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        if result is not None:
            figures = result if isinstance(result, dict) else result.row()
            row.update({"status": "ok", **figures})
        self.report.add(row)
        return result

    def skipped(self, step: str, backend: str, reason: str, **labels) -> None:
        self.report.add(
            {"step": step, "backend": backend, **labels, "status": "skipped", "reason": reason}
        )


def environment() -> dict[str, Any]:
    """benchmarks/common.py's record plus CUDA figures and imported module versions, read
    without creating a CUDA context."""
    extra: dict[str, Any] = {
        "torch": torch.__version__,  # gpu_report's header reads these two keys
        "cpus": os.cpu_count(),
        "torch_cuda": torch.version.cuda,
        "cuda_devices": torch.cuda.device_count(),
    }
    for name in ("lightning", "numpy", "torchvision", "nvidia.dali", "PIL"):
        try:
            extra[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as exc:  # noqa: BLE001 - a missing optional package is a fact to report
            extra[name] = f"unavailable ({type(exc).__name__})"
    return common.environment(extra)


# ---------------------------------------------------------------------------- steps


def shard_steps(check: Check) -> dict[str, Dataset | None]:
    """Steps 1 and 2: the photo and CIFAR shards (real when present, else synthetic)."""
    a, root = check.args, check.args.data_dir or data_dir()
    photo_dir, archive = root / "clothing-small", root / "cifar-100-python.tar.gz"

    def photos() -> Dataset:
        if photo_dir.exists():
            folder, origin = photo_dir, f"real: {photo_dir}"
        else:
            per_class = max(3, (a.photo_limit or 60) // 10)
            folder = synthetic_photos(check.tmp / "photos", per_class=per_class)
            origin = f"synthetic ({photo_dir} not found)"
        many, copies = replicate_photos(folder, check.tmp / "photos-x", a.min_photos)
        source = open_real("folder", many)
        data = shard_dataset("photo", source, origin, check.tmp / "photo", None, 1000)
        return Dataset(data.name, data.root, f"{origin}, x{copies}", data.samples, data.seconds)

    def cifar() -> Dataset:
        if archive.exists():
            source, origin = open_real("cifar100", archive), f"real: {archive}"
        else:
            n = a.cifar_limit or 50_000
            source, origin = synthetic_cifar(n, max(n // 5, 1)), f"synthetic ({archive} not found)"
        return shard_dataset("cifar", source, origin, check.tmp / "cifar", a.cifar_limit, 10_000)

    return {
        "photo": check.step("shard", "-", photos, dataset="photo"),
        "cifar": check.step("shard", "-", cifar, dataset="cifar"),
    }


def unavailable(backend: str, step: str, device: torch.device) -> str | None:
    """Why `backend` cannot run in `step` here (None: it can)."""
    if step == "photo" and backend == "memory":
        return "decodes once, then serves batches from memory: not a decode measurement"
    if step == "cifar" and backend == "nvjpeg":
        return "CIFAR shards hold raw pixels: nothing to decode"
    from fastdata.read import get_backend  # the registry's availability: one check for all

    if backend == "dali":
        ok, why = get_backend("dali").check()
        if not ok:
            return f"NVIDIA DALI is not installed or does not load ({why}; see gpu_parts.py)"
    if get_backend(backend).decodes_on_gpu and device.type != "cuda":
        return "needs a CUDA device" + (" (--cpu-smoke)" if torch.cuda.device_count() else "")
    if backend == "nvjpeg":
        ok, why = get_backend("nvjpeg").check()
        return None if ok else why
    return None


def loader_steps(check: Check, step: str, data: Dataset | None) -> None:
    """Step 3 or 4: one row per backend (ran, failed, or skipped with its reason)."""
    a = check.args
    photo = step == "photo"
    labels = {"data": data.source if data else "none"}
    for backend in a.backends.split(","):
        reason = "its shards were not written" if data is None else None
        reason = reason or unavailable(backend, step, check.device)
        if reason:
            check.skipped(step, backend, reason, **labels)
            continue
        settings = RunSettings(
            batch_size=a.photo_batch if photo else a.cifar_batch,
            preset="photo" if photo else "cifar",
            image_size=a.photo_size if photo else None,
            workers=a.workers, warmup=a.warmup, measure=a.measure,
            deadline=time.monotonic() + max(check.left_s() / 2 - 5, 0),
            loader_timeout_s=a.loader_timeout_s,
        )  # fmt: skip
        energy = gpu_energy(check.device)
        extra = baseline_labels(a) if backend == "cpu" else {}
        result = check.step(
            step,
            backend,
            lambda b=backend, s=settings, e=energy: loader_run(b, data.root, check.device, s, e),
            **labels,
            **extra,
        )
        if result is not None:  # start-up in a row of its own
            keys = ("setup_s", "first_batch_s", "epoch2_first_batch_s")
            row = {"step": "startup", "backend": backend, "dataset": step, "status": "ok"}
            check.report.add({**row, **{k: result.get(k) for k in keys}})


def baseline_labels(a: argparse.Namespace) -> dict[str, Any]:
    """The cpu baseline's fixed settings, recorded in its row: the JPEG decoder, the workers
    (every core of the machine by default), the cores."""
    from fastdata.read.decoders.image import jpeg_region_decoder

    decoder = jpeg_region_decoder() or "Pillow (whole-image decode; fastdata._jpeg not built)"
    return {"decoder": decoder, "workers": a.workers, "cores": os.cpu_count()}


def auto_step(check: Check, data: Dataset | None) -> None:
    """What `backend="auto"` picks for the photo shards on this device, and why (its probe)."""
    if data is None or check.device.type != "cuda":
        return check.skipped("auto", "-", "needs a GPU and the photo shards")

    def choose() -> dict[str, Any]:
        from fastdata.augment import get_preset
        from fastdata.format.manifest_io import load_manifest
        from fastdata.read.backends.auto import choose_backend

        a = check.args
        # A tiny memory share: the split "does not fit", so the GPU decoders' probe decides, as
        # for a dataset larger than the device's memory.
        name, reason = choose_backend(
            load_manifest(data.root), "train", str(check.device), a.photo_size,
            preset=get_preset("photo", a.photo_size), memory_share=1e-9,
        )  # fmt: skip
        return {"chose": name, "reason": reason}

    check.step("auto", "-", choose, data=data.source)


def _backend_order() -> list[str]:
    """Every registered backend: cpu first (the baseline the others' rows are read against), the
    resident ones (memory) last."""
    from fastdata.read import BACKENDS

    return sorted(BACKENDS, key=lambda name: (name != "cpu", BACKENDS[name].resident))


def gpu_energy(device: torch.device) -> Callable[[], float | None] | None:
    """NVML's total-energy counter of `device` in joules, or None without NVML."""
    from fastdata.tune.monitor import GpuReader

    reader = GpuReader.open(device)
    return reader.energy_j if reader is not None and reader.energy_j() is not None else None


def trainer_step(check: Check, cifar: Dataset | None) -> None:
    """Step 5: the CIFAR-100 pipeline on the shards of step 2, on one device."""
    a, step = check.args, "trainer"
    if "trainer" in check.skip:
        return check.skipped(step, "-", "--skip trainer (or --cpu-smoke)")
    if importlib.util.find_spec(a.trainer_module.split(".")[0]) is None or (
        importlib.util.find_spec(a.trainer_module) is None
    ):
        return check.skipped(step, "-", f"no module {a.trainer_module!r} in this checkout")
    if cifar is None or not cifar.real:
        return check.skipped(step, "-", "needs the real CIFAR-100 shards (see gpu_parts.py)")
    check.step(step, "-", lambda: run_trainer(check, cifar), data=cifar.source)


def run_trainer(check: Check, cifar: Dataset) -> dict[str, Any]:
    a, work = check.args, check.tmp / "trainer"
    work.mkdir(parents=True, exist_ok=True)
    (work / "shards").symlink_to(cifar.root, target_is_directory=True)  # reused, not re-sharded
    cmd = [sys.executable, "-m", a.trainer_module, "--out", str(work), "--devices", "1"]
    cmd += shlex.split(a.trainer_args)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    timeout = max(min(a.trainer_timeout, check.left_s() - 5), 1)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=timeout)
        out, status = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:  # its output is bytes (or None): decode it
        out, status = (exc.stdout or b"") + (exc.stderr or b""), f"timeout after {timeout:.0f} s"
    text = out.decode("utf-8", "replace") if isinstance(out, bytes) else str(out)
    (a.out / "trainer.log").write_text(text[-200_000:])
    result: dict[str, Any] = {"cmd": shlex.join(cmd), "returncode": status, "tail": text[-1500:]}
    metrics_path = work / "metrics.json"
    if metrics_path.exists():
        (a.out / "trainer_metrics.json").write_text(metrics_path.read_text())
        result.update(trainer_figures(metrics_path))
    if status != 0:
        raise RuntimeError(f"trainer exited with {status}: {text[-800:]}")
    return result


def trainer_figures(path: Path) -> dict[str, Any]:
    import json

    metrics = json.loads(path.read_text())
    rows = metrics.get("epochs") or [{}]
    return {
        "test_top1": metrics.get("final_test_top1"),
        "train_s": sum(row.get("train_s") or 0.0 for row in rows),  # the whole fit, all epochs
        "epochs": len(metrics.get("epochs") or []),
        "precision": metrics.get("precision"),
    }


# ---------------------------------------------------------------------------- main


def main(args: argparse.Namespace) -> dict[str, Any]:
    check = Check(args)
    if check.device.type == "cpu" and not args.cpu_smoke:
        print("no CUDA device: measuring the CPU paths only (use --cpu-smoke for tiny sizes)")
    try:
        data = shard_steps(check)  # before CUDA is touched: the writer forks
        if check.device.type == "cuda":
            check.report.environment["gpu"] = torch.cuda.get_device_name(check.device)
        for step in ("photo", "cifar"):
            if step in check.skip:
                check.skipped(step, "*", f"--skip {step}")
            else:
                loader_steps(check, step, data[step])
            if step == "photo" and step not in check.skip:
                auto_step(check, data["photo"])
        trainer_step(check, data["cifar"])
        video_step(check)
    finally:
        check.report.targets = evaluate_targets(check.report.rows, check.device.type)
        check.report.finish()
    print(check.report.markdown())
    print(f"total {time.monotonic() - check.t0:.1f} s; wrote {args.out / 'gpu_check.json'}")
    return check.report.data()


if __name__ == "__main__":
    main(parse_args())
