"""The conversion's plan: each split's seeded permutation, cut into shard jobs.

`plan_jobs` is a pure function of the source's split sizes and the options (seed, max_count,
max_size): a single run, every `--part` and every engine task compute or read the same jobs. The
permutation is numpy's (`Generator.permutation` with the seed and the split's name), kept in a
file per split (`fastdata.write.permfile`) so that a plan of 100 million samples holds a few
objects per shard in memory, not 800 MB of ids; a `ShardJob` names its slice of that file.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fastdata.write.errors import ShardingError
from fastdata.write.permfile import read_slice, write_permutation
from fastdata.write.sources.base import Source, split_name_problem
from fastdata.write.sources.rowfile import RowFolder

__all__ = ["PLAN_DIR", "PlanOptions", "PlanSlice", "ShardJob", "plan_jobs"]

PLAN_DIR = "plan"  # the permutation files in a writer's work folder


class PlanOptions(Protocol):
    """What the plan reads of the shard options (`fastdata.write.writer.ShardOptions`)."""

    seed: int
    max_count: int
    max_size: int | None


class PlanSlice:
    """Positions [start, stop) of a split's permutation file (`fastdata.write.permfile`).

    Pickled (to a worker, a Ray task) it is the file's path and the two positions; `owner`
    (what keeps a temporary plan folder alive) stays with the process that planned.
    """

    __slots__ = ("owner", "path", "start", "stop")

    def __init__(self, path: Path, start: int, stop: int, owner: object = None) -> None:
        self.path, self.start, self.stop, self.owner = path, start, stop, owner

    def read(self) -> np.ndarray:
        """The sample ids at these positions (int64)."""
        return read_slice(self.path, self.start, self.stop)

    def __reduce__(self) -> tuple[Any, ...]:
        return PlanSlice, (self.path, self.start, self.stop)

    def __repr__(self) -> str:
        return f"PlanSlice({str(self.path)!r}, {self.start}, {self.stop})"


@dataclass(frozen=True)
class ShardJob:
    """One shard to write: its split, file stem and where its source sample ids are.

    The ids are a slice of the split's permutation, kept in a file (`ids`, read back by
    `sample_ids`): a plan of 100 million samples holds a few objects per shard in memory, not
    800 MB of ids.
    """

    split: str
    stem: str
    ids: PlanSlice

    @property
    def sample_ids(self) -> np.ndarray:
        """The shard's source sample ids in order (1-D int64, read from the plan's file)."""
        return self.ids.read()

    @property
    def count(self) -> int:
        """How many source samples the shard takes (nothing is read)."""
        return self.ids.stop - self.ids.start


def plan_jobs(source: Source, options: PlanOptions, folder: Path | None = None) -> list[ShardJob]:
    """Permute each split with the seed and cut it into shards (no shard is written).

    Each split's permutation (`Generator.permutation`, the same numbers as ever) goes into a
    file, `<split>.perm` in `folder` (default: a temporary folder removed when the jobs are
    gone); the jobs name slices of it. The memory held does not grow with the split's size.
    """
    if options.max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {options.max_count}")
    owner: RowFolder | None = None
    if folder is None:
        owner = RowFolder(prefix="fastdata-plan-")
        folder = owner.path
    folder.mkdir(parents=True, exist_ok=True)
    jobs: list[ShardJob] = []
    for split, count in sorted(source.splits().items()):
        if (problem := split_name_problem(split)) is not None:  # it becomes a file name in OUT
            raise ShardingError(f"{source.kind} source: {problem}")
        # The split name enters the seed so that splits are shuffled independently.
        path = folder / f"{split}.perm"
        write_permutation(path, count, [options.seed, zlib.crc32(split.encode())])
        sizes = _estimated_sizes(source, split, path, count) if options.max_size else None
        for number, (start, stop) in enumerate(
            _cut(count, sizes, options.max_count, options.max_size)
        ):
            jobs.append(
                ShardJob(split, f"{split}-{number:06d}", PlanSlice(path, start, stop, owner))
            )
    return jobs


def _cut(
    count: int, sizes: Iterator[int] | None, max_count: int, max_size: int | None
) -> Iterator[tuple[int, int]]:
    """(start, stop) of each shard in the permuted order: at most `max_count` samples and,
    given `sizes` (in permuted order), at most `max_size` estimated bytes (a larger sample
    alone in its shard)."""
    if sizes is None or not max_size:  # count only: fixed slices, no per-sample loop
        yield from ((start, min(start + max_count, count)) for start in range(0, count, max_count))
        return
    start, shard_bytes = 0, 0
    for pos, size in enumerate(sizes):
        if pos > start and (pos - start >= max_count or shard_bytes + size > max_size):
            yield start, pos
            start, shard_bytes = pos, 0
        shard_bytes += size
    if count > start:
        yield start, count


_SIZE_CHUNK = 1 << 16  # permutation entries read at a time while estimating sizes


def _estimated_sizes(source: Source, split: str, path: Path, count: int) -> Iterator[int]:
    """Each sample's estimated stored size, in permuted order (streamed from the plan file)."""
    for chunk in range(0, count, _SIZE_CHUNK):
        for sample_id in read_slice(path, chunk, min(chunk + _SIZE_CHUNK, count)).tolist():
            item = source.item(split, sample_id)
            if item.pixels is not None:
                yield int(item.pixels.nbytes)
            elif item.data is not None:
                yield len(item.data)
            else:
                yield item.path.stat().st_size if item.path and item.path.exists() else 0
