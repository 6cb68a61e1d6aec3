"""The source registry is the one list: `fastdata shard`'s choices, help and inputs come from it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fastdata.cli import build_parser, main
from fastdata.cli.shard import _part_command
from fastdata.write.sources import REGISTRY, SOURCES, open_source
from tests.write.sources.family_data import write_coco, write_segmentation


def _shard_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["shard"]


def test_cli_choices_and_help_are_the_registry() -> None:
    shard = _shard_parser()
    (source,) = [a for a in shard._actions if a.dest == "source"]
    assert list(source.choices) == list(REGISTRY) == list(SOURCES)
    text = shard.format_help()
    for kind in REGISTRY.values():
        assert f"{kind.name:<13} {' '.join(kind.inputs)} OUT: {kind.help}" in text
    assert "labels   several classes" in text and "caption / text" in text  # the column syntax


def test_open_source_checks_the_number_of_inputs(tmp_path: Path) -> None:
    images, ann = write_coco(tmp_path)
    assert open_source("coco", images, ann).splits() == {"train": 4}
    with pytest.raises(ValueError, match=r"takes 2 input\(s\) \(IMAGES, ANNOTATIONS\), got 1"):
        open_source("coco", images)


def test_cli_shards_coco_and_segmentation(tmp_path: Path, capsys) -> None:
    images, ann = write_coco(tmp_path / "coco")
    out = tmp_path / "out"
    argv = ["shard", "coco", str(images), str(ann), str(out), "--split", "val", "--no-progress"]
    assert main([*argv, "--max-side", "100"]) == 0
    saved = json.loads((out / "manifest.json").read_text())
    assert saved["source"]["options"]["max_side"] == 100
    assert sorted(saved["splits"]["val"]["fields"]) == ["boxes", "crowd", "image"]
    assert main(["inspect", str(out)]) == 0
    assert "fields: " in capsys.readouterr().out
    assert main(["verify", str(out), "--no-progress"]) == 0

    seg_images, masks = write_segmentation(tmp_path / "seg", count=2)
    classes = tmp_path / "classes.txt"
    classes.write_text("bg\na\nb\n")
    seg_out = tmp_path / "seg_out"
    argv = ["shard", "segmentation", str(seg_images), str(masks), str(seg_out), "--no-progress"]
    assert main([*argv, "--classes", str(classes)]) == 0
    assert json.loads((seg_out / "manifest.json").read_text())["classes"] == ["bg", "a", "b"]
    assert main(["shard", "coco", str(images), str(out), "--no-progress"]) == 2  # missing OUT
    assert "expected IMAGES ANNOTATIONS OUT" in capsys.readouterr().err


def test_part_command_repeats_every_input(tmp_path: Path) -> None:
    args = _shard_parser().parse_args(
        ["coco", "imgs", "ann.json", "out", "--max-side", "512", "--split", "val"]
    )
    command = _part_command(args)
    assert command.startswith("fastdata shard coco imgs ann.json out ")
    assert "--max-side 512" in command and "--split val" in command
