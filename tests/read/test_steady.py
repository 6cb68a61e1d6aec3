"""`steady_rate`: the backlog a loader prefetched is never reported as throughput."""

from __future__ import annotations

import pytest
import torch

from fastdata.read.steady import batch_images, steady_rate


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def backlogged(clock: FakeClock, startup: float, backlog: int, rate: float, batches: int):
    """A loader whose workers made `backlog` batches while the first was awaited: those arrive
    at once, then one every ``1 / rate`` seconds (batches of 128 images)."""
    clock.t += startup
    for k in range(batches):
        if k > backlog:
            clock.t += 1.0 / rate
        yield torch.zeros(128, 1), torch.zeros(128)


def test_a_backlog_is_not_throughput():
    clock = FakeClock()
    loader = backlogged(clock, startup=2.0, backlog=32, rate=10.0, batches=400)
    got = steady_rate(loader, backlog=32, warmup=4, measure=150, clock=clock)
    assert got.images_per_s == pytest.approx(1280.0)  # 10 batches/s of 128
    assert got.batches == 150 and got.images == 150 * 128 and got.skipped == 36
    assert got.first_batch_s == pytest.approx(2.0)
    # Timing from the first batch, as the 2026-12-04 check did, counts the backlog:
    clock2 = FakeClock()
    naive = steady_rate(backlogged(clock2, 2.0, 32, 10.0, 40), backlog=0, warmup=1, measure=38,
                        clock=clock2)  # fmt: skip
    assert naive.images_per_s > 5 * 1280


def test_too_few_batches_give_no_rate_and_say_why():
    clock = FakeClock()
    got = steady_rate(backlogged(clock, 1.0, 4, 10.0, 6), backlog=4, warmup=2, measure=150,
                      clock=clock)  # fmt: skip
    assert got.images_per_s is None and got.batches == 0
    assert "gave 6 batches: 6 to skip (4 backlog + 2 warm-up), then 150 to time" in got.reason


def test_cpu_seconds_per_thousand_images_over_the_window_only():
    clock = FakeClock()
    cpu = FakeClock()

    def loader():
        for batch in backlogged(clock, 1.0, 0, 100.0, 20):
            cpu.t += 0.5  # half a CPU second a batch of 128, start-up included
            yield batch

    got = steady_rate(loader(), backlog=0, warmup=2, measure=10, clock=clock, cpu_clock=cpu)
    assert got.cpu_s_per_1k == pytest.approx(1e3 * 0.5 / 128)
    assert got.images_per_s == pytest.approx(12800.0)


def test_arguments_and_batch_shapes():
    with pytest.raises(ValueError, match="measure >= 1"):
        steady_rate([], backlog=0, warmup=0, measure=0)
    assert batch_images({"image": torch.zeros(5, 3), "label": torch.zeros(5)}) == 5
    assert batch_images([torch.zeros(7, 1), torch.zeros(7)]) == 7
