"""Rows on disk (`fastdata.write.sources.rowfile`): what a list source holds instead of its rows."""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
from pathlib import Path

import pytest

from fastdata.write.sources import ListSource, rowfile
from fastdata.write.sources.rowfile import RowFile, RowFolder


def _rows(count: int) -> list[bytes]:
    return [f"row {i} \u00e9".encode() * (i % 5) for i in range(count)]  # empty rows too


def test_rows_read_back_by_index_across_buffer_flushes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rowfile, "_BUFFER", 64)
    folder = RowFolder()
    rows = RowFile(folder, "a")
    expected = _rows(1000)
    for row in expected:
        rows.append(row)
    with pytest.raises(RuntimeError, match="finish"):
        rows[0]
    rows.finish()
    assert len(rows) == 1000
    assert [rows[i] for i in range(1000)] == expected
    with pytest.raises(IndexError):
        rows[1000]


def test_the_folder_goes_with_the_last_reference_and_a_copy_never_removes_it(
    tmp_path: Path,
) -> None:
    folder = RowFolder()
    path = folder.path
    rows = RowFile(folder, "a")
    rows.append(b"x")
    rows.finish()
    copy = pickle.loads(pickle.dumps(rows))  # what a Ray worker gets
    assert copy[0] == b"x"
    del copy
    gc.collect()
    assert path.is_dir()
    del folder, rows
    gc.collect()
    assert not path.exists()


def _child_reads(rows: RowFile, queue: mp.Queue) -> None:
    queue.put(rows[1])


def test_a_forked_worker_reads_the_rows_and_its_exit_leaves_them(tmp_path: Path) -> None:
    folder = RowFolder()
    rows = RowFile(folder, "a")
    for row in (b"a", b"bb", b"ccc"):
        rows.append(row)
    rows.finish()
    context = mp.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_reads, args=(rows, queue))
    child.start()
    assert queue.get(timeout=30) == b"bb"
    child.join(timeout=30)
    assert child.exitcode == 0
    assert folder.path.is_dir() and rows[2] == b"ccc"


def test_a_list_source_moves_its_rows_where_every_node_reads_them(tmp_path: Path) -> None:
    (tmp_path / "list.jsonl").write_text(
        '{"path": "a.png", "label": "cat", "caption": "x"}\n'
        '{"path": "b.png", "label": "dog", "labels": ["cat", "dog"], "score": [1.5, null]}\n'
    )
    source = ListSource(tmp_path / "list.jsonl")
    before = [source.item("train", i) for i in range(2)]
    shared = tmp_path / "shared"
    source.move_rows(shared)
    assert sorted(p.suffix for p in shared.iterdir()) == [".ends", ".rows"]
    remote = pickle.loads(pickle.dumps(source))
    after = [remote.item("train", i) for i in range(2)]
    for old, new in zip(before, after, strict=True):
        assert (old.path, old.label, old.source_id, old.origin) == (
            new.path,
            new.label,
            new.source_id,
            new.origin,
        )
        assert old.fields is not None and new.fields is not None
        assert old.fields.keys() == new.fields.keys()
        assert old.fields["labels"].tolist() == new.fields["labels"].tolist()
        assert old.fields["score"] == new.fields["score"]
        assert old.fields["caption"] == new.fields["caption"]
    assert after[1].fields["labels"].tolist() == [0, 1]
    assert after[1].fields["score"] == [1.5, None] and after[0].fields["score"] is None
    assert after[0].fields["caption"] == "x" and after[1].fields["caption"] == ""
