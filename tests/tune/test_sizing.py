"""The sizing rule on mocked probe figures."""

from __future__ import annotations

import os
import re

import pytest

from fastdata.tune.probe import Probe
from fastdata.tune.sizing import free_cores, size_loader

GiB = 2**30
MiB = 2**20


def _probe(busy=(0.0, 0.0, 0.0, 0.0), quota=None, memory=16 * GiB, rss=200 * MiB, cuda=False):
    affinity = tuple(range(len(busy)))
    usable = len(busy) if quota is None else min(len(busy), max(1, -int(-quota // 1)))
    return Probe(
        affinity=affinity,
        cgroup_quota=quota,
        usable_cores=usable,
        busy_total=tuple(busy),
        busy_others=tuple(busy),
        own_cores=0.0,
        window_s=0.5,
        available_bytes=memory,
        worker_rss_bytes=rss,
        cuda_available=cuda,
    )


def _size(probe, cost=1e-3, rate=None, batch=256, batch_bytes=1 * MiB, **kw):
    return size_loader(probe, cost, rate, batch, batch_bytes, **kw)


def test_idle_machine_unknown_rate_uses_every_idle_core():
    s = _size(_probe())
    # The loop's load is not measured at start-up: no whole core is kept for it.
    assert s.num_workers == 4
    assert s.persistent_workers and s.prefetch_factor == 2 and not s.pin_memory
    assert any("free cores 4.00" in r and "none kept (not measured)" in r for r in s.reasons)
    assert any("floor(4.00 idle cores)" in r and "not measured yet" in r for r in s.reasons)


def test_busy_cores_lower_the_worker_count():
    idle = _size(_probe())
    busy = _size(_probe(busy=(1.0, 1.0, 0.2, 0.0)))
    assert busy.num_workers < idle.num_workers
    assert busy.num_workers == 1  # 1.8 idle cores
    one_left = _size(_probe(busy=(1.0, 0.0)))  # 2 cores, another process keeps one busy
    assert one_left.num_workers == 0
    assert any("no second core for a worker" in r for r in one_left.reasons)


def test_a_given_reserve_keeps_cores_for_the_loop():
    busy = _size(_probe(busy=(1.0, 1.0, 0.2, 0.0)), main_cores=1.0)
    assert busy.num_workers == 0  # 0.8 + 1.0 - 1 = 0.8 free cores
    assert any("2.20 cores busy with other processes" in r for r in busy.reasons)
    assert any("less than one free core (0.80)" in r for r in busy.reasons)


def test_consumer_rate_sets_needed_workers():
    # 2,000 samples/s at 1 ms/sample = 2 cores of decoding -> 2 workers (3 are free).
    s = _size(_probe(busy=(0.0,) * 8), cost=1e-3, rate=2000)
    assert s.num_workers == 2
    assert any("workers needed 2" in r and "2.00 cores" in r for r in s.reasons)
    # More than the free cores: capped at floor(free) = 7.
    assert _size(_probe(busy=(0.0,) * 8), cost=1e-3, rate=20000).num_workers == 7


def test_main_process_alone_keeps_up():
    s = _size(_probe(), cost=1e-6, rate=10000)  # 1% of a core
    assert s.num_workers == 0 and not s.persistent_workers
    assert any("main process alone keeps up" in r and "1.0%" in r for r in s.reasons)
    assert s.dataloader_kwargs() == {"num_workers": 0, "pin_memory": False}


def test_cgroup_quota_and_affinity_are_respected():
    # 1.5 CPUs of quota on a 4-core affinity: at most 1 worker + the main process.
    s = _size(_probe(quota=1.5))
    assert s.num_workers <= 1
    assert any("2 usable cores (affinity 4, cgroup quota 1.50 CPUs)" in r for r in s.reasons)
    assert _size(_probe(busy=(0.0, 0.0))).num_workers == 2  # 2-core affinity, loop unmeasured
    assert _size(_probe(busy=(0.0, 0.0)), main_cores=1.0).num_workers == 1
    assert _size(_probe(busy=(0.0,))).num_workers == 0  # 1 core: nothing left beside the main


def test_least_loaded_cores_are_used_under_quota():
    # Quota 2 CPUs on 4 cores, two of them busy: the two idle ones are the usable ones.
    probe = _probe(busy=(1.0, 1.0, 0.0, 0.0), quota=2.0)
    assert free_cores(probe) == pytest.approx(1.0)


def test_low_memory_lowers_prefetch():
    def size(memory):
        return _size(_probe(memory=memory, rss=10 * MiB), batch_bytes=100 * MiB)

    assert size(16 * GiB).prefetch_factor == 2
    lower = size(2 * GiB)  # 512 MiB for 4 workers x p x 100 MiB: p = 1 fits
    assert lower.num_workers == 4 and lower.prefetch_factor == 1
    assert any("prefetch_factor 1" in r and "400 MiB fits" in r for r in lower.reasons)
    tight = size(1 * GiB)  # 256 MiB: even p = 1 does not fit
    assert tight.prefetch_factor == 1
    assert any("does NOT fit" in r and "1.00 GiB free memory" in r for r in tight.reasons)


def test_low_memory_lowers_workers():
    s = _size(_probe(memory=1 * GiB, rss=400 * MiB))  # 512 MiB budget -> 1 worker
    assert s.num_workers == 1
    assert any("lowered 4 -> 1" in r for r in s.reasons)


def test_variable_batch_cost_raises_prefetch():
    assert _size(_probe(), batch_cost_cv=0.9).prefetch_factor == 4
    assert _size(_probe(), batch_cost_cv=0.1).prefetch_factor == 2


def test_cuda_pins_memory_and_kwargs():
    s = _size(_probe(cuda=True))
    assert s.pin_memory
    assert s.dataloader_kwargs() == {
        "num_workers": 4,
        "pin_memory": True,
        "prefetch_factor": 2,
        "persistent_workers": True,
    }
    assert s.describe().startswith("num_workers=4 prefetch_factor=2")


def test_main_cores_is_the_reserve_for_the_training_loop():
    probe = _probe(busy=(0.0, 0.0))
    assert _size(probe).num_workers == 2  # not measured: the idle cores
    assert _size(probe, main_cores=1.0).num_workers == 1
    alone = _size(probe, main_cores=0)  # a loader benchmark: nothing else runs in the main process
    assert alone.num_workers == 2
    assert any("minus 0 for the main process" in r for r in alone.reasons)


@pytest.mark.parametrize(
    ("idle", "cost", "loop", "workers", "why"),
    [
        (1.2, None, None, 0, "no second core"),  # one core taken by another process
        (2.0, None, None, 2, "not measured yet"),
        (3.9, None, None, 3, "floor(3.90"),
        (2.0, 0.001, 0.1, 0, "in-line loading adds <= 5%"),
        # batch 60 ms, loop 20 ms, 2 cores: the best step is 40 ms -> 2 workers keep up.
        (2.0, 0.06, 0.02, 2, "2 workers keep up"),
        # compute-bound: batch 30 ms, loop 100 ms -> 1 worker.
        (4.0, 0.03, 0.1, 1, "1 workers keep up"),
        # a heavy batch on 8 cores: 8 x 20 ms... needs ceil(200 / 27.5) = 8, capped at 8.
        (8.0, 0.2, 0.02, 8, "at most 8"),
    ],
)
def test_workers_for_loop_from_injected_measurements(idle, cost, loop, workers, why):
    from fastdata.tune.sizing import workers_for_loop

    got, reason = workers_for_loop(idle, cost, loop)
    assert got == workers and why in reason


def test_ranks_per_node_share_the_cores():
    probe = _probe(busy=(0.0,) * 8)
    assert _size(probe, ranks_per_node=2).num_workers == 4  # 8 / 2, the loops unmeasured
    assert _size(probe, ranks_per_node=2, main_cores=1.0).num_workers == 3  # (8 - 2) / 2
    reserved = _size(probe, ranks_per_node=2, main_cores=1.0).reasons
    assert any("per rank (2 ranks" in r for r in reserved)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cost": -1.0}, "sample_cost_s"),
        ({"rate": 0.0}, "consumer_rate"),
        ({"batch": 0}, "batch_size"),
        ({"ranks_per_node": 0}, "ranks_per_node"),
    ],
)
def test_bad_inputs(kw, match):
    with pytest.raises(ValueError, match=match):
        _size(_probe(), **kw)


# ---- end to end on tiny real shards: tune(), auto_settings(), sweep, `fastdata tune` ----


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    import numpy as np

    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources.arrays import ArraySource

    pixels = np.random.default_rng(0).integers(0, 256, (96, 8, 8, 3), dtype=np.uint8)
    source = ArraySource({"train": (pixels, np.arange(96) % 4)}, classes=["a", "b", "c", "d"])
    out = tmp_path_factory.mktemp("tune") / "shards"
    return write_shards(source, out, ShardOptions(max_count=32, workers=1, progress=False))


def test_tune_on_shards_names_the_measurements(shards):
    from fastdata.tune import TuneOptions, tune

    s = tune(shards.root, batch_size=16, options=TuneOptions(window_s=0.05, n_batches=3)).settings
    assert 0 <= s.num_workers <= len(os.sched_getaffinity(0))
    assert s.persistent_workers == (s.num_workers > 0) and s.decode_threads == 1
    assert s.reasons[0].startswith("sample cost") and "KiB per sample" in s.reasons[0]
    assert any(r.startswith("free cores") for r in s.reasons)
    memory = tune(shards.root, backend="memory").settings
    assert memory.num_workers == 0 and "memory backend" in memory.reasons[0]


def test_tune_follows_the_injected_probe(shards):
    from fastdata.tune import TuneOptions, tune, tuning_spec

    spec = tuning_spec(shards, batch_size=16)
    options = TuneOptions(n_batches=2, main_cores=0.0)
    idle = tune(spec, options=options, probe=_probe(busy=(0.0,) * 4))
    busy = tune(spec, options=options, probe=_probe(busy=(1.0, 1.0, 1.0, 0.0)))
    assert idle.settings.num_workers == 4 and busy.settings.num_workers == 1  # unknown consumer
    assert idle.cost is not None and idle.cost.samples > 0


def test_auto_settings_is_cached_per_key(shards, monkeypatch):
    import time

    import fastdata.lightning.runtime as runtime
    import fastdata.tune as tune_mod

    calls = []
    real_probe = tune_mod.probe_system
    monkeypatch.setattr(tune_mod, "probe_system", lambda w: calls.append(w) or real_probe(w))
    runtime._AUTO_CACHE.clear()
    spec = tune_mod.tuning_spec(shards, batch_size=16)
    start = time.perf_counter()
    first = runtime.auto_settings(spec, ranks_per_node=1)
    assert time.perf_counter() - start < 5  # ~0.5 s; generous for a loaded test machine
    first.reasons.append("edited by the caller")
    again = runtime.auto_settings(spec, ranks_per_node=1)
    assert calls == [tune_mod.QUICK.window_s]  # the second call measured nothing
    assert again.num_workers == first.num_workers and "edited by the caller" not in again.reasons
    runtime.auto_settings(tune_mod.tuning_spec(shards, batch_size=8), ranks_per_node=1)
    assert len(calls) == 2  # another batch size is another key
    # Raw pixels: decode_threads "auto" times nothing and keeps one thread.
    assert runtime.auto_settings(spec, decode_threads="auto").decode_threads == 1
    assert runtime.auto_settings(spec, decode_threads=3).decode_threads == 3
    runtime._AUTO_CACHE.clear()


def test_sweep_and_table(shards):
    from fastdata.tune import sweep, tuning_spec
    from fastdata.tune.command import format_sweep

    points = sweep(tuning_spec(shards, batch_size=16), workers=(0, 1), prefetch=(1, 2), n_batches=3)
    assert [(p.num_workers, p.prefetch_factor) for p in points] == [(0, 1), (1, 1), (1, 2)]
    assert all(p.throughput.batches == 3 and p.samples_per_s > 0 for p in points)
    table = format_sweep(points, tuned=(1, 2))
    assert table.count("*") == 2  # the best row and the legend
    assert "< tuned" in table.splitlines()[4]


def test_cli_tune(shards, capsys, monkeypatch):
    from fastdata.cli import main
    from fastdata.tune import command

    monkeypatch.setattr(command, "SWEEP_WORKERS", (0, 1))
    monkeypatch.setattr(command, "SWEEP_PREFETCH", (2,))
    assert main(["tune", shards.root, "--batch-size", "16", "--batches", "3", "--sweep"]) == 0
    out = capsys.readouterr().out
    assert "usable cores" in out and "sample cost" in out
    assert "choice (for training, a core kept for the training loop): num_workers=" in out
    assert "loader alone, checked by measurement:" in out and "throughput with it:" in out
    assert "num_workers  prefetch" in out


class _Split:
    def __init__(self, encoding: str) -> None:
        self.encoding = encoding


class _Manifest:
    def __init__(self, encoding: str) -> None:
        self.encoding = encoding

    def split(self, name: str) -> _Split:
        return _Split(self.encoding)


class _Spec:
    """Just what `confirm` reads of a LoaderSpec: whether its split holds encoded photos."""

    def __init__(self, photos: bool) -> None:
        self.split = "train"
        self.manifest = _Manifest("jpeg" if photos else "raw")


@pytest.mark.parametrize("photos", [False, True])
def test_confirm_times_load_dependent_workers_and_decode_threads(monkeypatch, photos):
    import types

    import fastdata.tune.measure as measure_module
    from fastdata.tune.confirm import candidates, confirm_by_measurement
    from fastdata.tune.sizing import LoaderSettings

    base = LoaderSettings(2, 2, False, True, ["rule"])
    idle, busy = _probe(busy=(0.0, 0.0)), _probe(busy=(1.0, 0.0))
    if photos:  # threads join the candidates: processes, threads, or both
        assert candidates(base, idle, photos=True) == [
            (0, 1),
            (0, 2),
            (1, 2),
            (2, 1),
            (2, 2),
            (3, 1),
            (4, 1),
        ]
        assert candidates(base, idle, True, workers_only_from_rule=True) == [
            (0, 2),
            (1, 2),
            (2, 1),
            (2, 2),
        ]
    else:
        assert candidates(base, idle) == [(0, 1), (2, 1), (3, 1), (4, 1)]
        assert candidates(base, busy) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]
        # A trace of load on an idle core still leaves it free (rounded, not floored).
        assert candidates(LoaderSettings(1, 2, False, True), _probe(busy=(0.02, 0.0))) == [
            (0, 1),
            (1, 1),
            (2, 1),
            (3, 1),
            (4, 1),
        ]
        # No candidate beyond the memory: 3 workers' RSS fit in half of the free memory, not 4.
        tight = _probe(busy=(0.0, 0.0), memory=1200 * MiB, rss=200 * MiB)
        assert candidates(base, tight) == [(0, 1), (2, 1), (3, 1)]
    rates = {(0, 1): 900.0, (1, 1): 950.0, (2, 1): 700.0, (3, 1): 750.0, (4, 1): 800.0}
    rates.update({(0, 2): 990.0, (1, 2): 600.0, (2, 2): 650.0})
    timed = []

    def fake_measure(spec, workers, prefetch, n_batches, decode_threads=1):
        timed.append((workers, prefetch, decode_threads))
        return types.SimpleNamespace(samples_per_s=rates[(workers, decode_threads)])

    monkeypatch.setattr(measure_module, "measure_settings", fake_measure)
    chosen = confirm_by_measurement(_Spec(photos), base, idle)
    expected = (0, 2) if photos else (0, 1)  # main-process decoding on two threads wins
    assert (chosen.num_workers, chosen.decode_threads) == expected
    assert not chosen.persistent_workers and chosen.reasons[0] == "rule"
    assert f"{expected[0]} workers x {expected[1]} decode threads is fastest" in chosen.reasons[-1]
    if not photos:  # the load changed the answer
        assert confirm_by_measurement(_Spec(False), base, busy).num_workers == 1
    assert all(p == 2 for _, p, _ in timed)


def test_confirm_retimes_the_two_fastest_so_one_lucky_timing_does_not_win(monkeypatch):
    import types

    import fastdata.tune.measure as measure_module
    from fastdata.tune.confirm import FINAL_RETIMES, confirm_by_measurement
    from fastdata.tune.sizing import LoaderSettings

    base = LoaderSettings(2, 2, False, True, ["rule"])
    # 4 workers' first timing is lucky (1,500/s); timed again it runs at 700/s. 0 workers: 1,000/s.
    rates = {0: [1000.0] * 3, 2: [600.0] * 3, 4: [1500.0, 700.0, 700.0]}
    timed = []

    def fake_measure(spec, workers, prefetch, n_batches, decode_threads=1):
        timed.append(workers)
        return types.SimpleNamespace(samples_per_s=rates[workers].pop(0))

    monkeypatch.setattr(measure_module, "measure_settings", fake_measure)
    busy = _probe(busy=(1.0, 0.0))  # candidates 0, 1, 2, 3, 4 workers
    rates[1], rates[3] = [400.0] * 3, [500.0] * 3
    chosen = confirm_by_measurement(_Spec(False), base, busy)
    assert chosen.num_workers == 0
    assert "the fastest and those within 5% of them: medians of 3 timings" in chosen.reasons[-1]
    assert sorted(timed[5:]) == sorted([0, 4] * FINAL_RETIMES)  # only the finalists again


def test_confirm_retimes_a_candidate_the_finalists_medians_fell_below(monkeypatch):
    import types

    import fastdata.tune.measure as measure_module
    from fastdata.tune.confirm import FINAL_RETIMES, confirm_by_measurement
    from fastdata.tune.sizing import LoaderSettings

    base = LoaderSettings(2, 2, False, True, ["rule"])
    # The machine slows while 0 and 4 workers (the two fastest first timings) are re-timed: their
    # medians (600) fall below 2 workers' single timing (1,000), which holds when timed again.
    rates = {0: [1200.0, 600.0, 600.0], 1: [400.0], 2: [1000.0] * 3, 4: [1100.0, 600.0, 600.0]}
    rates[3] = [400.0]
    timed = []

    def fake_measure(spec, workers, prefetch, n_batches, decode_threads=1):
        timed.append(workers)
        return types.SimpleNamespace(samples_per_s=rates[workers].pop(0))

    monkeypatch.setattr(measure_module, "measure_settings", fake_measure)
    chosen = confirm_by_measurement(_Spec(False), base, _probe(busy=(1.0, 0.0)))
    assert chosen.num_workers == 2 and "is fastest" in chosen.reasons[-1]
    assert timed[5 + 2 * FINAL_RETIMES :] == [2] * FINAL_RETIMES  # then 2 alone, not 1 or 3


def test_confirm_breaks_a_tie_towards_fewer_threads_then_fewer_workers(monkeypatch):
    import types

    import fastdata.tune.measure as measure_module
    from fastdata.tune.confirm import TIE, confirm_by_measurement
    from fastdata.tune.sizing import LoaderSettings

    base = LoaderSettings(2, 2, False, True, ["rule"])
    idle = _probe(busy=(0.0, 0.0))  # photo candidates (0,1) (0,2) (1,2) (2,1) (2,2) (3,1) (4,1)
    rates = {(0, 1): 500.0, (0, 2): 600.0, (1, 2): 550.0, (2, 1): 930.0, (2, 2): 931.0}
    rates[(3, 1)], rates[(4, 1)] = 700.0, 700.0

    def fake_measure(spec, workers, prefetch, n_batches, decode_threads=1):
        return types.SimpleNamespace(samples_per_s=rates[(workers, decode_threads)])

    monkeypatch.setattr(measure_module, "measure_settings", fake_measure)
    chosen = confirm_by_measurement(_Spec(True), base, idle)
    assert (chosen.num_workers, chosen.decode_threads) == (2, 1)  # 931 vs 930: a tie
    assert "2 workers x 1 decode threads ties the fastest (within 5%)" in chosen.reasons[-1]
    rates[(2, 2)] = 930.0 / (1 - TIE) + 1  # clearly faster: two threads win
    chosen = confirm_by_measurement(_Spec(True), base, idle)
    assert (chosen.num_workers, chosen.decode_threads) == (2, 2)


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory):
    import numpy as np
    from PIL import Image

    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources import open_source

    folder = tmp_path_factory.mktemp("photos") / "train"
    rng = np.random.default_rng(0)
    for i in range(48):
        path = folder / f"c{i % 2}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(path)
    out = folder.parent / "shards"
    return write_shards(open_source("folder", folder), out, ShardOptions(workers=1, progress=False))


@pytest.mark.timeout(120)
def test_photo_splits_time_decode_threads_on_real_jpegs(photo_shards):
    # The real path, end to end: decode threads in the main process and in workers, timed.
    import fastdata.lightning.runtime as runtime
    import fastdata.tune as tune_mod

    runtime._AUTO_CACHE.clear()
    spec = tune_mod.tuning_spec(photo_shards, batch_size=8, image_size=32)
    chosen = runtime.auto_settings(spec, ranks_per_node=1, decode_threads="auto")
    timed = chosen.reasons[-1]
    # Real timings on a noisy machine: the winner is the fastest or ties it within 5%.
    assert timed.startswith("measured (")
    assert "decode threads is fastest" in timed or "decode threads ties the fastest" in timed
    rates = {
        (int(w), int(t)): float(r.replace(",", ""))
        for w, t, r in re.findall(r"(\d+) workers x (\d+) threads ([\d,.]+)/s", timed)
    }
    assert rates[(chosen.num_workers, chosen.decode_threads)] >= 0.949 * max(
        rates.values()
    )  # figures are rounded
    assert "x 2 threads" in timed  # thread candidates were timed beside processes
    assert chosen.decode_threads in (1, 2) and chosen.num_workers >= 0
    assert f"{chosen.num_workers} workers x {chosen.decode_threads} decode threads" in timed
    runtime._AUTO_CACHE.clear()
