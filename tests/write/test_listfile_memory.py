"""Memory of `fastdata shard list` before writing: parsing the list and planning the shards.

The driver holds, per row, compact columns (the path's UTF-8 bytes, an 8-byte end offset, label
token id and line number) and the plan an 8-byte slice of the permutation: ~40 bytes a row plus
the path. Python objects per row (a str, an int, a tuple: 30-80 bytes each) would show as
hundreds of bytes a row; before the columns it cost ~390 bytes a row (20k -> 200k rows: this test fails there).
"""

from __future__ import annotations

import csv
import gc
import tracemalloc
import zlib
from pathlib import Path

import numpy as np

from fastdata.write.sources import ListSource
from fastdata.write.writer import ShardOptions, plan_jobs

# Bytes a row: 9 of path ("img/3.png"), 8 + 8 + 8 of columns, 8 of permutation = 41; array and
# bytearray growth over-allocate up to ~1/8; 80 leaves room for that and an allocator's rounding,
# and is ~7x below a list of objects per row.
PER_ROW_BOUND = 80


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
        assert sum(len(job.sample_ids) for job in jobs) == sum(source.splits().values())
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_parse_and_plan_cost_a_few_dozen_bytes_a_row(tmp_path: Path) -> None:
    # ~20 s on 2 CPUs (tracemalloc slows parsing).
    small, large = 20_000, 200_000
    grown = _peak(_list(tmp_path / "large.csv", large)) - _peak(
        _list(tmp_path / "small.csv", small)
    )
    per_row = grown / (large - small)
    assert 0 < per_row < PER_ROW_BOUND, f"{per_row:.0f} bytes a row"


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
        assert [len(job.sample_ids) for job in mine][:-1] == [64] * (len(mine) - 1)
