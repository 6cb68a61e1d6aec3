"""fastdata against the loaders a Lightning user compares it with: LitData and MosaicML Streaming.

    bash benchmarks/setup_peers.sh                      # once: the peers' own venv, .venv-peers
    .venv/bin/python benchmarks/bench_peers.py --out DIR [--quick]

One run measures everything on the same input, so the ratios come from one run on one machine:
fastdata in this process (fastdata's venv), each peer in a subprocess with `.venv-peers/bin/python
benchmarks/peers_run.py` (the peers need a torchvision that does not load beside CI's torch, and
plain pillow, which must not sit beside Pillow-SIMD). A peer whose venv or import is missing is
reported as skipped, not fatal.

- Conversion: `fastdata shard` (`write_shards`), `litdata.optimize` and `MDSWriter` (the docs'
  parallel recipe), each with `--workers` processes, of CIFAR-100 (train + test) and of
  clothing-small (train, validation, test). Timed around the call, imports excluded.
- Loaders, `--workers` loader processes, epoch 1 timed apart from the later ones (epoch 1
  includes building the dataset and loader, and any cache; "epoch 2" is the steady state, pooled
  over epochs 2..N: `--epochs` 2 for CIFAR-100, `--photo-epochs` 4 for the 800-image photo split). An image counts when it is an
  augmented, normalized float batch ready for the model:
  - CIFAR-100 train, batch 256: pad-4 crop + flip + normalize;
  - clothing-small train, batch 64: 224 px random-resized-crop + flip + normalize.
  Peers two ways: "as README" (the torchvision pipeline per sample in the loader workers) and
  "engine-only" (the workers hand over uint8 samples, fastdata's batched augmentation runs on the
  batch after transfer, so the loaders themselves are compared). fastdata: `ShardDataModule`
  (backend "cpu", and "memory" for CIFAR-100), each batch through `transfer_batch_to_device` and
  `on_after_batch_transfer`, as Lightning calls them.
Targets (issue 11): fastdata cpu >= 5x each peer as README and >= 1.5x engine-only on CIFAR-100,
>= 1.5x each peer as README on clothing-small; `fastdata shard` of CIFAR-100 no slower than
`litdata.optimize` with the same number of processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import REPO, environment, print_table, results_dir, save_results  # noqa: I001
from fastdata_pipelines.env import data_dir
from peers_common import LoadWatcher, time_epochs

PEERS = ("litdata", "streaming")
PEER_NAMES = {"litdata": "LitData", "streaming": "Streaming"}
MODES = {"readme": "as README", "engine": "engine-only"}
DATASETS = {  # name -> (batch size, fastdata backends, what the table calls it)
    "cifar": (256, ("cpu", "memory"), "CIFAR-100 train, pad-4 crop + flip + normalize, batch 256"),
    "photo": (64, ("cpu",), "clothing-small train, 224 px RRC + flip + normalize, batch 64"),
}
LOADER_COLUMNS = [
    "method",
    "epoch1_img_per_s",
    "epoch2_img_per_s",
    "cpu_vs_this",
    "setup_s",
    "epoch1_s",
    "epoch2_s",
    "images",
    "skipped",
]
CONVERSION_COLUMNS = ["dataset", "method", "seconds", "img_per_s", "images", "skipped"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=data_dir())
    p.add_argument("--workers", type=int, default=2, help="loader and conversion processes")
    p.add_argument("--epochs", type=int, default=2, help="timed CIFAR-100 epochs per loader")
    p.add_argument(
        "--photo-epochs", type=int, default=4, help="timed clothing epochs (800 images each)"
    )
    p.add_argument("--peers-python", type=Path, default=REPO / ".venv-peers" / "bin" / "python")
    p.add_argument("--quick", action="store_true", help="smoke run: 10 batches an 'epoch'")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


# ------------------------------------------------------------------ pure parts (tested)


def peer_method(library: str, mode: str) -> str:
    """Table name of a peer run, e.g. "LitData (as README)"."""
    return f"{PEER_NAMES[library]} ({MODES[mode]})"


def loader_row(method: str, epochs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from `time_epochs`-style epoch records (epoch 1 first).

    "epoch2" pools epochs 2..N (images over seconds): the steady state a training run sees for
    every epoch but the first; more than one later epoch steadies the short photo epochs.
    """
    first, later = epochs[0], epochs[1:]
    row: dict[str, Any] = {
        "method": method,
        "images": sum(e["images"] for e in epochs),
        "setup_s": first.get("setup_s"),
        "epoch1_img_per_s": first["img_per_s"],
        "epoch1_s": first["seconds"],
    }
    if later:
        seconds = sum(e["seconds"] for e in later)
        row["epoch2_s"] = round(seconds, 3)
        row["epoch2_img_per_s"] = round(sum(e["images"] for e in later) / seconds, 1)
    row["img_per_s"] = row.get("epoch2_img_per_s", row["epoch1_img_per_s"])
    return row


def add_cpu_ratios(rows: list[dict[str, Any]], key: str = "img_per_s") -> None:
    """Set each row's `cpu_vs_this`: fastdata cpu's rate over the row's (same epoch: `key`)."""
    cpu = next((r.get(key) for r in rows if r["method"] == "fastdata cpu"), None)
    for row in rows:
        if cpu and row.get(key):
            row["cpu_vs_this"] = round(cpu / row[key], 2)


def _rate(rows: list[dict[str, Any]], method: str, key: str) -> float | None:
    return next((r.get(key) for r in rows if r["method"] == method), None)


def _div(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def targets(
    loaders: dict[str, list[dict[str, Any]]], conversion: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured ratio (epoch 2 and epoch 1) and whether met.

    A ratio whose peer was skipped or failed is None and `met` is None: not measured, not failed.
    """
    rows = []
    for dataset, mode, goal in (
        ("cifar", "readme", 5.0),
        ("cifar", "engine", 1.5),
        ("photo", "readme", 1.5),
        ("photo", "engine", None),
    ):
        table = loaders.get(dataset, [])
        for library in PEERS:
            peer = peer_method(library, mode)
            second, first = (
                _div(_rate(table, "fastdata cpu", k), _rate(table, peer, k))
                for k in ("epoch2_img_per_s", "epoch1_img_per_s")
            )
            rows.append(_target(f"{dataset}: fastdata cpu / {peer}", goal, second, first))
    shard = {r["method"]: r.get("seconds") for r in conversion if r["dataset"] == "cifar"}
    speed = _div(shard.get("litdata.optimize"), shard.get("fastdata shard"))
    rows.append(_target("cifar conversion: litdata.optimize s / fastdata shard s", 1.0, speed))
    return rows


def _target(name: str, goal: float | None, value: float | None, epoch1: float | None = None):
    met = None if value is None or goal is None else ("yes" if value >= goal else "no")
    return {"ratio": name, "target": goal, "epoch2": value, "epoch1": epoch1, "met": met}


# ------------------------------------------------------------------ peers (subprocesses)


def peer_problem(python: Path, library: str) -> str | None:
    """Why `library` cannot run in the peers' venv (None when it can)."""
    if not python.exists():
        return f"no peers venv at {python}; build it with `bash benchmarks/setup_peers.sh`"
    module = {"litdata": "litdata", "streaming": "streaming"}[library]
    check = subprocess.run(
        [str(python), "-c", f"import {module}, torchvision"], capture_output=True, text=True
    )
    if check.returncode:
        last = (check.stderr.strip().splitlines() or ["?"])[-1]
        return f"`import {module}, torchvision` failed in {python}: {last}"
    return None


def run_peer(args: argparse.Namespace, work: Path, *task: str) -> dict[str, Any]:
    """Run `peers_run.py <task...>` in the peers' venv and return its JSON result."""
    handle, name = tempfile.mkstemp(
        prefix=f"result-{'-'.join(task[:3])}-", suffix=".json", dir=work
    )
    os.close(handle)
    result = Path(name)
    command = [str(args.peers_python), str(REPO / "benchmarks" / "peers_run.py"), *task]
    command += ["--work", str(work), "--result", str(result), "--workers", str(args.workers)]
    env = os.environ | {"LITDATA_DISABLE_VERSION_CHECK": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{' '.join(task)} failed (exit {done.returncode}): {tail}"[:400])
    return json.loads(result.read_text())


# ------------------------------------------------------------------ fastdata (this process)


def fastdata_epochs(
    root: Path, backend: str, batch: int, epochs: int, args: argparse.Namespace, **kw: Any
) -> list[dict[str, Any]]:
    """Whole epochs of `ShardDataModule` through its public hooks; epoch 1 includes setup."""
    from fastdata.lightning.datamodule import ShardDataModule
    from fastdata.read import WorkerSettings

    cpu = torch.device("cpu")
    dm = ShardDataModule(
        root,
        batch_size=batch,
        backend=backend,
        workers=WorkerSettings(num_workers=args.workers, prefetch_factor="auto"),
        **kw,
    )

    def make_loader() -> Any:
        dm.setup("fit")
        return dm.train_dataloader()

    def consume(b: Any) -> int:
        x, _ = dm.on_after_batch_transfer(dm.transfer_batch_to_device(b, cpu, 0), 0)
        return x.shape[0]

    return time_epochs(make_loader, consume, epochs, 10 if args.quick else None)


# ------------------------------------------------------------------ suites


def _inputs(args: argparse.Namespace) -> dict[str, tuple[Path, str]]:
    """dataset -> (the input every library converts, fastdata's source kind for it)."""
    return {
        "cifar": (args.data / "cifar-100-python.tar.gz", "cifar100"),
        "photo": (args.data / "clothing-small", "folder"),
    }


def conversion_suite(
    args: argparse.Namespace, work: Path, problems: dict[str, str | None]
) -> list[dict[str, Any]]:
    """Convert each input with each library, `args.workers` processes each."""
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources import open_source

    def fastdata_shard(source: Path, kind: str, dataset: str) -> dict[str, Any]:
        options = ShardOptions(workers=args.workers, progress=False)
        start = time.perf_counter()
        manifest = write_shards(open_source(kind, source), work / f"fastdata-{dataset}", options)
        seconds = time.perf_counter() - start
        images = sum(split.num_samples for split in manifest.splits.values())
        return {
            "images": images,
            "seconds": round(seconds, 3),
            "img_per_s": round(images / seconds, 1),
        }

    rows = []
    for dataset, (source, kind) in _inputs(args).items():
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "fastdata shard": lambda s=source, k=kind, d=dataset: fastdata_shard(s, k, d)
        }
        for library, name in (("litdata", "litdata.optimize"), ("streaming", "MDSWriter")):
            runs[name] = lambda lib=library, d=dataset, s=source: run_peer(
                args, work, "convert", lib, d, "--source", str(s)
            )
        skip = {"litdata.optimize": problems["litdata"], "MDSWriter": problems["streaming"]}
        for name, run in runs.items():
            row = _attempt(name, skip.get(name), run)
            rows.append({"dataset": dataset, **{k: v for k, v in row.items() if k != "versions"}})
    return rows


def loader_suite(
    args: argparse.Namespace, work: Path, dataset: str, problems: dict[str, str | None]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Epochs of each loader on `dataset`; returns the rows and the peers' venv versions."""
    batch, backends, _ = DATASETS[dataset]
    epochs = args.epochs if dataset == "cifar" else args.photo_epochs
    extra = {"image_size": 224} if dataset == "photo" else {}
    runs: dict[str, tuple[str | None, Callable[[], dict[str, Any]]]] = {}
    for backend in backends:
        shards = work / f"fastdata-{dataset}"
        runs[f"fastdata {backend}"] = (
            None,
            lambda b=backend, s=shards: {
                "epochs": fastdata_epochs(s, b, batch, epochs, args, **extra)
            },
        )
    for library in PEERS:
        for mode in MODES:
            task = ["load", library, dataset, "--mode", mode, "--batch-size", str(batch)]
            task += ["--epochs", str(epochs)] + (["--max-batches", "10"] if args.quick else [])
            runs[peer_method(library, mode)] = (
                problems[library],
                lambda t=task: run_peer(args, work, *t),
            )
    rows, peer_versions = [], {}
    for name, (skip, run) in runs.items():
        outcome = _attempt(name, skip, run)
        peer_versions = outcome.pop("versions", None) or peer_versions
        timed = outcome.pop("epochs", None)
        rows.append(loader_row(name, timed) | outcome if timed else outcome)
        print(
            f"  {dataset}: {name}: {rows[-1].get('epoch1_img_per_s')} / "
            f"{rows[-1].get('epoch2_img_per_s')} img/s (epoch 1 / 2) {rows[-1].get('skipped', '')}"
        )
    add_cpu_ratios(rows)
    return rows, peer_versions


def _attempt(name: str, skip: str | None, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`'s result with the method's name; a skip reason or a failure becomes the row."""
    if skip:
        return {"method": name, "skipped": skip}
    try:
        return {"method": name, **run()}
    except Exception as exc:  # one failing method is reported, not fatal to the others
        return {"method": name, "skipped": f"failed: {type(exc).__name__}: {exc}"[:300]}


# ------------------------------------------------------------------ output


def charts(results: dict[str, Any], out: Path) -> list[Path]:
    """One PNG bar chart per table (plot.py's writer: no matplotlib)."""
    from plot import bar_chart

    written = []
    for dataset, (_, _, title) in DATASETS.items():
        labels, values = [], []
        for row in results[dataset]:
            for epoch in (1, 2):
                if row.get(f"epoch{epoch}_img_per_s"):
                    labels.append(f"{row['method']}, epoch {epoch}")
                    values.append(float(row[f"epoch{epoch}_img_per_s"]))
        path = out / f"bench_peers-{dataset}.png"
        written.append(
            bar_chart(f"{title} (img/s, higher is better)", labels, values, "img/s", path)
        )
    rows = [r for r in results["conversion"] if r.get("img_per_s")]
    written.append(
        bar_chart(
            f"Conversion with {results['args']['workers']} processes (img/s, higher is better)",
            [f"{r['dataset']}: {r['method']}" for r in rows],
            [float(r["img_per_s"]) for r in rows],
            "img/s",
            out / "bench_peers-conversion.png",
        )
    )
    return written


def _short(rows: list[dict[str, Any]], width: int = 90) -> list[dict[str, Any]]:
    """Rows with long skip reasons cut for the table (the JSON keeps them whole)."""
    return [r | {"skipped": r["skipped"][:width]} if r.get("skipped") else r for r in rows]


def main(args: argparse.Namespace) -> dict[str, Any]:
    out = results_dir(args.out)
    problems = {library: peer_problem(args.peers_python, library) for library in PEERS}
    at_start = environment()  # save_results records it again at the end: code may change between
    work = Path(tempfile.mkdtemp(prefix="bench_peers_"))
    try:
        with LoadWatcher() as watcher:
            conversion = conversion_suite(args, work, problems)
            cifar, peer_versions = loader_suite(args, work, "cifar", problems)
            photo, photo_versions = loader_suite(args, work, "photo", problems)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "args": vars(args) | {"data": str(args.data), "peers_python": str(args.peers_python)},
        "environment_at_start": at_start,
        "peers_environment": peer_versions or photo_versions,
        "machine_load": watcher.summary() | {"load_avg_at_end": os.getloadavg()},
        "conversion": conversion,
        "cifar": cifar,
        "photo": photo,
    }
    results["targets"] = targets({"cifar": cifar, "photo": photo}, conversion)
    tables = [
        print_table(_short(rows), LOADER_COLUMNS, f"{DATASETS[name][2]}, {args.workers} workers")
        for name, rows in (("cifar", cifar), ("photo", photo))
    ]
    tables.append(
        print_table(
            _short(conversion), CONVERSION_COLUMNS, f"Conversion, {args.workers} processes each"
        )
    )
    tables.append(
        print_table(results["targets"], ["ratio", "target", "epoch2", "epoch1", "met"], "Targets")
    )
    save_results("bench_peers", out, results, tables)
    for path in charts(results, out):
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main(parse_args())
