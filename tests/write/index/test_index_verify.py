"""`fastdata verify` and `fastdata inspect` on folders made by `fastdata index`: they read samples
through the loaders' schema and row reader, so a foreign shard's `cls` + `jpg` sample (no `lid`)
is good, and a flipped byte or a missing component is still a finding."""

from __future__ import annotations

import json
from pathlib import Path

from fastdata.cli import main
from fastdata.write.index import IndexOptions, index_shards
from tests.conftest import rehash_indexes


def _verify(root: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["verify", str(root), "--no-progress"])
    return code, capsys.readouterr().out


def test_verify_and_inspect_pass_on_an_indexed_folder(cls_shards: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    index_shards(cls_shards, out)
    code, text = _verify(out, capsys)
    assert code == 0, text
    assert "checked 5 shards, 29 samples: OK" in text  # train: 20 in 3 tars, test: 9 in 2
    assert main(["inspect", str(out)]) == 0


def test_verify_reports_a_flipped_byte_in_an_indexed_folder(
    cls_shards: Path, tmp_path: Path, capsys
):
    out = tmp_path / "out"
    manifest = index_shards(cls_shards, out, IndexOptions(splits={"test": "test-*"}))
    shard = manifest.split("test").shards[0]
    entries = (out / shard.index).read_text().splitlines()[1:]
    jpg_offset = int(entries[1].split()[5])  # sample 000001: cls, then jpg
    tar = cls_shards / shard.name
    data = bytearray(tar.read_bytes())
    data[jpg_offset + 200] ^= 0xFF
    tar.write_bytes(bytes(data))
    code, text = _verify(out, capsys)
    assert code == 1
    assert f"bad shard  {shard.name}: sha256/size differ" in text
    assert f"bad sample {shard.name} 000001: " in text and "1 bad samples" in text


def test_verify_reports_a_missing_component_in_an_indexed_folder(
    cls_shards: Path, tmp_path: Path, capsys
):
    out = tmp_path / "out"
    manifest = index_shards(cls_shards, out, IndexOptions(splits={"test": "test-*"}))
    shard = manifest.split("test").shards[0]
    (out / shard.sums).unlink()  # no per-sample digests: only reading the sample can tell
    data = json.loads((out / "manifest.json").read_text())
    for entry in data["splits"]["test"]["shards"]:
        if entry["name"] == shard.name:
            entry["sums"] = entry["sums_sha256"] = None
    (out / "manifest.json").write_text(json.dumps(data))
    index = out / shard.index
    lines = index.read_text().splitlines()
    lines[2] = " ".join(lines[2].split()[:4])  # sample 000001 keeps its cls, loses its jpg
    index.write_text("\n".join(lines) + "\n")
    rehash_indexes(out)
    code, text = _verify(out, capsys)
    assert code == 1, text
    assert f"bad sample {shard.name} 000001: " in text
    assert "no image component" in text and "1 bad samples" in text
