"""Write a source into shuffled, deterministic, resumable tar shards plus a manifest.

The work is planned before anything is written: each split's sample ids are permuted with
`seed` and cut into shards by count (and by an estimate of size from the source bytes). The plan
is a pure function of the source and the options, so N processes can write shards independently,
a re-run after a kill skips the shards that were finished (each has a `done` record in
`OUT/.fastdata-work/`), and the result is byte-identical whatever the number of processes. The
same plan, cut into parts, lets many machines shard one dataset (`fastdata.write.parts`).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastdata.format.manifest import Manifest, ManifestError
from fastdata.format.manifest_io import load_manifest
from fastdata.write.carve import carve_source
from fastdata.write.encode import resolve_encoding
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
from fastdata.write.results import (
    build_manifest,
    is_done,
    load_result,
    lost_results,
    report_skipped,
)
from fastdata.write.sources.base import (
    Source,
    source_fields,
    source_skipped,
)
from fastdata.write.tasks import WriteContext, run_jobs

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
            environment, as fsspec reads them), and the manifest returned names the URL. A URL
            whose manifest records this dataset and options is kept as it is (nothing written);
            another dataset there is refused unless `options.overwrite`.
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
        from fastdata.write.upload import check_upload_url, staged_upload

        url = os.fspath(out)
        check_upload_url(url)  # before anything is read or written (a web server takes none)
        there = _remote_dataset(
            url, carve_source(source, options.val_fraction, options.seed), options
        )
        if there is not None and not options.overwrite:
            # What a local folder does (`prepare_out`): the same dataset is kept, another refused.
            manifest, same = there
            if same:
                log.info("%s already holds this dataset with these options; nothing to do", url)
                return manifest
            raise ShardingError(
                f"{url} already holds a different dataset (manifest source "
                f"{manifest.source.get('kind')!r}, options {manifest.source.get('options')}); "
                "pass --overwrite to replace it, or choose another URL"
            )
        with staged_upload(url) as local:
            manifest = _write_local(source, local, options, engine)
        return replace(manifest, root=url)  # names the uploaded copy, not the staging folder
    return _write_local(source, Path(out), options, engine)


def _remote_dataset(
    url: str, source: Source, options: ShardOptions
) -> tuple[Manifest, bool] | None:
    """The manifest at `url` and whether it is `source`'s with these options; None when there is
    none (an upload writes the manifest last: no manifest, no finished dataset)."""
    try:
        manifest = load_manifest(url)
    except ManifestError:
        return None
    return manifest, same_identity(manifest.source, dataset_identity(source, options))


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
    run_jobs(context, todo, engine or LocalEngine(options.workers))
    return len(jobs) - len(todo)
