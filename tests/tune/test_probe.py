"""Probe readings: cgroup parsing, per-core load of other processes, sample cost timing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fastdata.tune import measure_throughput
from fastdata.tune.measure import measure_sample_cost
from fastdata.tune.probe import (
    DEFAULT_READERS,
    WORKER_RSS_FALLBACK_BYTES,
    parse_cfs_quota,
    parse_cpu_max,
    probe_system,
    read_cgroup_cpu_quota,
    read_cgroup_memory_free,
)


def _readers(percents, affinity=(0, 1, 2, 3), quota=None, own=(0.0, 0.0), memory=8 * 2**30):
    own_iter = iter(own)
    return dataclasses.replace(
        DEFAULT_READERS,
        affinity=lambda: set(affinity),
        cgroup_quota=lambda: quota,
        cpu_percent=lambda w: list(percents),
        own_cpu_seconds=lambda: next(own_iter),
        available_memory=lambda: memory,
        worker_rss=lambda: 100 * 2**20,
        cuda_available=lambda: False,
    )


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("150000 100000\n", 1.5), ("max 100000\n", None), ("200000 50000", 4.0)],
)
def test_parse_cpu_max(text, cpus):
    assert parse_cpu_max(text) == cpus


def test_parse_cfs_quota():
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("50000\n", "100000\n") == 0.5


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_own_cgroup(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/job/step\n")
    _write(tmp_path / "cg" / "job" / "step" / "cpu.max", "150000 100000\n")
    _write(tmp_path / "cg" / "cpu.max", "max 100000\n")
    assert read_cgroup_cpu_quota(tmp_path / "cg", proc) == 1.5


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/x\n2:cpu,cpuacct:/\n")
    _write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_quota_us", "250000\n")
    _write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert read_cgroup_cpu_quota(tmp_path / "cg", proc) == 2.5
    _write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert read_cgroup_cpu_quota(tmp_path / "cg", proc) is None
    assert read_cgroup_cpu_quota(tmp_path / "absent", proc) is None


def test_cgroup_memory_free(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/x\n")
    _write(tmp_path / "cg" / "memory" / "x" / "memory.limit_in_bytes", f"{4 * 2**30}\n")
    _write(tmp_path / "cg" / "memory" / "x" / "memory.usage_in_bytes", f"{1 * 2**30}\n")
    _write(tmp_path / "cg" / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(tmp_path / "cg" / "memory" / "memory.usage_in_bytes", "5\n")
    assert read_cgroup_memory_free(tmp_path / "cg", proc) == 3 * 2**30


def test_probe_separates_own_load_from_others():
    # 4 cores: core 0 fully busy, core 1 half; we used 0.5 cores ourselves (0.25 s over 0.5 s).
    probe = probe_system(0.5, _readers([100, 50, 0, 0], own=(10.0, 10.25)))
    assert probe.usable_cores == 4
    assert probe.busy_total == (1.0, 0.5, 0.0, 0.0)
    assert probe.own_cores == pytest.approx(0.5, rel=0.05)
    # Our 0.5 cores are taken off in proportion: others = 1.5 - 0.5 = 1.0 core in total.
    assert sum(probe.busy_others) == pytest.approx(1.0, rel=0.05)
    assert probe.busy_others[0] > probe.busy_others[1] > 0


def test_probe_reads_only_affinity_cpus_and_caps_by_quota():
    probe = probe_system(0.1, _readers([100, 100, 10, 20, 0, 0], affinity=(2, 3), quota=1.5))
    assert probe.affinity == (2, 3)
    assert probe.busy_total == (0.1, 0.2)
    assert probe.usable_cores == 2
    probe = probe_system(0.1, _readers([0] * 8, affinity=range(8), quota=0.5))
    assert probe.usable_cores == 1


def test_probe_rejects_bad_window():
    with pytest.raises(ValueError, match="window_s"):
        probe_system(0, _readers([0]))


def test_real_probe_runs_and_is_sane():
    probe = probe_system(0.05)
    assert 1 <= probe.usable_cores <= len(probe.affinity)
    assert all(0.0 <= b <= 1.0 for b in probe.busy_others)
    assert probe.available_bytes > 0
    assert probe.worker_rss_bytes > 0
    assert "usable cores" in probe.describe()
    assert WORKER_RSS_FALLBACK_BYTES > 0


class _FakeClock:
    """Wall and CPU clocks that only move when a batch "takes" time: timing tests that do not
    depend on how busy the machine is (real sleeps failed under load)."""

    def __init__(self) -> None:
        self.wall, self.cpu = 1000.0, 10.0

    def sleep(self, seconds: float) -> None:
        self.wall += seconds


@pytest.fixture
def clock(monkeypatch) -> _FakeClock:
    import types

    import fastdata.tune.measure as measure_module
    import fastdata.tune.probe as probe_module

    fake = _FakeClock()
    fake_time = types.SimpleNamespace(
        perf_counter=lambda: fake.wall,
        process_time=lambda: fake.cpu,
        sleep=fake.sleep,
        time=lambda: fake.wall,
        monotonic=lambda: fake.wall,
    )
    monkeypatch.setattr(probe_module, "time", fake_time)
    monkeypatch.setattr(measure_module, "time", fake_time)
    monkeypatch.setattr(_SleepyLoader, "clock", fake)
    return fake


class _SleepyLoader:
    """Batches of `size` samples; batch i takes `delays[i]` seconds on the clock, 1 ms of it CPU."""

    clock: _FakeClock | None = None  # set by the `clock` fixture

    def __init__(self, delays, size=4):
        self.delays, self.size = delays, size

    def __iter__(self):
        for d in self.delays:
            self.clock.sleep(d + 0.001)
            self.clock.cpu += 0.001
            yield (
                torch.zeros(self.size, 3, 8, 8, dtype=torch.uint8),
                torch.zeros(self.size, dtype=torch.int64),
            )


def test_measure_sample_cost_skips_warmup_and_counts_bytes(clock):
    cost = measure_sample_cost(lambda: _SleepyLoader([0.2, 0.01, 0.01, 0.01]), n_batches=3)
    assert cost.batches == 3 and cost.samples == 12
    assert cost.warmup_s >= 0.2  # the slow first batch was the warm-up
    assert 0.03 <= cost.wall_s < 0.2
    assert cost.wall_s_per_sample == pytest.approx(cost.wall_s / 12)
    assert cost.cpu_s_per_sample <= cost.wall_s_per_sample + 0.01  # sleeping is not CPU time
    assert cost.bytes_per_sample == 3 * 8 * 8 + 8
    assert not cost.includes_warmup


def test_measure_sample_cost_variation_and_short_split(clock):
    steady = measure_sample_cost(lambda: _SleepyLoader([0.0] + [0.01] * 4), n_batches=4)
    varied = measure_sample_cost(
        lambda: _SleepyLoader([0.0, 0.001, 0.05, 0.001, 0.05]), n_batches=4
    )
    assert varied.batch_cv > 0.5 > steady.batch_cv
    # One batch stalled by another process is not "batches vary".
    stalled = measure_sample_cost(lambda: _SleepyLoader([0.0] + [0.01] * 7 + [0.2]), n_batches=8)
    assert stalled.batch_cv < 0.5
    short = measure_sample_cost(lambda: _SleepyLoader([0.01]), n_batches=4)
    assert short.includes_warmup and short.batches == 1
    with pytest.raises(ValueError, match="no batch"):
        measure_sample_cost(lambda: _SleepyLoader([]), n_batches=1)


def test_measure_sample_cost_time_budget(clock):
    cost = measure_sample_cost(
        lambda: _SleepyLoader([0.0] + [0.05] * 20), n_batches=20, time_budget_s=0.1
    )
    assert 2 <= cost.batches <= 3


def test_measure_throughput(clock):
    result = measure_throughput(_SleepyLoader([0.1] + [0.02] * 5), n_batches=5, warmup=1)
    assert result.batches == 5 and result.samples == 20
    assert result.startup_s >= 0.1
    assert 20 / 0.2 < result.samples_per_s < 20 / 0.1
    short = measure_throughput(_SleepyLoader([0.0] * 3), n_batches=5, warmup=1)
    assert short.batches == 2 and short.notes


def test_measure_throughput_counts_with_the_callers_consumer(clock):
    # The benchmarks' form: every batch (warm-up included) goes through `count`, which does the
    # consumer's work and says how many samples it held; None times until the loader ends.
    seen = []

    def count(batch):
        seen.append(batch)
        clock.sleep(0.01)  # the consumer's own work is inside the timed span
        return 3

    result = measure_throughput(_SleepyLoader([0.0] * 6), None, warmup=2, count=count)
    assert len(seen) == 6 and result.batches == 4 and result.samples == 12
    # each batch also takes 1 ms on the loader side
    assert result.seconds == pytest.approx(4 * (0.01 + 0.001)) and not result.notes
