"""The GPU check's report: rows written after every step, targets judged from them.

`Report.add` rewrites ``gpu_check.json`` and ``gpu_check.md`` each time, atomically (a temporary
file in the same folder, then a rename), so a check killed at any moment (SIGKILL included)
leaves a valid report of the steps done so far.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["TARGETS", "Report", "evaluate_targets"]

#: name -> what it checks (the figures come from the rows, see `evaluate_targets`). Rates are
#: steady rates: the second epoch of a kept loader, after its backlog and warm-up
#: (`fastdata.read.steady`); start-up is judged on its own.
TARGETS = {
    "memory_cifar_1m": "memory backend >= 1,000,000 img/s on CIFAR-100 train (steady)",
    "gpu_2x_cpu": "best GPU backend >= 2x the cpu backend (every core as a worker), photos, steady",
    "gpu_15k": "best GPU backend >= 15,000 img/s on photos at 224 px (steady)",
    "gpu_cpu_cost": "best GPU backend's CPU core-seconds per image <= 1/8 of the cpu backend's",
    "dali_ge_nvjpeg": "dali steady >= nvjpeg steady on photos",
    "auto_picks_faster": "backend='auto' picks the faster measured GPU backend",
    "epoch2_first_batch": "the second epoch's first batch in <= 50 ms (best GPU backend)",
    "trainer_75_in_10": "ResNet-9 CIFAR-100 >= 75% test top-1 in <= 10 s of training",
    "energy_per_1k": "GPU energy per 1,000 samples (NVML) reported",
}

#: The rate columns of the report's main table: (row key, header).
COLUMNS = (
    ("steady_images_per_s", "steady img/s"),
    ("epoch1_images_per_s", "epoch 1 img/s"),
    ("cpu_core_s_per_1k_images", "CPU core-s / 1k img"),
    ("device_mib_main", "device MiB (main)"),
    ("device_mib_workers", "device MiB (workers)"),
    ("torch_peak_alloc_mib", "torch peak MiB"),
    ("device_used_after_close_mib", "after close MiB"),
    ("energy_j_per_1k_images", "J / 1k img"),
)


class Report:
    """Environment, arguments, one row per step and backend, targets; written on every change.

    Args:
        out: the output folder (created).
        environment: versions and host.
        args: the check's arguments.
    """

    def __init__(self, out: Path, environment: dict[str, Any], args: dict[str, Any]) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.environment = environment
        self.args = {k: str(v) if isinstance(v, Path) else v for k, v in args.items()}
        self.rows: list[dict[str, Any]] = []
        self.targets: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        self.state = "running"
        self._lock = threading.Lock()  # the watchdog thread may write too

    def add(self, row: dict[str, Any]) -> None:
        """Append a row and rewrite the report."""
        with self._lock:
            self.rows.append(row)
            self._write()

    def finish(self, interrupted: str | None = None) -> None:
        """Mark the report complete (or interrupted, with why) and write it."""
        with self._lock:
            self.state = f"interrupted: {interrupted}" if interrupted else "complete"
            self._write()

    def data(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "elapsed_s": round(time.time() - self.started, 1),
            "environment": self.environment,
            "args": self.args,
            "rows": self.rows,
            "targets": self.targets,
        }

    def _write(self) -> None:
        _atomic_write(self.out / "gpu_check.json", json.dumps(self.data(), indent=1, default=str))
        _atomic_write(self.out / "gpu_check.md", self.markdown())

    def markdown(self) -> str:
        env = self.environment
        lines = [
            "# GPU check",
            "",
            f"{env.get('gpu') or 'no GPU used'}, {env.get('cpus')} CPUs, torch {env.get('torch')}, "
            f"DALI {env.get('nvidia.dali')}, torchvision {env.get('torchvision')}, "
            f"git {str(env.get('git_revision'))[:12]}; {self.state}",
            "",
            "| step | backend | status | " + " | ".join(h for _, h in COLUMNS) + " | note |",
            "|---|---|---|" + "---|" * len(COLUMNS) + "---|",
        ]
        startup = []
        for r in self.rows:
            if r["step"] == "startup":
                startup.append(r)
                continue
            cells = [r["step"] + (f" ({r['dataset']})" if "dataset" in r else ""), r["backend"]]
            cells += [r.get("status", "")] + [_cell(r.get(k)) for k, _ in COLUMNS]
            lines.append("| " + " | ".join([*cells, _note(r)]) + " |")
        if startup:
            lines += [
                "",
                "| start-up | backend | setup s | first batch s | epoch 2 first batch s |",
            ]
            lines.append("|---|---|---|---|---|")
            for r in startup:
                keys = ("setup_s", "first_batch_s", "epoch2_first_batch_s")
                cells = [str(r.get("dataset")), r["backend"], *(_cell(r.get(k)) for k in keys)]
                lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "| target | result | figure |", "|---|---|---|"]
        for name, t in self.targets.items():
            lines.append(f"| {TARGETS[name]} | {t['result']} | {t.get('figure', '')} |")
        return "\n".join(lines) + "\n"


def _note(r: dict[str, Any]) -> str:
    note = r.get("reason") or r.get("error") or r.get("steady_note") or ""
    if r["step"] == "trainer" and r.get("status") == "ok":
        note = f"top-1 {r.get('test_top1')}, {r.get('train_s')} s training"
    elif r["step"] == "auto" and r.get("status") == "ok":
        note = f"chose {r.get('chose')}: {r.get('reason')}"
    elif r.get("decoder"):
        base = f"{r['decoder']}, {r.get('workers')} workers on {r.get('cores')} cores"
        note = f"{base}; {note}" if note else base
    note = note or r.get("data") or r.get("source") or ""
    return str(note)[:160].replace("|", "/")


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- targets


def _find(rows: list[dict[str, Any]], step: str, backend: str) -> dict[str, Any] | None:
    for r in rows:
        if r["step"] == step and r["backend"] == backend and r.get("status") == "ok":
            return r
    return None


def _judge(ok: bool, figure: str, comparable: str | None) -> dict[str, Any]:
    if comparable:
        return {"result": f"not judged ({comparable})", "figure": figure}
    return {"result": "pass" if ok else "fail", "figure": figure}


def _steady(rows: list[dict[str, Any]], step: str, backend: str) -> dict[str, Any] | None:
    row = _find(rows, step, backend)
    return row if row is not None and row.get("steady_images_per_s") else None


def evaluate_targets(rows: list[dict[str, Any]], device_type: str) -> dict[str, dict[str, Any]]:
    """Each target of `TARGETS`: pass / fail / not measured (why), with its figure."""
    off_gpu = "no GPU" if device_type != "cuda" else None
    out: dict[str, dict[str, Any]] = {}
    mem = _steady(rows, "cifar", "memory")
    if mem is None:
        out["memory_cifar_1m"] = {"result": "not measured (no steady memory row on CIFAR)"}
    else:
        rate = mem["steady_images_per_s"]
        synthetic = "synthetic data" if "synthetic" in str(mem.get("data")) else None
        out["memory_cifar_1m"] = _judge(rate >= 1e6, f"{rate:,.0f} img/s", off_gpu or synthetic)
    cpu = _steady(rows, "photo", "cpu")
    gpus = {b: r for b in ("dali", "nvjpeg") if (r := _steady(rows, "photo", b))}
    best = max(gpus.values(), key=lambda r: r["steady_images_per_s"]) if gpus else None
    out.update(_gpu_targets(cpu, best, gpus, off_gpu))
    auto = next((r for r in rows if r["step"] == "auto" and r.get("status") == "ok"), None)
    if auto is None or best is None:
        out["auto_picks_faster"] = {"result": "not measured (needs the auto row and a GPU row)"}
    else:
        figure = f"auto chose {auto.get('chose')}; fastest measured {best['backend']}"
        out["auto_picks_faster"] = _judge(auto.get("chose") == best["backend"], figure, off_gpu)
    out["trainer_75_in_10"] = _trainer_target(rows, off_gpu)
    energies = [r["energy_j_per_1k_images"] for r in rows if r.get("energy_j_per_1k_images")]
    out["energy_per_1k"] = (
        {"result": "reported", "figure": f"{min(energies)}-{max(energies)} J per 1k images"}
        if energies
        else {"result": "not measured (no NVML energy counter)"}
    )
    return out


def _gpu_targets(
    cpu: dict[str, Any] | None,
    best: dict[str, Any] | None,
    gpus: dict[str, dict[str, Any]],
    off_gpu: str | None,
) -> dict[str, dict[str, Any]]:
    """The photo targets of the best GPU backend (steady rates), against the cpu baseline."""
    out: dict[str, dict[str, Any]] = {}
    missing = {"result": "not measured (needs steady cpu and dali or nvjpeg photo rows)"}
    if best is None:
        none = {"result": "not measured (no steady GPU photo row)"}
        names = ("gpu_2x_cpu", "gpu_15k", "gpu_cpu_cost", "epoch2_first_batch", "dali_ge_nvjpeg")
        return {name: dict(none) for name in names}
    name, rate = best["backend"], best["steady_images_per_s"]
    out["gpu_15k"] = _judge(rate >= 15_000, f"{name} {rate:,.0f} img/s", off_gpu)
    if cpu is None:
        out["gpu_2x_cpu"] = out["gpu_cpu_cost"] = missing
    else:
        ratio = rate / cpu["steady_images_per_s"]
        out["gpu_2x_cpu"] = _judge(ratio >= 2, f"{name} {ratio:.2f}x cpu", off_gpu)
        mine, base = best.get("cpu_core_s_per_1k_images"), cpu.get("cpu_core_s_per_1k_images")
        if mine is None or not base:
            out["gpu_cpu_cost"] = {"result": "not measured (no CPU seconds in the rows)"}
        else:
            share = mine / base
            figure = f"{name} {mine:.3f} vs cpu {base:.3f} core-s per 1k images ({share:.2f}x)"
            out["gpu_cpu_cost"] = _judge(share <= 1 / 8, figure, off_gpu)
    first = best.get("epoch2_first_batch_s")
    out["epoch2_first_batch"] = (
        {"result": "not measured (no second epoch)"}
        if first is None
        else _judge(first <= 0.05, f"{name} {first * 1e3:.1f} ms", off_gpu)
    )
    if len(gpus) < 2:
        out["dali_ge_nvjpeg"] = {"result": f"not measured (only {', '.join(gpus)} ran)"}
    else:
        d, n = gpus["dali"]["steady_images_per_s"], gpus["nvjpeg"]["steady_images_per_s"]
        out["dali_ge_nvjpeg"] = _judge(d >= n, f"dali {d:,.0f} vs nvjpeg {n:,.0f} img/s", off_gpu)
    return out


def _trainer_target(rows: list[dict[str, Any]], off_gpu: str | None) -> dict[str, Any]:
    run = next((r for r in rows if r["step"] == "trainer"), None)
    if run is None or run.get("test_top1") is None:
        why = (run or {}).get("reason") or (run or {}).get("error") or "no trainer row"
        return {"result": f"not measured ({str(why)[:120]})"}
    top1, seconds = run["test_top1"], run.get("train_s") or float("inf")
    figure = f"{top1:.2%} in {seconds:.1f} s"
    return _judge(top1 >= 0.75 and seconds <= 10, figure, off_gpu)
