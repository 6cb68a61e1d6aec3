"""A split's source-id file merged from the shards' sorted runs (`fastdata.write.source_ids`):
the same bytes as the whole mapping dumped at once, in bounded memory, nothing left behind."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from fastdata.format import schema
from fastdata.write import source_ids
from fastdata.write.source_ids import source_ids_text, write_id_run, write_source_ids


def _runs(tmp_path: Path, ids: dict[str, int | str], count: int) -> list[Path | dict]:
    keys = list(ids)
    random.Random(0).shuffle(keys)  # a shard holds samples from anywhere in the split
    runs: list[Path | dict] = []
    for number in range(count):
        part = {k: ids[k] for k in keys[number::count]}
        if number % 4 == 3:  # a done record of an older fastdata: the ids inline
            runs.append(part)
        else:
            path = tmp_path / "work" / f"s{number}.ids.run"
            path.parent.mkdir(exist_ok=True)
            write_id_run(path, part)
            runs.append(path)
    return runs


@pytest.mark.parametrize("fan_in", [2, 3, 128])
def test_the_merged_file_is_the_whole_mapping_dumped_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fan_in: int
) -> None:
    monkeypatch.setattr(source_ids, "MERGE_FAN_IN", fan_in)
    # Ids across the 8 -> 9 digit boundary of the keys (string order, not numeric), paths with
    # quotes, non-ASCII and backslashes, and COCO-style integers.
    ids: dict[str, int | str] = {}
    for sample in [*range(0, 500), *range(99_999_990, 100_000_010)]:
        key = schema.sample_key("train", sample)
        ids[key] = sample * 7 if sample % 3 == 0 else f'd\u00e9j\u00e0/"{sample}"\\x.png'
    runs = _runs(tmp_path, ids, 11)
    name, digest = write_source_ids(tmp_path, "train", runs, scratch=tmp_path / "work")
    expected = source_ids_text("train", ids).encode()
    assert (tmp_path / name).read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    leftovers = [p.name for p in (tmp_path / "work").iterdir() if not p.name.endswith(".ids.run")]
    assert leftovers == []
    assert {p.name for p in tmp_path.iterdir()} == {"work", name}


def test_no_ids_write_no_file(tmp_path: Path) -> None:
    write_id_run(tmp_path / "a.ids.run", {})
    assert write_source_ids(tmp_path, "val", [tmp_path / "a.ids.run", {}]) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ids.run"]


def test_a_failed_merge_leaves_neither_a_partial_file_nor_scratch_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source_ids, "MERGE_FAN_IN", 2)
    ids = {schema.sample_key("val", i): f"{i}.png" for i in range(100)}
    runs = _runs(tmp_path, ids, 7)
    bad = tmp_path / "work" / "s5.ids.run"  # found in a later group of the first round
    bad.write_text(bad.read_text() + "no tab here\n")
    with pytest.raises(ValueError, match="s5.ids.run"):
        write_source_ids(tmp_path, "val", runs, scratch=tmp_path / "work")
    names = {p.name for p in tmp_path.rglob("*")}
    assert not any("tmp" in n or n.startswith(".source-ids") for n in names), names
    assert "val-source-ids.json" not in names


def test_a_run_is_sorted_and_written_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.ids.run"
    write_id_run(path, {"b_00000002": "b", "a_00000001": 1})
    assert path.read_text() == 'a_00000001\t1\nb_00000002\t"b"\n'

    def boom(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(source_ids.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_id_run(tmp_path / "y.ids.run", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ids.run"]
