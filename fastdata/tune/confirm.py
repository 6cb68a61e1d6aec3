"""Check a sizing by measurement: time a few (workers, decode threads) pairs, keep the fastest.

The sizing rule (`fastdata.tune.sizing`) has no term for the cost of moving a batch from a
worker process to the main process. When samples are cheap (raw CIFAR: ~15 us each), that cost
dominates and loading in the main process beats any number of workers; when decoding is
expensive (JPEG photos), more workers than cores can win because the main process's receiving
work overlaps theirs. Both were measured (benchmarks/bench_tune.py), and neither is predicted
well from the sample cost alone, so the answer is checked on the machine as it is now.

Photos (encoded images, decoded by `fastdata.read.decoders.image`, whose libjpeg-turbo calls release
the GIL) can also be decoded by threads: inside each worker, or in the main process where
handing batches over from workers costs more than it saves. For them the candidates include
decode threads, so the timing chooses processes, threads, or both.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from fastdata.read.base import LoaderSpec
from fastdata.tune.probe import Probe
from fastdata.tune.sizing import LoaderSettings, free_cores, max_workers_by_memory

__all__ = ["candidates", "confirm_by_measurement", "decodes_photos"]

#: Most decode threads tried per process: two already overlap decoding with the rest of a batch.
MAX_DECODE_THREADS = 2
#: Extra timings of the contenders (the two fastest, then any within TIE of them). On the 2-core
#: VM of benchmarks/bench_tune.py one setting measured 36,519 and 61,998 img/s minutes apart,
#: and a single lucky timing made the tuner pick 3 workers where 0 was 1.45x faster when the two
#: were timed in turn.
FINAL_RETIMES = 2
#: Finalists whose medians differ by less than this fraction are a tie (the smaller setting wins).
#: In bench_tune, 2 workers x 1 and x 2 decode threads measured 930 and 931 img/s in the tuner,
#: then 1,096 and 901 img/s head to head.
TIE = 0.05


def decodes_photos(spec: LoaderSpec) -> bool:
    """Whether the split holds encoded images (JPEG/PNG) rather than raw pixel arrays.

    By the manifest's encoding, not by `raw_shape`: photos of one size have a shape too."""
    return spec.manifest.split(spec.split).encoding != "raw"


def candidates(
    settings: LoaderSettings,
    probe: Probe,
    photos: bool = False,
    main_cores: float = 0.0,
    workers_only_from_rule: bool = False,
) -> list[tuple[int, int]]:
    """(num_workers, decode_threads) pairs worth timing, from the measured load.

    Workers, each with one decode thread: none, the rule's choice, the free cores `n`
    (rounded), the usable cores + 1 and twice the usable cores (with `workers_only_from_rule`:
    the rule's choice only). For photos, also (n, 1), (n // 2, 2), (0, 2) and (n, 2), with 2
    lowered to the usable cores: on an idle 2-core machine {(2, 1), (1, 2), (0, 2), (2, 2)}. No
    candidate has more workers than the memory allows (`sizing.max_workers_by_memory`).

    More workers than cores overlap their decoding with the main process's receiving, and where
    other processes keep a core busy the scheduler shares that core among every runnable thread,
    so each extra worker takes a larger part of it. Which count wins is not predictable from the
    load: in benchmarks/bench_tune.py (2 cores, JPEG photos) the sweep's best under a busy core
    was 4 workers in 8 runs of 12 and 3 in the other 4, and on idle cores 2, 3 or 4 (3, 3 and 6
    runs). With only 3 (free + usable) or only 4 (twice the usable cores) timed, the tuner
    reached 0.85 of the sweep's best.
    """
    # Rounded, not floored: 2% of a core busy with other processes leaves 2 cores, not 1.
    n = max(1, round(free_cores(probe, main_cores=main_cores)))
    workers = {settings.num_workers}
    if not workers_only_from_rule:
        workers |= {0, n, probe.usable_cores + 1, 2 * probe.usable_cores}
    pairs = {(w, 1) for w in workers}
    threads = min(MAX_DECODE_THREADS, probe.usable_cores)
    if photos and threads > 1:
        pairs |= {(n, 1), (max(1, n // 2), threads), (0, threads), (n, threads)}
    cap = max(settings.num_workers, max_workers_by_memory(probe))
    return sorted(pair for pair in pairs if pair[0] <= cap)


def confirm_by_measurement(
    spec: LoaderSpec,
    settings: LoaderSettings,
    probe: Probe,
    n_batches: int = 6,
    main_cores: float = 0.0,
    workers_only_from_rule: bool = False,
) -> LoaderSettings:
    """The fastest of `candidates` (at the rule's prefetch), with the timings as a reason.

    Args:
        spec: the loader's spec (timed with the CPU backend).
        settings: the sizing rule's choice.
        probe: the machine's figures the candidates follow.
        n_batches: batches timed per candidate (after the workers' warm-up).
        main_cores: cores kept for the training process (0: the loader alone).
        workers_only_from_rule: time the rule's worker count only (plus the photo pairs).
    """
    from fastdata.tune.measure import measure_settings

    photos = decodes_photos(spec)

    def rate(pair: tuple[int, int]) -> float:
        workers, threads = pair
        result = measure_settings(
            spec, workers, settings.prefetch_factor, n_batches, decode_threads=threads
        )
        return result.samples_per_s

    pairs = candidates(settings, probe, photos, main_cores, workers_only_from_rule)
    timed = {pair: [rate(pair)] for pair in pairs}
    finalists = _retime_contenders(timed, rate) if len(timed) > 1 else list(timed)
    medians = {pair: statistics.median(rates) for pair, rates in timed.items()}
    top = max(medians[pair] for pair in finalists)
    # Within TIE of the fastest, a finalist ties it on this evidence: the one with fewer decode
    # threads, then fewer workers, wins (less memory, fewer threads fighting over the cores).
    tied = [pair for pair in finalists if medians[pair] >= top * (1 - TIE)]
    best = min(tied, key=lambda pair: (pair[1], pair[0]))
    figures = ", ".join(f"{w} workers x {t} threads {medians[(w, t)]:,.0f}/s" for (w, t) in timed)
    why = (
        f"measured ({figures}; the fastest and those within {TIE:.0%} of them: medians of "
        f"{1 + FINAL_RETIMES} timings): {best[0]} workers x {best[1]} decode threads "
        + ("is fastest" if len(tied) == 1 else f"ties the fastest (within {TIE:.0%}), the smaller")
    )
    return dataclasses.replace(
        settings,
        num_workers=best[0],
        decode_threads=best[1],
        persistent_workers=best[0] > 0,
        reasons=[*settings.reasons, why],
    )


def _retime_contenders(
    timed: dict[tuple[int, int], list[float]], rate: Callable[[tuple[int, int]], float]
) -> list[tuple[int, int]]:
    """Time contenders again, in turn, until every one is judged by its median; returns them.

    The fastest of several noisy timings is flattered by its noise, so the two fastest are timed
    FINAL_RETIMES more times. Their medians may then fall below another candidate's single
    timing (in bench_tune the machine slowed while two finalists were re-timed, and a third
    candidate's one timing, 12% above their medians, was never compared): any candidate whose
    single timing is within TIE of the best median so far is then re-timed too, until none is.
    """
    full = 1 + FINAL_RETIMES
    contenders = sorted(timed, key=lambda pair: timed[pair][0], reverse=True)[:2]
    finalists: list[tuple[int, int]] = []
    while contenders:
        for _ in range(FINAL_RETIMES):
            for pair in contenders:
                timed[pair].append(rate(pair))
        finalists += contenders
        top = max(statistics.median(timed[pair]) for pair in finalists)
        contenders = [
            pair for pair in timed if len(timed[pair]) < full and timed[pair][0] >= top * (1 - TIE)
        ]
    return finalists
