"""The pure parts of benchmarks/bench_peers.py, in CI's venv, without the peers installed."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their siblings (common, peers_common, plot)
bench_peers = importlib.import_module("bench_peers")
peers_common = importlib.import_module("peers_common")


def _epochs(first: float, second: float, images: int = 1000) -> list[dict]:
    return [
        {
            "epoch": 1,
            "images": images,
            "seconds": images / first,
            "setup_s": 0.5,
            "img_per_s": first,
        },
        {
            "epoch": 2,
            "images": images,
            "seconds": images / second,
            "setup_s": 0.0,
            "img_per_s": second,
        },
    ]


def _table(cpu: float, peers: dict[str, float]) -> list[dict]:
    rows = [bench_peers.loader_row("fastdata cpu", _epochs(cpu / 2, cpu))]
    rows += [bench_peers.loader_row(name, _epochs(rate / 2, rate)) for name, rate in peers.items()]
    return rows


def test_loader_row_keeps_both_epochs_and_uses_epoch_two_as_the_rate():
    row = bench_peers.loader_row("x", _epochs(400.0, 800.0))
    assert row["epoch1_img_per_s"] == 400.0 and row["epoch2_img_per_s"] == 800.0
    assert row["img_per_s"] == 800.0  # steady state: what every epoch but the first sees
    assert row["setup_s"] == 0.5 and row["images"] == 2000


def test_loader_row_pools_the_epochs_after_the_first():
    epochs = _epochs(100.0, 1000.0) + [
        {"epoch": 3, "images": 1000, "seconds": 4.0, "setup_s": 0.0, "img_per_s": 250.0}
    ]
    row = bench_peers.loader_row("x", epochs)
    assert row["epoch2_s"] == 5.0 and row["epoch2_img_per_s"] == 400.0  # 2,000 images in 5 s
    assert bench_peers.loader_row("y", epochs[:1])["img_per_s"] == 100.0  # one epoch: epoch 1


def test_cpu_ratios_divide_fastdata_cpu_by_each_row_and_leave_skipped_rows_alone():
    rows = _table(1000.0, {"LitData (as README)": 200.0})
    rows.append({"method": "Streaming (as README)", "skipped": "no peers venv"})
    bench_peers.add_cpu_ratios(rows)
    assert rows[0]["cpu_vs_this"] == 1.0
    assert rows[1]["cpu_vs_this"] == 5.0
    assert "cpu_vs_this" not in rows[2]


def test_targets_say_met_not_met_and_not_measured():
    readme = {bench_peers.peer_method(lib, "readme"): 100.0 for lib in bench_peers.PEERS}
    engine = {bench_peers.peer_method("litdata", "engine"): 800.0}  # streaming engine: skipped
    cifar = _table(600.0, readme | engine)
    conversion = [
        {"dataset": "cifar", "method": "fastdata shard", "seconds": 10.0},
        {"dataset": "cifar", "method": "litdata.optimize", "seconds": 30.0},
    ]
    rows = {r["ratio"]: r for r in bench_peers.targets({"cifar": cifar}, conversion)}
    readme_lit = rows["cifar: fastdata cpu / LitData (as README)"]
    assert (readme_lit["epoch2"], readme_lit["epoch1"], readme_lit["met"]) == (6.0, 6.0, "yes")
    assert rows["cifar: fastdata cpu / LitData (engine-only)"]["met"] == "no"  # 0.75 < 1.5
    skipped = rows["cifar: fastdata cpu / Streaming (engine-only)"]
    assert skipped["epoch2"] is None and skipped["met"] is None
    assert rows["photo: fastdata cpu / LitData (as README)"]["met"] is None  # no photo table
    shard = rows["cifar conversion: litdata.optimize s / fastdata shard s"]
    assert (shard["epoch2"], shard["met"]) == (3.0, "yes")


def test_missing_peers_are_reported_as_skipped(tmp_path):
    absent = bench_peers.peer_problem(tmp_path / "no-venv" / "bin" / "python", "litdata")
    assert absent is not None and "setup_peers.sh" in absent
    row = bench_peers._attempt("LitData (as README)", absent, lambda: pytest.fail("ran"))
    assert row == {"method": "LitData (as README)", "skipped": absent}


@pytest.mark.skipif(
    importlib.util.find_spec("litdata") is not None, reason="litdata is installed here"
)
def test_a_venv_without_the_peer_reports_the_failed_import():
    problem = bench_peers.peer_problem(Path(sys.executable), "litdata")
    assert problem is not None and "import litdata" in problem


def test_a_failing_method_becomes_a_row_and_does_not_stop_the_others():
    def boom():
        raise RuntimeError("convert litdata cifar failed (exit 1): disk full")

    row = bench_peers._attempt("litdata.optimize", None, boom)
    assert row["method"] == "litdata.optimize"
    assert row["skipped"].startswith("failed: RuntimeError") and "disk full" in row["skipped"]
    assert bench_peers._attempt("m", None, lambda: {"seconds": 1.0}) == {
        "method": "m",
        "seconds": 1.0,
    }


def test_time_epochs_counts_images_and_charges_setup_to_epoch_one():
    def make_loader():
        time.sleep(0.05)
        return [[0] * 4, [0] * 4, [0] * 2]

    rows = peers_common.time_epochs(make_loader, len, epochs=2)
    assert [r["images"] for r in rows] == [10, 10]
    assert rows[0]["setup_s"] >= 0.05 and rows[1]["setup_s"] == 0.0
    assert rows[0]["seconds"] >= 0.05 > rows[1]["seconds"]
    cut = peers_common.time_epochs(make_loader, len, epochs=1, max_batches=2)
    assert cut[0]["batches"] == 2 and cut[0]["images"] == 8


def test_versions_mark_absent_libraries():
    found = peers_common.versions(["numpy", "surely-not-an-installed-package"])
    assert found["numpy"] != "-" and found["surely-not-an-installed-package"] == "-"


def test_charts_write_one_png_per_table(tmp_path):
    results = {
        "args": {"workers": 2},
        "cifar": _table(1000.0, {"LitData (as README)": 200.0}),
        "photo": [{"method": "LitData (as README)", "skipped": "no peers venv"}],
        "conversion": [{"dataset": "cifar", "method": "fastdata shard", "img_per_s": 4000.0}],
    }
    paths = bench_peers.charts(results, tmp_path)
    assert [p.name for p in paths] == [
        "bench_peers-cifar.png",
        "bench_peers-photo.png",
        "bench_peers-conversion.png",
    ]
    assert all(p.stat().st_size > 0 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_load_watcher_reports_other_busy_processes_but_not_its_own_children():
    import subprocess

    spin = "import time\nend = time.time() + {0}\nwhile time.time() < end: pass"
    # Margins for a loaded 2-core machine (xdist workers beside the two spinners): the spinners
    # outlast the watch, and 10% of a core is far above an idle process's share.
    child = subprocess.Popen([sys.executable, "-c", spin.format(5.0) + "  # own child"])
    # `sh` exits at once, so the second spinner is re-parented away from this process: "other".
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{spin.format(5.0)}" &'], check=True)
    time.sleep(0.5)  # both interpreters started
    with peers_common.LoadWatcher(interval=0.4, min_percent=10.0) as watcher:
        time.sleep(3.0)
    child.wait()
    summary = watcher.summary()
    assert summary["samples"] >= 3
    names = list(summary["other_busy"])
    assert any("while time.time() < end" in n and "own child" not in n for n in names), names
    assert not any("own child" in n for n in names), names


def test_command_name_keeps_the_arguments_whatever_the_interpreter_path():
    deep = "/tmp/" + "a/very/long/checkout/path/" * 8 + ".venv/bin/python"
    name = peers_common._command_name([deep, "-c", "while True: pass  # spinner"])
    assert name == "python -c while True: pass  # spinner"
    assert len(peers_common._command_name(["python", "x" * 500])) == 120
    assert peers_common._command_name(None) == peers_common._command_name([]) == ""
