"""The shard writer's tasks: what every engine runs, in whatever process it runs them.

`run_jobs` cuts a run's jobs into tasks and hands them to an engine (`fastdata.write.engine`);
each task (`_write_task`) sets its process's state once (`WriteContext`) and writes its jobs
that are not done yet: one shard each (`_write_job`), its samples encoded and written
(`_write_sample`), then committed with its per-sample digests and its `done` record
(`_finish_job`), so a killed run resumes where it stopped. `fastdata.write.writer` plans the
run and calls `run_jobs`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fastdata.format import schema
from fastdata.format.fields import fields_to_json
from fastdata.write.encode import BadSampleError, encode_item
from fastdata.write.engine import Engine
from fastdata.write.errors import (
    ShardingError,
    TooManyBadSamplesError,
    allowance,
    too_many_message,
)
from fastdata.write.options import ShardOptions
from fastdata.write.outdir import WORK_DIR, atomic_write
from fastdata.write.plan import ShardJob
from fastdata.write.rawblock import block_path, write_blocks
from fastdata.write.results import (
    ShardResult,
    done_path,
    is_done,
)
from fastdata.write.sample_fields import encode_with_fields
from fastdata.write.source_ids import write_id_run
from fastdata.write.sources.base import (
    Source,
    SourceItem,
    source_fields,
)
from fastdata.write.stats import PixelStats
from fastdata.write.tarshard import ShardTarWriter, sha256_file
from fastdata.write.video import encode_video

__all__ = ["IDS_RUN_SUFFIX", "SUMS_SUFFIX", "WriteContext", "run_jobs"]

SUMS_SUFFIX = ".sum"  # per-sample digests beside each shard (fastdata.format.integrity)
IDS_RUN_SUFFIX = ".ids.run"  # a shard's source ids in the work folder (fastdata.write.source_ids)


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


def run_jobs(context: WriteContext, jobs: list[ShardJob], engine: Engine) -> None:
    """Run `jobs` on `engine` as tasks of `context`, with a progress bar; no partial file stays."""
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
        # A failed or interrupted run: workers ended mid-shard (`fastdata._util.procs`) could
        # not remove their partial files. Finished shards (with done records) stay for a resume.
        # Only this run's shards: other parts may be writing theirs into the same folder.
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
