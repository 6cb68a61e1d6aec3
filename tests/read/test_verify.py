"""`fastdata verify` and `fastdata inspect` report malformed manifests, indexes and shards as
findings (exit 1), never with a traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fastdata.cli import main
from tests.conftest import rehash_indexes


def _run(command: str, root: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    args = [command, str(root)] + (["--no-progress"] if command == "verify" else [])
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _edit_manifest(root: Path, change) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data)))


def _shift_index(root: Path) -> None:
    index = root / "train-000001.idx"
    lines = index.read_text().splitlines()
    step = int(lines[2].split()[1]) - int(lines[1].split()[1])
    out = [lines[0]]
    for line in lines[1:]:
        fields = line.split()
        for i in range(1, len(fields), 4):
            fields[i] = str(int(fields[i]) + step)
        out.append(" ".join(fields))
    index.write_text("\n".join(out) + "\n")


def _garbage_index(root: Path) -> None:
    (root / "train-000001.idx").write_bytes(b"v1.2 64\n\x00\xff garbage here 12\n" * 3)


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_json_list_manifest_is_a_finding(tiny_shards, capsys, command):
    (tiny_shards / "manifest.json").write_text("[1, 2, 3]\n")
    code, out = _run(command, tiny_shards, capsys)
    assert code == 1
    assert "bad manifest" in out and "JSON list, not an object" in out


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_string_counts_are_a_finding_naming_the_shard(tiny_shards, capsys, command):
    def stringify(data: dict) -> dict:
        for shard in data["splits"]["train"]["shards"]:
            shard["num_samples"] = str(shard["num_samples"])
        return data

    _edit_manifest(tiny_shards, stringify)
    code, out = _run(command, tiny_shards, capsys)
    assert code == 1
    assert "bad manifest" in out and "train-000000.tar" in out and "positive integer" in out


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize("vouched", [False, True])
def test_a_garbage_index_is_a_finding(tiny_shards, capsys, command, vouched):
    _garbage_index(tiny_shards)
    if vouched:
        rehash_indexes(tiny_shards)
    code, out = _run(command, tiny_shards, capsys)
    assert code == 1
    assert "train-000001.tar" in out
    expected = "non-number offset or size" if vouched else "index file .* differs"
    assert re.search(expected, out), out


@pytest.mark.parametrize("vouched", [False, True])
def test_a_shifted_index_is_a_finding(tiny_shards, capsys, vouched):
    code, out = _run("verify", tiny_shards, capsys)
    assert code == 0 and "checked 6 shards, 350 samples: OK" in out
    _shift_index(tiny_shards)
    if vouched:  # a wrong index whose checksum matches: only the tar headers disagree
        rehash_indexes(tiny_shards)
    code, out = _run("verify", tiny_shards, capsys)
    assert code == 1, out
    if vouched:
        assert "bad sample train-000001.tar train_" in out and "tar header names" in out
    else:
        assert "bad shard  train-000001.tar: index file" in out and "differs" in out


def test_inspect_reports_a_shifted_index_by_its_checksum(tiny_shards, capsys):
    code, out = _run("inspect", tiny_shards, capsys)
    assert code == 0 and "problem" not in out
    _shift_index(tiny_shards)
    code, out = _run("inspect", tiny_shards, capsys)
    assert code == 1 and "problem: train-000001.tar: index file" in out


def test_verify_reports_a_label_outside_the_classes(tiny_shards, capsys):
    def two_classes(data: dict) -> dict:
        data["classes"] = data["classes"][:2]
        for split in data["splits"].values():
            split["class_counts"] = [sum(split["class_counts"]), 0]  # counts still add up
        return data

    _edit_manifest(tiny_shards, two_classes)
    code, out = _run("verify", tiny_shards, capsys)
    assert code == 1 and "is outside the manifest's 2 classes" in out
