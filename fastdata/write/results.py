"""What each written shard produced (its `done` record) and the manifest built from all of them.

One shard job writes `OUT/.fastdata-work/<stem>.done.json` when its tar and index are in place.
The manifest is a pure function of those records (in plan order), the classes and the dataset's
identity, so a single run (`fastdata.write.writer`) and the merge of parts run on many machines
(`fastdata.write.parts`) write the same bytes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastdata._util.version import __version__
from fastdata.format import schema
from fastdata.format.fields import fields_from_json
from fastdata.format.manifest import Manifest, ShardInfo, SkippedSample, SplitInfo
from fastdata.write.source_ids import write_source_ids
from fastdata.write.stats import PixelStats

__all__ = ["ShardResult", "build_manifest", "done_path", "load_result", "report_skipped"]

log = logging.getLogger("fastdata")
_LOGGED = 50  # skipped samples named in the log (all of them are in the manifest)


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
    pixel_sums: list[float] = field(default_factory=list)  # PixelStats.to_list (train split)
    index_sha256: str | None = None  # None in done records of an older fastdata
    sums: str | None = None  # the per-sample digest file (fastdata.format.integrity)
    sums_sha256: str | None = None
    fields: dict[str, Any] | None = None  # the split's fields besides the image (fields_to_json)
    source_ids: dict[str, int | str] | None = None  # key -> own id: done records of fastdata <= 0.1
    source_ids_run: str | None = None  # the work folder's sorted run of those ids (source_ids.py)


def done_path(work: Path, stem: str) -> Path:
    """The `done` record of the shard `stem` in the work folder."""
    return work / f"{stem}.done.json"


def load_result(work: Path, stem: str) -> ShardResult:
    """The `done` record of shard `stem` (FileNotFoundError when it was not written)."""
    return ShardResult(**json.loads(done_path(work, stem).read_text()))


def is_done(out_dir: Path, work: Path, stem: str) -> bool:
    """True when shard `stem` has its done record and its tar is in place at the recorded size.

    A record whose tar went missing (a copy between machines that lost a file) does not count:
    the shard is written again.
    """
    try:
        result = load_result(work, stem)
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return False
    if result.num_samples == 0:
        return True  # every sample of the shard was skipped: no file to find
    tar = out_dir / result.name
    return (
        tar.is_file()
        and tar.stat().st_size == result.bytes
        and (out_dir / result.index).is_file()
        and (result.sums is None or (out_dir / result.sums).is_file())  # digests travel too
    )


def lost_results(found: Mapping[str, Sequence[Sequence[str]]]) -> list[ShardResult]:
    """What a source found unusable while opening ({split: [(origin, reason)]}), as shard results
    without a shard: the manifest, the report and the `max_bad` count take them like any other."""
    return [
        ShardResult(split, "", "", 0, 0, "", {}, skipped=[list(s) for s in items])
        for split, items in sorted(found.items())
    ]


def report_skipped(results: list[ShardResult]) -> None:
    """Log the source samples that were left out, with their reasons (the first `_LOGGED`)."""
    skipped = [s for r in results for s in r.skipped]
    if skipped:
        lines = "\n".join(f"  {origin}: {reason}" for origin, reason in skipped[:_LOGGED])
        if len(skipped) > _LOGGED:
            lines += f"\n  (+{len(skipped) - _LOGGED:,} more: see the manifest's skipped lists)"
        log.warning(
            "skipped %d bad source sample(s) (listed in the manifest):\n%s", len(skipped), lines
        )


def build_manifest(
    out_dir: Path,
    classes: list[str],
    identity: dict[str, Any],
    results: list[ShardResult],
    class_ids: Sequence[int | str] | None = None,
    work: Path | None = None,
) -> Manifest:
    """The manifest of a finished sharding, from its shards' results in plan order.

    Writes each split's source-id file (`fastdata.write.source_ids`) into `out_dir` when its
    samples have source ids. `class_ids`: the source's id of each class (COCO category ids).
    `work`: the work folder that holds the shards' runs of source ids (`result.source_ids_run`);
    needed when a result names one.
    """
    splits: dict[str, SplitInfo] = {}
    for split in sorted({r.split for r in results}):
        mine = [r for r in results if r.split == split]
        info = _split_info(mine, len(classes), identity["options"]["encoding"])
        named = [r.source_ids_run for r in mine if r.num_samples and r.source_ids_run]
        if named and work is None:
            raise ValueError("build_manifest: the results name runs of source ids; pass work=")
        runs: list[Path | dict[str, int | str]] = [work / name for name in named if work]
        runs += [r.source_ids for r in mine if r.num_samples and r.source_ids]
        written = write_source_ids(out_dir, split, runs, scratch=work) if runs else None
        if written is not None:
            info = replace(info, source_ids=written[0], source_ids_sha256=written[1])
        splits[split] = info
    return Manifest(
        root=str(out_dir),
        classes=list(classes),
        splits=splits,
        source=identity,
        seed=int(identity["options"]["seed"]),
        fastdata_version=__version__,
        class_ids=list(class_ids) if class_ids is not None else None,
    )


def _fields(results: list[ShardResult], exts: list[str]) -> dict[str, Any] | None:
    """The split's fields: its image (the components written) and the source's others; None for
    a classification split (its manifest stays as it always was)."""
    others = next((r.fields for r in results if r.fields is not None), None)
    if others is None:
        return None
    image = {"image": {"kind": "image", "components": exts or ["jpg"]}}
    return fields_from_json(image | others, "the written split")


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
    pixel = PixelStats.combine([r.pixel_sums for r in written])
    return SplitInfo(
        fields=_fields(results, exts),
        shards=[
            ShardInfo(
                r.name,
                r.index,
                r.num_samples,
                r.bytes,
                r.sha256,
                index_sha256=r.index_sha256,
                sums=r.sums,
                sums_sha256=r.sums_sha256,
            )
            for r in written
        ],
        class_counts=counts,
        encoding=stored if encoding != "raw" else "raw",
        raw_shape=raw_shape,
        image_stats=stats,
        skipped=[SkippedSample(origin, reason) for r in results for origin, reason in r.skipped],
        pixel_mean=pixel[0] if pixel else None,
        pixel_std=pixel[1] if pixel else None,
    )
