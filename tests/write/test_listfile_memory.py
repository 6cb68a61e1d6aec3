"""Memory of `fastdata shard list` before writing: parsing the list and planning the shards.

The rows go to files as they are parsed (`fastdata.write.sources.rowfile`) and each split's
permutation to a file (`fastdata.write.permfile`): what the driver holds in memory is a few
objects per split and per shard, not per row. Before the row files it held ~40 bytes a row
(compact columns and an int64 permutation), and ~390 before the columns: this test fails on both.
"""

from __future__ import annotations

import csv
import gc
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from fastdata.write import permfile
from fastdata.write.plan import plan_jobs
from fastdata.write.sources import ListSource, rowfile
from fastdata.write.writer import ShardOptions

# Bytes a row of growth allowed from 20k to 200k rows: the shard jobs (a few hundred bytes each,
# 1000 rows a shard) amount to under 1 byte a row; the columns in memory were ~40.
PER_ROW_BOUND = 4


def _list(path: Path, rows: int) -> Path:
    with path.open("w") as file:
        file.write("path,label,split\n")
        for i in range(rows):
            file.write(f"img/{i % 7}.png,{i % 10},{'val' if i % 10 == 0 else ''}\n")
    return path


def _peak(path: Path) -> int:
    """Peak traced bytes of opening the list and planning its shards (kept alive together)."""
    gc.collect()
    tracemalloc.start()
    try:
        source = ListSource(path)
        jobs = plan_jobs(source, ShardOptions(seed=3, max_count=1000))
        assert sum(job.count for job in jobs) == sum(source.splits().values())
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_parse_and_plan_hold_no_memory_per_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fixed buffers (rows gathered before a write, the permutation's chunk and window: a few
    # MB each) made small, so that they are full at both sizes and only per-row costs remain.
    monkeypatch.setattr(rowfile, "_BUFFER", 4096)
    monkeypatch.setattr(permfile, "CHUNK", 4096)
    monkeypatch.setattr(permfile, "WINDOW", 4096)
    # ~20 s on 2 CPUs (tracemalloc slows parsing).
    small, large = 20_000, 200_000
    # The small list first: it pays the modules imported on first use, not the large one.
    before = _peak(_list(tmp_path / "small.csv", small))
    grown = _peak(_list(tmp_path / "large.csv", large)) - before
    per_row = grown / (large - small)
    assert per_row < PER_ROW_BOUND, f"{per_row:.1f} bytes a row"


def test_the_columns_give_what_a_plain_csv_reading_gives(tmp_path: Path) -> None:
    """The streamed, columnar source against a direct reading of the CSV: same splits, paths,
    labels, lines; the plan is the seeded permutation cut in order, as it always was."""
    path = tmp_path / "list.csv"
    with path.open("w") as file:
        file.write("path,label,split\n")
        for i in range(500):
            file.write(
                f"d\u00e9j\u00e0/{i}.png,{['cat', 'dog', 'eel'][i % 3]},{'val' * (i % 4 == 0)}\n"
            )
    source = ListSource(path)
    expected: dict[str, list[tuple[str, str, int]]] = {}
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        for record in reader:
            split = record["split"] or "train"
            expected.setdefault(split, []).append(
                (record["path"], record["label"], reader.line_num)
            )
    assert source.splits() == {s: len(v) for s, v in expected.items()}
    for split, rows in expected.items():
        for index, (name, label, line) in enumerate(rows):
            item = source.item(split, index)
            assert (item.source_id, source.classes[item.label]) == (name, label)
            assert item.origin == f"{tmp_path / name} (list.csv:{line})"
    options = ShardOptions(seed=7, max_count=64)
    jobs = plan_jobs(source, options)
    for split, count in source.splits().items():
        mine = [job for job in jobs if job.split == split]
        order = np.concatenate([job.sample_ids for job in mine]).tolist()
        rng = np.random.default_rng([options.seed, zlib.crc32(split.encode())])
        assert order == rng.permutation(count).tolist()
        assert [job.count for job in mine][:-1] == [64] * (len(mine) - 1)
