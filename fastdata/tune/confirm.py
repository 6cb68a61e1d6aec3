"""Check a sizing by measurement: time a few load-dependent worker counts and keep the fastest.

The sizing rule (`fastdata.tune.sizing`) has no term for the cost of moving a batch from a
worker process to the main process. When samples are cheap (raw CIFAR: ~15 us each), that cost
dominates and loading in the main process beats any number of workers; when decoding is
expensive (JPEG photos), more workers than cores can win because the main process's receiving
work overlaps theirs. Both were measured (benchmarks/bench_tune.py), and neither is predicted
well from the sample cost alone, so the answer is checked on the machine as it is now.
"""

from __future__ import annotations

import dataclasses

from fastdata.read.base import LoaderSpec
from fastdata.tune.probe import Probe
from fastdata.tune.sizing import LoaderSettings, free_cores

__all__ = ["candidate_workers", "confirm_by_measurement"]


def candidate_workers(settings: LoaderSettings, probe: Probe, main_cores: float = 0.0) -> list[int]:
    """Worker counts worth timing: none, the rule's choice, the free cores, and free + usable.

    They follow the measured load: with one of two cores busy the candidates are {0, 1, 3}
    (and the rule's choice), on an idle 2-core machine {0, 2, 4}.
    """
    free = int(free_cores(probe, main_cores=main_cores))
    return sorted({0, settings.num_workers, max(1, free), free + probe.usable_cores})


def confirm_by_measurement(
    spec: LoaderSpec,
    settings: LoaderSettings,
    probe: Probe,
    n_batches: int = 6,
    main_cores: float = 0.0,
) -> LoaderSettings:
    """The fastest of `candidate_workers` (at the rule's prefetch), with the timings as reasons."""
    from fastdata.tune import measure_settings  # the package imports this module lazily

    timed = {}
    for workers in candidate_workers(settings, probe, main_cores):
        result = measure_settings(spec, workers, settings.prefetch_factor, n_batches)
        timed[workers] = result.samples_per_s
    best = max(timed, key=timed.get)
    figures = ", ".join(f"{w} workers {rate:,.0f}/s" for w, rate in timed.items())
    reasons = [*settings.reasons, f"measured ({figures}): {best} workers is fastest"]
    return dataclasses.replace(
        settings, num_workers=best, persistent_workers=best > 0, reasons=reasons
    )
