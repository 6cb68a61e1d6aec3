"""A list file is untrusted input: split names, label bounds and bytes that are not UTF-8."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.cli import main
from fastdata.write import ShardingError, ShardOptions, write_shards
from fastdata.write.sources import BadSourceError, ListSource


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def _files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "split", ["../escaped", "/abs/path", "a/b", ".", "..", "x.y", "-x", "sp ace", "é", "a" * 65]
)
def test_split_names_that_are_paths_are_refused_with_file_and_line(
    tmp_path: Path, split: str
) -> None:
    lst = _write(tmp_path / "l.csv", f"path,label,split\na.png,0,train\nb.png,1,{split}\n")
    with pytest.raises(BadSourceError, match="split name") as info:
        ListSource(lst)
    assert f"{lst}:3:" in str(info.value)
    jsonl = _write(tmp_path / "l.jsonl", json.dumps({"path": "a.png", "label": 0, "split": split}))
    with pytest.raises(BadSourceError, match="split name") as info:
        ListSource(jsonl)
    assert f"{jsonl}:1:" in str(info.value)


def test_valid_split_names_still_work(tmp_path: Path) -> None:
    lst = _write(tmp_path / "l.csv", "path,label,split\na.png,0,val_2-b\nb.png,1,\nc.png,1,Test9\n")
    assert ListSource(lst, split="train-all").splits() == {"val_2-b": 1, "train-all": 1, "Test9": 1}
    with pytest.raises(ValueError, match="split name"):
        ListSource(lst, split="../up")


def test_cli_writes_nothing_outside_out_for_an_escaping_split(tmp_path: Path) -> None:
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    lst = _write(tmp_path / "in" / "l.csv", "path,label,split\n../a.png,0,../escaped\n")
    before = _files_under(tmp_path)
    code = main(["shard", "list", str(lst), str(tmp_path / "out" / "o"), "--no-progress"])
    assert code == 2
    assert _files_under(tmp_path) - before <= {"out", "out/o"}  # at most the empty OUT


@pytest.mark.parametrize("label", ["99999999999", "1" + "0" * 5000, "100000"])
def test_a_huge_index_label_is_refused_before_the_class_list_is_built(
    tmp_path: Path, label: str
) -> None:
    lst = _write(tmp_path / "l.csv", f"path,label\na.png,0\nb.png,{label}\nc.png,2\n")
    with pytest.raises(BadSourceError, match="max_classes=100,000") as info:
        ListSource(lst)
    assert f"{lst}:3:" in str(info.value) and len(str(info.value)) < 600
    # A label just under the bound is accepted, and the bound is configurable.
    ok = _write(tmp_path / "ok.csv", "path,label\na.png,0\nb.png,99999\n")
    assert len(ListSource(ok).classes) == 100_000
    with pytest.raises(BadSourceError, match="max_classes=1,000"):
        ListSource(ok, max_classes=1000)


def test_huge_json_label_and_too_many_names(tmp_path: Path) -> None:
    jsonl = _write(tmp_path / "l.jsonl", '{"path": "a.png", "label": 123456789012345678901}\n')
    with pytest.raises(BadSourceError, match="max_classes") as info:
        ListSource(jsonl)
    assert f"{jsonl}:1:" in str(info.value)
    digits = _write(tmp_path / "d.jsonl", '{"path": "a.png", "label": ' + "9" * 5000 + "}\n")
    with pytest.raises(BadSourceError, match=f"{digits}:1: not valid JSON"):
        ListSource(digits)
    names = _write(
        tmp_path / "n.csv", "path,label\n" + "".join(f"{i}.png,c{i}\n" for i in range(6))
    )
    with pytest.raises(BadSourceError, match="max_classes=5") as info:
        ListSource(names, max_classes=5)
    assert f"{names}:7:" in str(info.value)


def test_latin1_bytes_name_the_file_and_line(tmp_path: Path) -> None:
    lst = _write(tmp_path / "l.csv", "path,label\na.png,0\ncaf\xe9.png,1\n".encode("latin-1"))
    with pytest.raises(BadSourceError, match="not UTF-8") as info:
        ListSource(lst)
    assert f"{lst}:3:" in str(info.value) and "0xe9" in str(info.value)
    jsonl = _write(tmp_path / "l.jsonl", b'{"path": "a.png", "label": 0}\n{"path": "\xe9"}\n')
    with pytest.raises(BadSourceError, match=f"{jsonl}:2: not UTF-8"):
        ListSource(jsonl)


def test_nul_bytes_and_utf16_name_the_file_and_line(tmp_path: Path) -> None:
    lst = _write(tmp_path / "l.csv", b"path,label\na.png,0\nb.png,1\x00\n")
    with pytest.raises(BadSourceError, match=f"{lst}:3: NUL byte"):
        ListSource(lst)
    utf16 = _write(tmp_path / "u.csv", "path,label\na.png,0\n".encode("utf-16"))
    with pytest.raises(BadSourceError, match=f"{utf16}:1: NUL byte.*UTF-16"):
        ListSource(utf16)
    # A byte-order mark (as spreadsheets write) is still fine.
    bom = _write(tmp_path / "b.csv", "path,label\na.png,0\n".encode("utf-8-sig"))
    assert ListSource(bom).splits() == {"train": 1}


def test_csv_and_json_limits_name_the_line(tmp_path: Path) -> None:
    wide = _write(tmp_path / "w.csv", "path,label\na.png,0\n" + "b" * 200_000 + ".png,1\n")
    with pytest.raises(BadSourceError, match=f"{wide}:3: not valid CSV"):
        ListSource(wide)
    deep = _write(tmp_path / "d.jsonl", '{"path": "a.png", "label": 0}\n' + "[" * 100_000 + "\n")
    with pytest.raises(BadSourceError, match=f"{deep}:2: not a flat JSON object"):
        ListSource(deep)


def test_writer_refuses_a_split_name_from_any_source(tmp_path: Path) -> None:
    """Defence in depth: a source that does not check its split names cannot write outside."""
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "a.png")
    src = ListSource(_write(tmp_path / "l.csv", "path,label\na.png,0\n"))
    src._rows = {"../../evil": src._rows["train"]}
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(ShardingError, match="split name '../../evil'"):
        write_shards(src, out, ShardOptions(workers=1, progress=False))
    assert not any(p.suffix in (".tar", ".idx") for p in tmp_path.rglob("*"))
    assert not [p for p in os.listdir(tmp_path) if p not in ("a.png", "l.csv", "a")]
