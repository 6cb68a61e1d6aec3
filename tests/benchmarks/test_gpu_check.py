"""benchmarks/gpu_check.py in an environment like the bare GPU machine, on the CPU.

No ../shared data, no DALI, no webdataset: the dry run must still finish, with a row per step and
backend (ran, or skipped with its reason), written after every step, so a run killed halfway
leaves the steps done so far.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_parts  # noqa: E402
import gpu_report  # noqa: E402


def _bare_env(tmp_path: Path) -> dict[str, str]:
    """FASTDATA_DATA_DIR empty; `nvidia` (DALI) and `webdataset` raise ImportError on import."""
    blocked = tmp_path / "blocked"
    (blocked / "nvidia" / "dali").mkdir(parents=True)
    message = "raise ModuleNotFoundError('blocked: absent on the GPU machine')\n"
    (blocked / "nvidia" / "__init__.py").write_text(message)
    (blocked / "nvidia" / "dali" / "__init__.py").write_text(message)
    (blocked / "webdataset.py").write_text(message)
    (tmp_path / "no-data").mkdir()
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(blocked), str(REPO)]),
        "FASTDATA_DATA_DIR": str(tmp_path / "no-data"),
        "FASTDATA_CACHE_DIR": str(tmp_path / "cache"),
    }


def _smoke(out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), *extra]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_smoke_without_shared_dali_or_webdataset(tmp_path):
    env = _bare_env(tmp_path)
    probe = "import importlib.util as u; import webdataset"
    assert subprocess.run([sys.executable, "-c", probe], env=env).returncode != 0
    small = ("--photo-limit", "12", "--cifar-limit", "128")
    proc = subprocess.run(
        _smoke(tmp_path / "out", *small), env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["state"] == "complete"
    assert report["environment"]["nvidia.dali"].startswith("unavailable")
    rows = {(r["step"], r.get("dataset", r["backend"])): r for r in report["rows"]}
    for dataset in ("photo", "cifar"):
        assert rows[("shard", dataset)]["status"] == "ok"
        assert rows[("shard", dataset)]["source"].startswith("synthetic")
    expected = {
        ("photo", "cpu"): "ok",
        ("photo", "nvjpeg"): "skipped",
        ("photo", "dali"): "skipped",
        ("photo", "memory"): "skipped",
        ("cifar", "cpu"): "ok",
        ("cifar", "nvjpeg"): "skipped",
        ("cifar", "dali"): "skipped",
        ("cifar", "memory"): "ok",
        ("trainer", "-"): "skipped",
    }
    assert {k: rows[k]["status"] for k in expected} == expected
    assert "not installed" in rows[("photo", "dali")]["reason"]
    assert all(rows[k].get("reason") for k, v in expected.items() if v == "skipped")
    assert rows[("cifar", "memory")]["images_per_s"] > 0
    assert "not judged (no GPU)" in report["targets"]["memory_cifar_1m"]["result"]
    assert "| photo | dali | skipped |" in (tmp_path / "out" / "gpu_check.md").read_text()


@pytest.mark.timeout(600)
def test_a_killed_run_leaves_the_steps_done(tmp_path):
    out = tmp_path / "out"
    report_path = out / "gpu_check.json"
    proc = subprocess.Popen(
        _smoke(out, "--cifar-limit", "2000"),
        env=_bare_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not (report_path.exists() and json.loads(report_path.read_text())["rows"]):
            assert proc.poll() is None, "the run ended before its first step was written"
            assert time.monotonic() < deadline, "no step written in 300 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    report = json.loads(report_path.read_text())  # valid JSON: every write is a rename
    assert report["state"] == "running"
    assert report["rows"][0]["step"] == "shard" and report["rows"][0]["status"] == "ok"


# -- pieces ------------------------------------------------------------------------------------


def _row(step, backend, **figures):
    return {"step": step, "backend": backend, "status": "ok", **figures}


def test_targets_pass_fail_and_not_judged():
    rows = [
        _row("cifar", "memory", steady_images_per_s=1.2e6, data="real: x"),
        _row("photo", "cpu", images_per_s=1000.0),
        _row("photo", "nvjpeg", images_per_s=4000.0, energy_j_per_1k_images=2.5),
        _row("trainer", "-", test_top1=0.712, train_s=58.0),
    ]
    t = gpu_report.evaluate_targets(rows, "cuda")
    assert t["memory_cifar_1m"]["result"] == "pass"
    assert t["gpu_decode_5x"] == {"result": "fail", "figure": "nvjpeg 4.00x cpu"}
    assert t["trainer_70_in_60"]["result"] == "pass"
    assert t["energy_per_1k"]["result"] == "reported"
    rows[-1]["train_s"] = 61.0
    assert gpu_report.evaluate_targets(rows, "cuda")["trainer_70_in_60"]["result"] == "fail"
    assert gpu_report.evaluate_targets(rows, "cpu")["memory_cifar_1m"]["result"].startswith("not")


def test_report_is_rewritten_after_every_row(tmp_path):
    report = gpu_report.Report(tmp_path, {"torch": "x"}, {"out": tmp_path})
    report.add(_row("shard", "-"))
    assert json.loads((tmp_path / "gpu_check.json").read_text())["rows"][0]["step"] == "shard"
    report.finish(interrupted="photo/cpu hung")
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["state"] == "interrupted: photo/cpu hung"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md"]


def test_budget_spent_skips_the_next_steps(tmp_path):
    import gpu_check

    check = gpu_check.Check(gpu_check.parse_args(["--cpu-smoke", "--out", str(tmp_path)]))
    check.args.budget_s = 0
    assert check.step("photo", "cpu", lambda: pytest.fail("must not run")) is None
    assert (
        check.report.rows[-1]["status"] == "skipped" and "budget" in check.report.rows[-1]["reason"]
    )


def test_a_trainer_timeout_is_recorded_as_text(tmp_path, monkeypatch):
    import gpu_check
    from gpu_steps import Dataset

    (tmp_path / "slowtrainer").mkdir()
    (tmp_path / "slowtrainer" / "__init__.py").write_text("")
    main = "import time\nprint('epoch 1 started', flush=True)\ntime.sleep(60)\n"
    (tmp_path / "slowtrainer" / "__main__.py").write_text(main)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    argv = ["--out", str(tmp_path / "out"), "--trainer-module", "slowtrainer"]
    check = gpu_check.Check(gpu_check.parse_args([*argv, "--trainer-timeout", "3"]))
    cifar = Dataset("cifar", tmp_path, "real: test", {"train": 1}, 0.0)
    with pytest.raises(RuntimeError, match="timeout after 3 s: .*epoch 1 started"):
        gpu_check.run_trainer(check, cifar)
    log = (tmp_path / "out" / "trainer.log").read_text()
    assert "epoch 1 started" in log and "b'" not in log


def test_dali_available_is_false_for_a_broken_install(monkeypatch):
    from fastdata.read.backends.dali import loader

    def broken():
        raise OSError("libdali.so: undefined symbol cudaGetDriverEntryPointByVersion")

    monkeypatch.setattr(loader, "_dali", broken)
    assert loader.dali_available() is False


def test_parts_round_trip_and_md5_check(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_parts, "REPO", tmp_path)
    monkeypatch.setattr(gpu_parts, "DEVICE_PARTS", tmp_path / "stash")
    monkeypatch.setattr(gpu_parts, "DEVICE_DATA", tmp_path / "data")
    (tmp_path / gpu_parts.PARTS).mkdir()
    whole = tmp_path / "archive.tar.gz"
    whole.write_bytes(os.urandom(2_500_000))
    entry = gpu_parts.split(whole, "cifar", part_bytes=1_000_000)
    assert len(entry["parts"]) == 3
    (tmp_path / gpu_parts.PARTS / "parts.json").write_text(json.dumps({"cifar": entry}))
    assert gpu_parts.assemble(entry) is None  # nothing stashed yet
    for part in entry["parts"]:
        gpu_parts.main(["stash", part["path"]])
    joined = gpu_parts.assemble(entry)
    assert joined is not None and joined.read_bytes() == whole.read_bytes()
    (tmp_path / "stash" / "cifar.part01").write_bytes(b"corrupt")
    assert gpu_parts.assemble(entry) is None


def test_the_faster_gpu_decoder_is_judged_and_short_epochs_fall_back_to_whole_ones():
    rows = [
        _row("cifar", "memory", steady_images_per_s=None, images_per_s=1.1e6, data="real: x"),
        _row("photo", "cpu", images_per_s=1000.0),
        _row("photo", "dali", images_per_s=90.0),  # a pipeline built per epoch
        _row("photo", "nvjpeg", images_per_s=5200.0),
    ]
    t = gpu_report.evaluate_targets(rows, "cuda")
    assert t["gpu_decode_5x"] == {"result": "pass", "figure": "nvjpeg 5.20x cpu"}
    assert t["memory_cifar_1m"] == {"result": "pass", "figure": "1,100,000 img/s"}


def test_no_steady_rate_for_an_epoch_of_prefetched_batches():
    import torch
    from gpu_steps import STEADY_MIN_BATCHES, RunSettings, time_epochs

    class Loader:
        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            for _ in range(self.batches):
                yield torch.zeros(4, 1)

    class Probe:
        def sample(self, **_):
            pass

    settings = RunSettings(4, "none", None, 0, epochs=1, warmup=0, deadline=float("inf"),
                           loader_timeout_s=10.0)  # fmt: skip
    cpu = torch.device("cpu")
    short = time_epochs(Loader(6), lambda b: b, cpu, settings, Probe())
    assert short["steady_images_per_s"] is None and "too few" in short["steady_note"]
    long = time_epochs(Loader(STEADY_MIN_BATCHES), lambda b: b, cpu, settings, Probe())
    assert long["steady_images_per_s"] > 0 and long["steady_note"] is None
