"""Write a source into shuffled, deterministic, resumable tar shards plus a manifest.

The work is planned before anything is written: each split's sample ids are permuted with
`seed` and cut into shards by count (and by an estimate of size from the source bytes). The plan
is a pure function of the source and the options, so N processes can write shards independently,
a re-run after a kill skips the shards that were finished (each has a `done` record in
`OUT/.fastdata-work/`), and the result is byte-identical whatever the number of processes. The
same plan, cut into parts, lets many machines shard one dataset (`fastdata.write.parts`).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fastdata.format import schema
from fastdata.format.fields import fields_to_json
from fastdata.format.manifest import Manifest
from fastdata.write.carve import carve_source
from fastdata.write.encode import DEFAULT_MAX_PIXELS, BadSampleError, encode_item, resolve_encoding
from fastdata.write.engine import Engine, LocalEngine
from fastdata.write.engines import open_engine
from fastdata.write.errors import (
    ShardingError,
    TooManyBadSamplesError,
    allowance,
    check_bad,
    too_many_message,
)
from fastdata.write.lock import lock_folder
from fastdata.write.outdir import WORK_DIR, atomic_write, prepare_out, same_identity
from fastdata.write.plan import PLAN_DIR, ShardJob, plan_jobs
from fastdata.write.rawblock import block_path, write_blocks
from fastdata.write.results import (
    ShardResult,
    build_manifest,
    done_path,
    is_done,
    load_result,
    lost_results,
    report_skipped,
)
from fastdata.write.sample_fields import encode_with_fields
from fastdata.write.source_ids import write_id_run
from fastdata.write.sources.base import (
    Source,
    SourceItem,
    source_fields,
    source_skipped,
)
from fastdata.write.stats import PixelStats
from fastdata.write.tarshard import ShardTarWriter, sha256_file

__all__ = [
    "WORK_DIR",
    "ShardOptions",
    "ShardingError",
    "TooManyBadSamplesError",
    "atomic_write",
    "same_identity",
    "write_shards",
]

log = logging.getLogger("fastdata")


@dataclass(frozen=True)
class ShardOptions:
    """How to shard a source.

    Args:
        seed: seed of the cross-shard pre-shuffle (same seed and input give byte-identical shards).
        max_count: most samples per shard.
        max_size: most bytes per shard, estimated from the source's bytes (a re-encoded sample can
            differ in size, so a shard may end slightly over). None: no size limit.
        workers: writer processes; None uses the usable cores.
        encoding: "auto", "raw", "png", "jpeg" or "keep" (see `fastdata.write.encode`).
        resize: shrink images so the shorter side is at most this many pixels (re-encodes every
            image; classification sources only: see `max_side`).
        quality: JPEG quality for re-encoding.
        strict: stop at the first bad sample instead of skipping and reporting it (also at an
            input the source itself found unusable: an unpaired segmentation file, a broken
            symlink, before anything is written).
        overwrite: replace shards of a different dataset found in the output folder.
        progress: show a progress bar.
        val_fraction: carve this share of the training split into a "val" split
            (`fastdata.write.carve`, seeded with `seed`), for a source without one; None: no.
        max_bad: most fraction (0..1) of the inputs that may be bad (skipped); one more stops the
            run with `TooManyBadSamplesError` and the first reasons, and writes no manifest.
        max_pixels: most width x height of an image file, checked from its header before it is
            decoded (a bigger one is a bad sample); None: no bound.
        lock_timeout: seconds to wait for another run that writes into the same output folder
            (0: refuse at once; see `fastdata.write.lock`).
        max_side: store images no larger than this on their longer side (FFCV's
            `max_resolution`): a larger one is resized and re-encoded (JPEG at `quality`), its
            mask resized with nearest and its boxes scaled with it; None: as they are.
    """

    seed: int = 0
    max_count: int = 10_000
    max_size: int | None = None
    workers: int | None = None
    encoding: str = "auto"
    resize: int | None = None
    quality: int = 90
    strict: bool = False
    overwrite: bool = False
    progress: bool = True
    val_fraction: float | None = None
    max_bad: float = 0.1
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    lock_timeout: float = 0.0
    max_side: int | None = None

    def __post_init__(self) -> None:
        if self.max_side is not None and self.max_side < 1:
            raise ValueError(f"max_side must be >= 1 or None, got {self.max_side}")
        if not 0.0 <= self.max_bad <= 1.0:
            raise ValueError(f"max_bad must be a fraction from 0 to 1, got {self.max_bad}")
        if self.max_pixels is not None and self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1 or None, got {self.max_pixels}")

    def signature(self) -> dict[str, Any]:
        """The options that change the bytes written (not workers, strict, progress, max_bad)."""
        keys = ("seed", "max_count", "max_size", "encoding", "resize", "quality")
        signature = {k: getattr(self, k) for k in keys}
        if self.val_fraction is not None:  # absent otherwise: older folders keep their identity
            signature["val_fraction"] = self.val_fraction
        if self.max_pixels != DEFAULT_MAX_PIXELS:  # folders written before the option match
            signature["max_pixels"] = self.max_pixels
        if self.max_side is not None:  # absent otherwise: older folders keep their identity
            signature["max_side"] = self.max_side
        return signature


def write_shards(
    source: Source,
    out: str | os.PathLike[str],
    options: ShardOptions = ShardOptions(),
    engine: Engine | str | None = None,
) -> Manifest:
    """Shard `source` into `out` and return the manifest (see module docstring).

    Only one run writes into `out` at a time: it holds `out/.fastdata.lock` (see
    `fastdata.write.lock`) until it returns.

    Args:
        source: the dataset.
        out: the output folder (on a cluster: one that every node reaches at the same path).
        options: how to shard.
        engine: where the shards are written (`fastdata.write.engine`): None or "local" forks
            `options.workers` processes here; "ray" runs the same tasks on a local Ray
            cluster sized to the usable cores (started and shut down here); an `Engine` such
            as `RayEngine(address=...)` is used as it is (and left open). The bytes written
            are the same.

    Raises:
        ShardingError: `out` holds a different dataset (pass `overwrite=True`), or a bad sample was
            met under `strict=True`. Finished shards stay for a resume; nothing partial remains.
        FolderLockedError: another run is writing into `out`.
        TooManyBadSamplesError: more than `max_bad` of the inputs are bad (no manifest written).
        ValueError: an encoding that does not fit the source, or a `val_fraction` it cannot take.
    """
    source = carve_source(source, options.val_fraction, options.seed)
    out_dir = Path(out)
    identity = dataset_identity(source, options)
    with lock_folder(out_dir, timeout=options.lock_timeout):
        existing = prepare_out(out_dir, identity, options.overwrite)
        if existing is not None:
            log.info("%s already holds this dataset with these options; nothing to do", out_dir)
            return existing
        work = out_dir / WORK_DIR
        # The plan's files in the work folder: on a cluster, where every node reads them
        # (absolute: a Ray worker's working folder is not ours).
        jobs = plan_jobs(source, options, folder=work.absolute() / PLAN_DIR)
        _run_on(engine, source, jobs, out_dir, identity["options"]["encoding"], options)
        results = [load_result(work, job.stem) for job in jobs] + lost_results(
            source_skipped(source)
        )
        check_bad(results, _total_inputs(source, jobs), options.max_bad)
        report_skipped(results)
        class_ids = getattr(source, "class_ids", None)  # COCO: the category ids
        manifest = build_manifest(
            out_dir, list(source.classes), identity, results, class_ids, work=work
        )
        manifest.save(out_dir)
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _run_on(
    engine: Engine | str | None,
    source: Source,
    jobs: list[ShardJob],
    out_dir: Path,
    encoding: str,
    options: ShardOptions,
) -> None:
    """`run_plan` on `engine`, opened (and closed after) when it is given by name."""
    if not isinstance(engine, str):
        run_plan(source, jobs, out_dir, encoding, options, engine=engine)
        return
    opened = open_engine(engine, workers=options.workers)
    try:
        run_plan(source, jobs, out_dir, encoding, options, engine=opened)
    finally:
        opened.close()


def _total_inputs(source: Source | None, jobs: list[ShardJob]) -> int:
    """The inputs `max_bad` is a fraction of: the plan's samples and the source's own losses
    (none without a source)."""
    lost = sum(len(found) for found in source_skipped(source).values()) if source else 0
    return sum(job.count for job in jobs) + lost


def dataset_identity(source: Source, options: ShardOptions) -> dict[str, Any]:
    """What makes two shardings the same: the source's kind and fingerprint, the byte options."""
    first = source.item(next(iter(source.splits())), 0)
    encoding = resolve_encoding(options.encoding, first.pixels is not None, options.resize)
    if options.resize is not None and any(source_fields(source, s) for s in source.splits()):
        # `resize` shrinks the image alone (in the encoder); masks and boxes would no longer
        # fit it, so every sample would be refused as bad: `max_side` moves them with it.
        raise ValueError(
            f"resize={options.resize} shrinks images only, but this {source.kind} source has "
            f"masks or boxes; use max_side={options.resize} (the longer side) instead, which "
            "resizes them with the image"
        )
    return {
        "kind": source.kind,
        "fingerprint": source.fingerprint(),
        "options": {**options.signature(), "encoding": encoding},
        "format_version": 1,
    }


def run_plan(
    source: Source,
    jobs: list[ShardJob],
    out_dir: Path,
    encoding: str,
    options: ShardOptions,
    source_losses: bool = True,
    engine: Engine | None = None,
) -> int:
    """Write the jobs that are not done yet (see `results.is_done`); returns how many were done.

    Args:
        source_losses: count what the source found unusable while opening towards `max_bad`
            (False for one part of a `--part` run: every part sees all of them, so `fastdata
            merge` counts them once, against the whole run).
        engine: where the jobs run (None: `LocalEngine(options.workers)`).
    """
    if options.strict:  # what the source found unusable is a bad input like a bad image
        for origin, reason in (s for found in source_skipped(source).values() for s in found):
            raise ShardingError(
                f"bad input (strict mode): {origin}: {reason}; fix or remove it, or shard "
                "without --strict to skip it and list it in the manifest"
            )
    work = out_dir / WORK_DIR
    todo = [job for job in jobs if not is_done(out_dir, work, job.stem)]
    if len(todo) < len(jobs):
        log.info("resuming: %d of %d shards already written", len(jobs) - len(todo), len(jobs))
    waiting = {job.stem for job in todo}
    done = [load_result(work, job.stem) for job in jobs if job.stem not in waiting]
    lost = lost_results(source_skipped(source)) if source_losses else []
    bad = [list(s) for r in done + lost for s in r.skipped]
    total = _total_inputs(source if source_losses else None, jobs)
    if len(bad) > allowance(options.max_bad, total):  # the source's own losses are too many
        raise TooManyBadSamplesError(too_many_message(len(bad), total, options.max_bad, bad))
    # Absolute: a task may run in a process whose working folder is not ours (a Ray worker).
    context = WriteContext(source, out_dir.absolute(), encoding, options, bad, total)
    _run_jobs(context, todo, engine or LocalEngine(options.workers))
    return len(jobs) - len(todo)


SUMS_SUFFIX = ".sum"  # per-sample digests beside each shard (fastdata.format.integrity)
IDS_RUN_SUFFIX = ".ids.run"  # a shard's source ids in the work folder (fastdata.write.source_ids)


# ----------------------------------------------------------------------------- parallel writing

# The state of the process that writes shards (set by `_write_task` in each worker).
_WORKER_STATE: dict[str, Any] = {}


@dataclass
class WriteContext:
    """What every shard task needs besides its jobs; sent once to each worker.

    `bad` is the run's shared bad-sample counter when the engine forks workers from the
    driver (the run stops as soon as the whole run is certain to exceed max_bad); None on a
    cluster, where each task counts its own and the driver checks the whole run at the end.
    """

    source: Source
    out: Path
    encoding: str
    options: ShardOptions
    bad_before: list[list[str]]
    total: int
    bad: Any = field(default=None, repr=False)


def _run_jobs(context: WriteContext, jobs: list[ShardJob], engine: Engine) -> None:
    if not jobs:
        return
    out_dir, options = context.out, context.options
    if engine.shared_memory:
        context.bad = mp.get_context("fork").Value("q", len(context.bad_before))
    elif (move_rows := getattr(context.source, "move_rows", None)) is not None:
        move_rows(out_dir / WORK_DIR / "source")  # a list's rows, where every node reads them
    count = max(1, min(engine.tasks_for(len(jobs)), len(jobs)))
    tasks = [jobs[number::count] for number in range(count)]  # each a slice of the plan
    total = sum(job.count for job in jobs)
    bar = tqdm(total=total, unit="img", desc=f"sharding -> {out_dir}", disable=not options.progress)
    try:
        for done in engine.run(_write_task, context, tasks):
            bar.update(done)
    except BaseException:
        # A failed or interrupted run: workers killed by the pool's terminate() could not remove
        # their partial files. Finished shards (with done records) stay for a resume. Only this
        # run's shards: other parts may be writing theirs into the same folder.
        _remove_partial(out_dir, jobs)
        raise
    finally:
        bar.close()
        context.bad = None
        _WORKER_STATE.clear()  # a task run in this process (one worker) let go of the source
    # A worker that died mid-write (its task retried by the engine) left its partial files.
    _remove_partial(out_dir, jobs)


def _remove_partial(out_dir: Path, jobs: list[ShardJob]) -> None:
    for job in jobs:
        for tmp in out_dir.glob(f"{job.stem}.*.tmp-*"):
            tmp.unlink(missing_ok=True)


def _write_task(context: WriteContext, jobs: list[ShardJob]) -> int:
    """Write a task's shards (in a worker); returns the number of source samples processed.

    Idempotent: a shard already done (a retried task, a resumed run) is not written again.
    """
    bad = context.bad
    if bad is None:  # not forked from the driver: this task's own count
        bad = mp.get_context("fork").Value("q", len(context.bad_before))
    _WORKER_STATE.update(source=context.source, out=context.out, encoding=context.encoding)
    _WORKER_STATE.update(options=context.options, bad=bad, bad_before=context.bad_before)
    _WORKER_STATE.update(total=context.total)
    processed = 0
    work = context.out / WORK_DIR
    for job in jobs:
        if not is_done(context.out, work, job.stem):
            _test_hooks(job)
            processed += _write_job(job)
        else:
            processed += job.count
    return processed


def _test_hooks(job: ShardJob) -> None:
    """Tests only: with FASTDATA_TEST_HOOKS=DIR, log each shard written to DIR/written.log,
    sleep DIR/delay's seconds first when it exists (a slow run to kill), and when
    DIR/kill-once exists (and DIR/killed does not), SIGKILL this process in the middle of
    writing the shard (a worker that dies mid-write)."""
    folder = os.environ.get("FASTDATA_TEST_HOOKS")
    if not folder:
        return
    hooks = Path(folder)
    if (hooks / "delay").exists():
        time.sleep(float((hooks / "delay").read_text()))
    with open(hooks / "written.log", "a") as log_file:
        log_file.write(f"{job.stem}\n")
    if (hooks / "kill-once").exists() and not (hooks / "killed").exists():
        global ShardTarWriter

        class _Dying(ShardTarWriter):  # type: ignore[valid-type,misc]
            def write(self, key: str, components: dict[str, bytes]) -> None:
                super().write(key, components)
                (hooks / "killed").write_text(f"{os.getpid()} {job.stem}")
                os.kill(os.getpid(), 9)

        ShardTarWriter = _Dying  # type: ignore[misc]  # this process dies with it


def _write_job(job: ShardJob) -> int:
    """Write one shard (in a worker process). Returns the number of source samples processed."""
    source: Source = _WORKER_STATE["source"]
    out_dir: Path = _WORKER_STATE["out"]
    options: ShardOptions = _WORKER_STATE["options"]
    encoding: str = _WORKER_STATE["encoding"]
    writer = ShardTarWriter(out_dir / f"{job.stem}.tar", out_dir / f"{job.stem}.idx")
    result = ShardResult(job.split, f"{job.stem}.tar", f"{job.stem}.idx", 0, 0, "", {})
    heights: list[int] = []
    widths: list[int] = []
    exts: set[str] = set()
    pixels = PixelStats()  # streamed per-channel statistics (the default normalization)
    keys: list[str] = []
    digests: list[str] = []  # per sample, for verify_samples=True
    source_ids: dict[str, int | str] = {}  # key -> the source's own id (the split's id file)
    sums_path = out_dir / f"{job.stem}{SUMS_SUFFIX}"
    specs = source_fields(source, job.split)  # None: classification (image + label)
    result.fields = fields_to_json(specs) if specs is not None else None
    extra = specs is not None or options.max_side is not None
    classes = ()
    try:
        # Raw-encoded array sources: many samples at once (same bytes; see rawblock).
        if fast := block_path(source, encoding):
            done = write_blocks(source, writer, job, pixels if job.split == "train" else None)
            keys, digests, heights, widths = done.keys, done.digests, done.heights, done.widths
            exts, result.class_counts = {schema.RAW_EXT}, done.class_counts
        for sample_id in job.sample_ids.tolist() if not fast else ():
            item = source.item(job.split, sample_id)
            parts = None
            try:
                encoded = encode_item(
                    item, encoding, options.resize, options.quality, options.max_pixels
                )
                if extra or item.size is not None:
                    encoded, parts, classes = encode_with_fields(
                        item,
                        specs,
                        encoded,
                        options.max_side,
                        options.quality,
                        options.max_pixels,
                        len(source.classes),
                    )
            except BadSampleError as exc:
                if options.strict:
                    raise ShardingError(f"bad sample (strict mode): {exc}") from exc
                result.skipped.append([exc.origin, exc.reason])
                _count_bad(result.skipped)
                continue
            key = _key(job.split, item)
            components = parts or _components(item, encoded.ext, encoded.data)
            writer.write(key, components)
            keys.append(key)
            digests.append(schema.sample_digest(components))
            if item.source_id is not None:
                source_ids[key] = item.source_id
            heights.append(encoded.height)
            widths.append(encoded.width)
            exts.add(encoded.ext)
            if job.split == "train":
                pixels.add(encoded.ext, encoded.data, encoded.height, encoded.width)
            for label in map(str, sorted(classes) if parts is not None else (item.label,)):
                result.class_counts[label] = result.class_counts.get(label, 0) + 1
    except BaseException:
        writer.abort()
        raise
    if writer.num_samples == 0:
        writer.abort()
        result.name = result.index = ""
    else:
        # The digests first: a shard whose tar is in place always has its sums file.
        atomic_write(sums_path, schema.sums_text(keys, digests))
        try:
            result.bytes, result.sha256 = writer.commit()
        except BaseException:
            sums_path.unlink(missing_ok=True)
            raise
        result.index_sha256 = sha256_file(writer.index_path)
        result.sums, result.sums_sha256 = sums_path.name, sha256_file(sums_path)
    result.num_samples = writer.num_samples
    result.heights = [min(heights), max(heights), sum(heights)] if heights else []
    result.widths = [min(widths), max(widths), sum(widths)] if widths else []
    result.exts = sorted(exts)
    result.pixel_sums = pixels.to_list() if pixels.count else []
    if source_ids:  # sorted, beside the done record: the split's file is a merge of these runs
        result.source_ids_run = f"{job.stem}{IDS_RUN_SUFFIX}"
        write_id_run(out_dir / WORK_DIR / result.source_ids_run, source_ids)
    atomic_write(done_path(out_dir / WORK_DIR, job.stem), json.dumps(asdict(result)))
    return job.count


def _count_bad(mine: list[list[str]]) -> None:
    """Add one bad sample to the run's shared count; stop the run when it is too many."""
    options: ShardOptions = _WORKER_STATE["options"]
    total: int = _WORKER_STATE["total"]
    counter = _WORKER_STATE["bad"]
    with counter.get_lock():
        counter.value += 1
        bad = counter.value
    if bad > allowance(options.max_bad, total):
        reasons = _WORKER_STATE["bad_before"] + mine
        raise TooManyBadSamplesError(too_many_message(bad, total, options.max_bad, reasons))


def _key(split: str, item: SourceItem) -> str:
    return schema.sample_key(split, item.sample_id)


def _components(item: SourceItem, ext: str, data: bytes) -> dict[str, bytes]:
    return schema.components(ext, data, item.label, item.sample_id)
