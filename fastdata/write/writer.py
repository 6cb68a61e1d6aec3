"""Write a source into shuffled, deterministic, resumable tar shards plus a manifest.

The work is planned before anything is written: each split's sample ids are permuted with
`seed` and cut into shards by count (and by an estimate of size from the source bytes). The plan
is a pure function of the source and the options, so N processes can write shards independently,
a re-run after a kill skips the shards that were finished (each has a `done` record in
`OUT/.fastdata-work/`), and the result is byte-identical whatever the number of processes.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fastdata import __version__, schema
from fastdata.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    SkippedSample,
    SplitInfo,
    load_manifest,
)
from fastdata.sources.base import Source, SourceItem
from fastdata.write.encode import BadSampleError, encode_item, resolve_encoding
from fastdata.write.tarshard import ShardTarWriter

__all__ = ["ShardOptions", "ShardingError", "write_shards"]

log = logging.getLogger("fastdata")
WORK_DIR = ".fastdata-work"


class ShardingError(RuntimeError):
    """Sharding stopped: a bad sample under `strict`, or an output folder that must not be touched."""


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
        resize: shrink images so the shorter side is at most this many pixels (re-encodes).
        quality: JPEG quality for re-encoding.
        strict: stop at the first bad sample instead of skipping and reporting it.
        overwrite: replace shards of a different dataset found in the output folder.
        progress: show a progress bar.
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

    def signature(self) -> dict[str, Any]:
        """The options that change the bytes written (not workers, strict, progress)."""
        keys = ("seed", "max_count", "max_size", "encoding", "resize", "quality")
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class ShardJob:
    """One shard to write: its split, file stem and the source sample ids in order."""

    split: str
    stem: str
    sample_ids: list[int]


@dataclass
class ShardResult:
    """What writing one shard produced (saved as its `done` record for resumes)."""

    split: str
    name: str
    index: str
    num_samples: int
    bytes: int
    sha256: str
    class_counts: dict[str, int]
    heights: list[int] = field(default_factory=list)  # [min, max, sum]
    widths: list[int] = field(default_factory=list)
    exts: list[str] = field(default_factory=list)
    skipped: list[list[str]] = field(default_factory=list)  # [origin, reason]


def write_shards(
    source: Source, out: str | os.PathLike[str], options: ShardOptions = ShardOptions()
) -> Manifest:
    """Shard `source` into `out` and return the manifest (see module docstring).

    Raises:
        ShardingError: `out` holds a different dataset (pass `overwrite=True`), or a bad sample was
            met under `strict=True`. Finished shards stay for a resume; nothing partial remains.
        ValueError: an encoding that does not fit the source.
    """
    out_dir = Path(out)
    first = source.item(next(iter(source.splits())), 0)
    encoding = resolve_encoding(options.encoding, first.pixels is not None, options.resize)
    identity = {
        "kind": source.kind,
        "fingerprint": source.fingerprint(),
        "options": {**options.signature(), "encoding": encoding},
        "format_version": 1,
    }
    existing = _prepare_out(out_dir, identity, options.overwrite)
    if existing is not None:
        log.info("%s already holds this dataset with these options; nothing to do", out_dir)
        return existing
    jobs = plan_jobs(source, options)
    work = out_dir / WORK_DIR
    todo = [job for job in jobs if not (work / f"{job.stem}.done.json").exists()]
    if len(todo) < len(jobs):
        log.info("resuming: %d of %d shards already written", len(jobs) - len(todo), len(jobs))
    _run_jobs(source, todo, out_dir, encoding, options)
    results = [_load_done(work, job.stem) for job in jobs]
    _report_skipped(results)
    manifest = _build_manifest(out_dir, source, identity, results, options.seed)
    manifest.save(out_dir)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def plan_jobs(source: Source, options: ShardOptions) -> list[ShardJob]:
    """Permute each split with the seed and cut it into shards (pure: no file is written)."""
    if options.max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {options.max_count}")
    jobs: list[ShardJob] = []
    for split, count in sorted(source.splits().items()):
        # The split name enters the seed so that splits are shuffled independently.
        rng = np.random.default_rng([options.seed, zlib.crc32(split.encode())])
        order = rng.permutation(count).tolist()
        sizes = _estimated_sizes(source, split, order) if options.max_size else None
        for number, ids in enumerate(_cut(order, sizes, options.max_count, options.max_size)):
            jobs.append(ShardJob(split, f"{split}-{number:06d}", ids))
    return jobs


def _cut(
    order: list[int], sizes: list[int] | None, max_count: int, max_size: int | None
) -> Iterator[list[int]]:
    shard: list[int] = []
    shard_bytes = 0
    for pos, sample_id in enumerate(order):
        size = sizes[pos] if sizes else 0
        if shard and (len(shard) >= max_count or (max_size and shard_bytes + size > max_size)):
            yield shard
            shard, shard_bytes = [], 0
        shard.append(sample_id)
        shard_bytes += size
    if shard:
        yield shard


def _estimated_sizes(source: Source, split: str, order: list[int]) -> list[int]:
    sizes = []
    for sample_id in order:
        item = source.item(split, sample_id)
        if item.pixels is not None:
            sizes.append(int(item.pixels.nbytes))
        else:
            sizes.append(item.path.stat().st_size if item.path and item.path.exists() else 0)
    return sizes


# ----------------------------------------------------------------------------- output folder


def _prepare_out(out_dir: Path, identity: dict[str, Any], overwrite: bool) -> Manifest | None:
    """Check `out_dir`: the same finished dataset (returned), a resumable one, empty, or refused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / WORK_DIR
    plan_file = work / "plan.json"
    manifest_file = out_dir / MANIFEST_NAME
    if manifest_file.exists():
        manifest = load_manifest(out_dir)
        if _same_identity(manifest.source, identity) and not overwrite:
            return manifest
        if not overwrite:
            raise ShardingError(
                f"{out_dir} already holds a different dataset (manifest source "
                f"{manifest.source.get('kind')!r}, options {manifest.source.get('options')}); "
                "pass --overwrite to replace it, or choose another output folder"
            )
        _clear_ours(out_dir)
    elif plan_file.exists():
        previous = json.loads(plan_file.read_text())
        if not _same_identity(previous, identity):
            if not overwrite:
                raise ShardingError(
                    f"{out_dir} holds an unfinished sharding of a different input or options; "
                    "pass --overwrite to discard it"
                )
            _clear_ours(out_dir)
    else:
        foreign = [p.name for p in out_dir.iterdir() if not _is_ours(p)]
        ours = [p.name for p in out_dir.iterdir() if _is_ours(p)]
        if (foreign or ours) and not overwrite:
            shown = ", ".join(sorted(foreign + ours)[:5])
            raise ShardingError(
                f"{out_dir} is not empty ({shown}...); choose an empty folder or pass --overwrite "
                "(which removes only shard files, index files and the manifest)"
            )
        _clear_ours(out_dir)
    work.mkdir(exist_ok=True)
    # Partial files of a killed run: never under a final name, removed before resuming.
    for tmp in [*out_dir.glob("*.tmp-*"), *work.glob("*.tmp-*")]:
        tmp.unlink()
    _atomic_write(plan_file, json.dumps(identity, sort_keys=True))
    return None


def _same_identity(recorded: dict[str, Any], identity: dict[str, Any]) -> bool:
    keys = ("kind", "fingerprint", "options", "format_version")
    return all(recorded.get(k) == identity.get(k) for k in keys)


CACHE_DIR = ".fastdata-cache"  # decoded splits of the memory backend (fastdata.read.memory)


def _is_ours(path: Path) -> bool:
    return (
        path.name in (MANIFEST_NAME, WORK_DIR, CACHE_DIR)
        or path.suffix in (".tar", ".idx")
        or ".tmp-" in path.name
    )


def _clear_ours(out_dir: Path) -> None:
    for path in out_dir.iterdir():
        if path.name in (WORK_DIR, CACHE_DIR):
            shutil.rmtree(path)
        elif _is_ours(path):
            path.unlink()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- parallel writing

# The source is handed to forked workers through this global: forking shares its arrays
# copy-on-write, where pickling a 150 MB CIFAR array to every process would not.
_WORKER_STATE: dict[str, Any] = {}


def _run_jobs(
    source: Source, jobs: list[ShardJob], out_dir: Path, encoding: str, options: ShardOptions
) -> None:
    if not jobs:
        return
    workers = options.workers or _usable_cores()
    workers = max(1, min(workers, len(jobs)))
    _WORKER_STATE.update(source=source, out=out_dir, encoding=encoding, options=options)
    total = sum(len(job.sample_ids) for job in jobs)
    bar = tqdm(total=total, unit="img", desc=f"sharding -> {out_dir}", disable=not options.progress)
    try:
        if workers == 1:
            for job in jobs:
                bar.update(_write_job(job))
        else:
            with mp.get_context("fork").Pool(workers) as pool:
                for done in pool.imap_unordered(_write_job, jobs):
                    bar.update(done)
    except BaseException:
        # A failed or interrupted run: workers killed by the pool's terminate() could not remove
        # their partial files. Finished shards (with done records) stay for a resume.
        for tmp in out_dir.glob("*.tmp-*"):
            tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
        _WORKER_STATE.clear()


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
    try:
        for sample_id in job.sample_ids:
            item = source.item(job.split, sample_id)
            try:
                encoded = encode_item(item, encoding, options.resize, options.quality)
            except BadSampleError as exc:
                if options.strict:
                    raise ShardingError(f"bad sample (strict mode): {exc}") from exc
                result.skipped.append([exc.origin, exc.reason])
                continue
            writer.write(_key(job.split, item), _components(item, encoded.ext, encoded.data))
            heights.append(encoded.height)
            widths.append(encoded.width)
            exts.add(encoded.ext)
            label = str(item.label)
            result.class_counts[label] = result.class_counts.get(label, 0) + 1
    except BaseException:
        writer.abort()
        raise
    if writer.num_samples == 0:
        writer.abort()
        result.name = result.index = ""
    else:
        result.bytes, result.sha256 = writer.commit()
    result.num_samples = writer.num_samples
    result.heights = [min(heights), max(heights), sum(heights)] if heights else []
    result.widths = [min(widths), max(widths), sum(widths)] if widths else []
    result.exts = sorted(exts)
    _atomic_write(out_dir / WORK_DIR / f"{job.stem}.done.json", json.dumps(asdict(result)))
    return len(job.sample_ids)


def _key(split: str, item: SourceItem) -> str:
    return schema.sample_key(split, item.sample_id)


def _components(item: SourceItem, ext: str, data: bytes) -> dict[str, bytes]:
    return schema.components(ext, data, item.label, item.sample_id)


# ----------------------------------------------------------------------------- manifest


def _load_done(work: Path, stem: str) -> ShardResult:
    return ShardResult(**json.loads((work / f"{stem}.done.json").read_text()))


def _report_skipped(results: list[ShardResult]) -> None:
    skipped = [s for r in results for s in r.skipped]
    if skipped:
        lines = "\n".join(f"  {origin}: {reason}" for origin, reason in skipped)
        log.warning(
            "skipped %d bad source sample(s) (listed in the manifest):\n%s", len(skipped), lines
        )


def _build_manifest(
    out_dir: Path, source: Source, identity: dict[str, Any], results: list[ShardResult], seed: int
) -> Manifest:
    splits: dict[str, SplitInfo] = {}
    for split in sorted({r.split for r in results}):
        mine = [r for r in results if r.split == split]
        splits[split] = _split_info(mine, len(source.classes), identity["options"]["encoding"])
    return Manifest(
        root=str(out_dir),
        classes=list(source.classes),
        splits=splits,
        source=identity,
        seed=seed,
        fastdata_version=__version__,
    )


def _split_info(results: list[ShardResult], num_classes: int, encoding: str) -> SplitInfo:
    counts = [0] * num_classes
    for r in results:
        for label, n in r.class_counts.items():
            counts[int(label)] += n
    written = [r for r in results if r.num_samples]
    n = sum(r.num_samples for r in written)
    stats: dict[str, float] = {}
    if n:
        stats = {
            "min_height": min(r.heights[0] for r in written),
            "max_height": max(r.heights[1] for r in written),
            "mean_height": round(sum(r.heights[2] for r in written) / n, 2),
            "min_width": min(r.widths[0] for r in written),
            "max_width": max(r.widths[1] for r in written),
            "mean_width": round(sum(r.widths[2] for r in written) / n, 2),
        }
    exts = sorted({e for r in written for e in r.exts})
    stored = schema.encoding_of_exts(exts)
    raw_shape = None
    if (
        stats
        and stats["min_height"] == stats["max_height"]
        and stats["min_width"] == stats["max_width"]
    ):
        raw_shape = [int(stats["min_height"]), int(stats["min_width"]), 3]
    return SplitInfo(
        shards=[ShardInfo(r.name, r.index, r.num_samples, r.bytes, r.sha256) for r in written],
        class_counts=counts,
        encoding=stored if encoding != "raw" else "raw",
        raw_shape=raw_shape,
        image_stats=stats,
        skipped=[SkippedSample(origin, reason) for r in results for origin, reason in r.skipped],
    )
