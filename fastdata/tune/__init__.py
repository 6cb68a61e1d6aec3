"""Measured loader sizing: one decision, `tune`.

    from fastdata.tune import tune
    result = tune("shards/cifar100", batch_size=256)  # or tune(spec) for a LoaderSpec
    print(result.settings.describe())                 # the choice, then one reason per line

| task | entry point |
|---|---|
| workers, prefetch (and, timed, decode threads) at start-up | `tune(spec or shard folder, ...)` |
| the same for `ShardDataModule()` (its default `workers=None`) | `tune(spec, options=QUICK)`, cached by `fastdata.lightning.runtime.auto_settings` |
| torch intra-op threads at start-up | `choose_threads(requested, processes)` |
| threads, workers and prefetch again at each epoch end | `recheck(...)`, run by `LoaderMonitor` |
| time a loader / the CPU backend at settings / a grid | `measure_throughput`, `measure_settings`, `sweep` |

The rule itself is `fastdata.tune.sizing.size_loader`; the timed check of candidates is
`fastdata.tune.confirm`; the load-following re-check is `fastdata.tune.follow`; `LoaderMonitor`
lives in `fastdata.tune.monitor` (it imports Lightning).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

from fastdata.augment.presets import default_preset
from fastdata.format.manifest import Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.read.base import LoaderSpec
from fastdata.tune.confirm import confirm_by_measurement, decodes_photos
from fastdata.tune.follow import recheck
from fastdata.tune.load import choose_threads
from fastdata.tune.measure import (
    SampleCost,
    SweepPoint,
    Throughput,
    measure_settings,
    measure_spec_cost,
    measure_throughput,
    sweep,
)
from fastdata.tune.probe import Probe, probe_system
from fastdata.tune.sizing import LoaderSettings, size_loader

__all__ = [
    "QUICK",
    "LoaderSettings",
    "SweepPoint",
    "Throughput",
    "TuneOptions",
    "TuneResult",
    "choose_threads",
    "measure_settings",
    "measure_throughput",
    "recheck",
    "sweep",
    "tune",
    "tuning_spec",
]

# Batches faster than this are timed mostly by scheduler jitter: their spread says nothing about
# the data, so it does not raise the prefetch depth.
MIN_BATCH_S_FOR_CV = 0.01


@dataclass(frozen=True)
class TuneOptions:
    """How much `tune` measures.

    Args:
        window_s: seconds over which the core load is measured.
        n_batches: most batches timed for the sample cost (after one warm-up batch).
        batch_cap: time batches of at most this many samples (a sample costs the same in a
            small batch); None: the spec's batch size.
        time_budget_s: stop timing the sample cost after this many seconds of batches.
        consumer_rate: samples/s the training step consumes; None = unknown (use free cores).
        main_cores: cores kept for the training process (0: the loader alone, as in a
            benchmark; None: the loop's load is not measured yet, `sizing.workers_for_loop`).
        confirm: time candidates (`fastdata.tune.confirm`) after the rule: "none"; "threads":
            for photo splits, the decode-thread pairs and the rule's worker count; "all": also
            the load-dependent worker counts.
        confirm_batches: batches timed per candidate.
    """

    window_s: float = 0.5
    n_batches: int = 8
    batch_cap: int | None = None
    time_budget_s: float | None = None
    consumer_rate: float | None = None
    main_cores: float | None = None
    confirm: Literal["none", "threads", "all"] = "none"
    confirm_batches: int = 6


#: What `ShardDataModule`'s "auto" measures (`fastdata.lightning.runtime.auto_settings`): well under ~2 s (0.2 s window, <= 0.4 s of batches).
QUICK = TuneOptions(window_s=0.2, n_batches=4, batch_cap=32, time_budget_s=0.4)


def tuning_spec(
    manifest_or_root: Manifest | str | os.PathLike[str],
    split: str = "train",
    batch_size: int = 256,
    preset: str = "auto",
    image_size: int | None = None,
) -> LoaderSpec:
    """The LoaderSpec (rank 0 of 1, epoch 0, no workers) that tuning measures.

    preset "auto" and image_size None resolve as in ShardDataModule
    (`fastdata.augment.default_preset`): raw images keep their size ("cifar" preset when small),
    photos are cropped to 224 ("photo").
    """
    manifest = (
        manifest_or_root
        if isinstance(manifest_or_root, Manifest)
        else load_manifest(manifest_or_root)
    )
    info = manifest.split(split)
    default, image_size = default_preset(info.raw_shape, image_size)
    if preset == "auto":
        preset = default
    return LoaderSpec(
        manifest=manifest,
        split=split,
        train=split == "train",
        batch_size=batch_size,
        image_size=image_size,  # the CPU backend and ShardDataModule use a side length
        preset=preset,
        drop_last=False,
    )


@dataclass(frozen=True)
class TuneResult:
    """What `tune` measured and chose.

    Args:
        settings: the chosen settings with their reasons.
        probe: the machine's figures (None for backends without workers).
        cost: the measured sample cost (None for backends without workers).
    """

    settings: LoaderSettings
    probe: Probe | None = None
    cost: SampleCost | None = None


def tune(
    what: LoaderSpec | Manifest | str | os.PathLike[str],
    backend: str = "cpu",
    *,
    split: str = "train",
    batch_size: int = 256,
    preset: str = "auto",
    image_size: int | None = None,
    ranks_per_node: int | None = None,
    options: TuneOptions | None = None,
    probe: Probe | None = None,
) -> TuneResult:
    """Probe the machine, time samples with the CPU backend, size the loader.

    The rule (`size_loader`) turns free cores, memory and the sample cost into workers and
    prefetch; with `options.confirm` the fastest of a few (workers, decode threads) candidates
    is then kept (`confirm_by_measurement`; decode threads only for photo splits).

    Args:
        what: the loader's spec (its worker settings are ignored), or a Manifest or shard folder
            whose `split` is measured (`tuning_spec` with `split`, `batch_size`, `preset`,
            `image_size`; those four are ignored for a spec).
        backend: the registered backend the settings are for (`fastdata.read.BACKENDS`; for
            dali the workers are its CPU threads, a backend without workers needs none).
        split: split to measure (a folder or manifest).
        batch_size: samples per batch (a folder or manifest).
        preset: augmentation preset ("auto" resolves as in ShardDataModule).
        image_size: output side of variable-size photos (default 224).
        ranks_per_node: training processes sharing this machine (default: $LOCAL_WORLD_SIZE
            or 1; pass `trainer.num_devices` under Lightning's own launcher, which does not set it).
        options: how much to measure (default `TuneOptions()`; `QUICK` for start-up).
        probe: the machine's figures, when already read (default: `probe_system(window_s)`).
    """
    spec = (
        what
        if isinstance(what, LoaderSpec)
        else tuning_spec(what, split, batch_size, preset, image_size)
    )
    options = options or TuneOptions()
    if not _uses_workers(backend):
        return TuneResult(_no_workers(backend))
    probe = probe or probe_system(options.window_s)
    cap = options.batch_cap or spec.batch_size
    measured = dataclasses.replace(spec, batch_size=min(spec.batch_size, cap))
    cost = measure_spec_cost(
        measured, n_batches=options.n_batches, time_budget_s=options.time_budget_s
    )
    ranks = ranks_per_node if ranks_per_node is not None else _node_ranks()
    settings = _rule(probe, cost, spec.batch_size, backend, ranks, options)
    photos = backend == "cpu" and decodes_photos(spec)
    if options.confirm == "all" or (options.confirm == "threads" and photos):
        settings = confirm_by_measurement(
            spec,
            settings,
            probe,
            n_batches=options.confirm_batches,
            main_cores=options.main_cores or 0.0,
            workers_only_from_rule=options.confirm == "threads",
        )
    return TuneResult(settings, probe, cost)


def _node_ranks() -> int:
    """Training processes on this machine: $LOCAL_WORLD_SIZE (torchrun) or 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _rule(
    probe: Probe,
    cost: SampleCost,
    batch_size: int,
    backend: str,
    ranks_per_node: int,
    options: TuneOptions,
) -> LoaderSettings:
    """`size_loader` on measured figures, with the sample cost as the first reason.

    A batch-time spread is only passed on when batches take at least `MIN_BATCH_S_FOR_CV`."""
    settings = size_loader(
        probe,
        cost.cpu_s_per_sample,
        options.consumer_rate,
        batch_size,
        int(cost.bytes_per_sample * batch_size),
        batch_cost_cv=_meaningful_cv(cost),
        ranks_per_node=ranks_per_node,
        main_cores=options.main_cores,
    )
    settings.reasons.insert(
        0,
        f"sample cost {cost.cpu_s_per_sample * 1e6:.1f} us CPU ({cost.wall_s_per_sample * 1e6:.1f} us "
        f"wall) over {cost.samples} samples, {cost.bytes_per_sample / 1024:.1f} KiB per sample",
    )
    if backend == "dali":
        settings.reasons.append(
            "dali: num_workers is the DALI CPU thread count, sized from the CPU decode cost"
        )
    return settings


def _meaningful_cv(cost: SampleCost) -> float:
    if cost.batches < 3 or cost.wall_s / cost.batches < MIN_BATCH_S_FOR_CV:
        return 0.0
    return cost.batch_cv


def _uses_workers(backend: str) -> bool:
    """Whether the registered backend's loading runs in processes (or threads) worth sizing."""
    from fastdata.read import get_backend

    entry = get_backend(backend)
    return entry.uses_workers or entry.name == "dali"  # DALI: the CPU thread count


def _no_workers(backend: str) -> LoaderSettings:
    from fastdata.read import get_backend

    why = f"{backend} backend: its loading runs in no worker processes"
    if get_backend(backend).resident:
        why = f"{backend} backend: the decoded split lives on the device, no loader workers needed"
    return LoaderSettings(0, 2, False, False, [why])
