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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fastdata.format import schema
from fastdata.format.fields import fields_to_json
from fastdata.format.manifest import Manifest
from fastdata.write.carve import carve_source
from fastdata.write.encode import BadSampleError, encode_item, resolve_encoding
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
from fastdata.write.options import ShardOptions
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
from fastdata.write.video import encode_video

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


def write_shards(
    source: Source,
    out: str | os.PathLike[str],
    options: ShardOptions = ShardOptions(),  # noqa: B008 - frozen: one shared default is safe
    engine: Engine | str | None = None,
) -> Manifest:
    """Shard `source` into `out` and return the manifest (see module docstring).

    Only one run writes into `out` at a time: it holds `out/.fastdata.lock` (see
    `fastdata.write.lock`) until it returns.

    Args:
        source: the dataset.
        out: the output folder (on a cluster: one that every node reaches at the same path),
            or an object-store URL (`s3://bucket/prefix`, `gs://...`): the shards are written
            into a local temporary folder, then uploaded, the manifest last
            (`fastdata.write.upload.staged_upload`; credentials and endpoint from the
            environment, as fsspec reads them), and the manifest returned names the URL.
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
        RemoteError: the upload to a URL `out` failed (the finished local folder is kept; the
            message says how to finish the upload).
    """
    if "://" in os.fspath(out):  # an object store: write locally, then upload (manifest last)
        from fastdata.write.upload import staged_upload

        url = os.fspath(out)
        with staged_upload(url) as local:
            manifest = _write_local(source, local, options, engine)
        return replace(manifest, root=url)  # names the uploaded copy, not the staging folder
    return _write_local(source, Path(out), options, engine)


def _write_local(
    source: Source, out_dir: Path, options: ShardOptions, engine: Engine | str | None
) -> Manifest:
    """`write_shards` into a local folder."""
    source = carve_source(source, options.val_fraction, options.seed)
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
        # Not a fork context's: a spawn context's counter can be handed to any kind of worker.
        context.bad = mp.get_context("spawn").Value("q", len(context.bad_before))
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


@dataclass
class _Tally:
    """What a shard's written samples add up to, while `_write_job` writes them."""

    result: ShardResult
    keys: list[str] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)  # per sample, for verify_samples=True
    heights: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    exts: set[str] = field(default_factory=set)
    pixels: PixelStats = field(default_factory=PixelStats)  # the default normalization
    source_ids: dict[str, int | str] = field(default_factory=dict)  # key -> the source's id

    def add(self, key: str, components: dict[str, bytes], item: SourceItem, encoded: Any) -> None:
        """Count one written sample (its image `encoded`: ext, data, height, width)."""
        self.keys.append(key)
        self.digests.append(schema.sample_digest(components))
        if item.source_id is not None:
            self.source_ids[key] = item.source_id
        self.heights.append(encoded.height)
        self.widths.append(encoded.width)
        self.exts.add(encoded.ext)
        if self.result.split == "train" and encoded.ext in schema.IMAGE_EXTS:
            self.pixels.add(encoded.ext, encoded.data, encoded.height, encoded.width)

    def add_labels(self, labels: Any) -> None:
        counts = self.result.class_counts
        for label in map(str, labels):
            counts[label] = counts.get(label, 0) + 1


def _write_job(job: ShardJob) -> int:
    """Write one shard (in a worker process). Returns the number of source samples processed."""
    source: Source = _WORKER_STATE["source"]
    out_dir: Path = _WORKER_STATE["out"]
    writer = ShardTarWriter(out_dir / f"{job.stem}.tar", out_dir / f"{job.stem}.idx")
    tally = _Tally(ShardResult(job.split, f"{job.stem}.tar", f"{job.stem}.idx", 0, 0, "", {}))
    specs = source_fields(source, job.split)  # None: classification (image + label)
    tally.result.fields = fields_to_json(specs) if specs is not None else None
    try:
        # Raw-encoded array sources: many samples at once (same bytes; see rawblock).
        if block_path(source, _WORKER_STATE["encoding"]):
            train = tally.pixels if job.split == "train" else None
            done = write_blocks(source, writer, job, train)
            tally.keys, tally.digests = done.keys, done.digests
            tally.heights, tally.widths = done.heights, done.widths
            tally.exts, tally.result.class_counts = {schema.RAW_EXT}, done.class_counts
        else:
            for sample_id in job.sample_ids.tolist():
                _write_sample(source.item(job.split, sample_id), specs, writer, tally)
    except BaseException:
        writer.abort()
        raise
    _finish_job(job, writer, tally, out_dir)
    return job.count


def _write_sample(item: SourceItem, specs: Any, writer: ShardTarWriter, tally: _Tally) -> None:
    """Encode and write one sample; a bad one is recorded as skipped (or raises when strict)."""
    options: ShardOptions = _WORKER_STATE["options"]
    parts, classes, fields = None, (), False
    source = _WORKER_STATE["source"]
    video = getattr(source, "sample_encoding", None) == "video"  # `VideoSource`
    try:
        if video:
            encoded, extra = encode_video(item, source.max_video_bytes, options.max_pixels)
            parts = {**_components(item, encoded.ext, encoded.data), **extra}
        else:
            encoded, parts, classes = _encode_image(item, specs, options)
            fields = parts is not None
    except BadSampleError as exc:
        if options.strict:
            raise ShardingError(f"bad sample (strict mode): {exc}") from exc
        tally.result.skipped.append([exc.origin, exc.reason])
        _count_bad(tally.result.skipped)
        return
    key = _key(tally.result.split, item)
    components = parts or _components(item, encoded.ext, encoded.data)
    writer.write(key, components)
    tally.add(key, components, item, encoded)
    tally.add_labels(sorted(classes) if fields else (item.label,))


def _encode_image(item: SourceItem, specs: Any, options: ShardOptions) -> tuple[Any, Any, Any]:
    """(the image, the sample's components or None for image + label, its classes)."""
    parts, classes = None, ()
    encoded = encode_item(
        item, _WORKER_STATE["encoding"], options.resize, options.quality, options.max_pixels
    )
    if specs is not None or options.max_side is not None or item.size is not None:
        encoded, parts, classes = encode_with_fields(
            item,
            specs,
            encoded,
            options.max_side,
            options.quality,
            options.max_pixels,
            len(_WORKER_STATE["source"].classes),
        )
    return encoded, parts, classes


def _finish_job(job: ShardJob, writer: ShardTarWriter, tally: _Tally, out_dir: Path) -> None:
    """Commit the shard (its digests first) and write its `done` record."""
    result = tally.result
    sums_path = out_dir / f"{job.stem}{SUMS_SUFFIX}"
    if writer.num_samples == 0:
        writer.abort()
        result.name = result.index = ""
    else:
        # The digests first: a shard whose tar is in place always has its sums file.
        atomic_write(sums_path, schema.sums_text(tally.keys, tally.digests))
        try:
            result.bytes, result.sha256 = writer.commit()
        except BaseException:
            sums_path.unlink(missing_ok=True)
            raise
        result.index_sha256 = sha256_file(writer.index_path)
        result.sums, result.sums_sha256 = sums_path.name, sha256_file(sums_path)
    result.num_samples = writer.num_samples
    for name, values in (("heights", tally.heights), ("widths", tally.widths)):
        setattr(result, name, [min(values), max(values), sum(values)] if values else [])
    result.exts = sorted(tally.exts)
    result.pixel_sums = tally.pixels.to_list() if tally.pixels.count else []
    if tally.source_ids:  # sorted, beside the done record: the split's file merges these runs
        result.source_ids_run = f"{job.stem}{IDS_RUN_SUFFIX}"
        write_id_run(out_dir / WORK_DIR / result.source_ids_run, tally.source_ids)
    atomic_write(done_path(out_dir / WORK_DIR, job.stem), json.dumps(asdict(result)))


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
