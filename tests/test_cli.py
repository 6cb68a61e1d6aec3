"""The command line (shard / inspect / verify) on tiny data and on the real data."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from fastdata.cli import main
from fastdata.format.manifest_io import load_manifest
from tests.conftest import write_jpeg_folder


def test_shard_inspect_verify_on_a_folder(tmp_path, capsys):
    root = write_jpeg_folder(tmp_path / "imgs")
    out = tmp_path / "out"
    assert main(["shard", "folder", str(root), str(out), "--no-progress", "--max-count", "5"]) == 0
    assert "12 samples in    3 shards" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    assert "classes: 3" in capsys.readouterr().out
    assert main(["verify", str(out), "--no-progress"]) == 0
    assert "checked 3 shards, 12 samples: OK" in capsys.readouterr().out


def test_verify_lists_each_bad_shard_and_sample(tmp_path, capsys):
    root = write_jpeg_folder(tmp_path / "imgs")
    out = tmp_path / "out"
    main(["shard", "folder", str(root), str(out), "--no-progress", "--max-count", "5"])
    manifest = load_manifest(out)
    shard = manifest.split(next(iter(manifest.splits))).shards[1]
    path = Path(manifest.shard_url(shard))
    data = bytearray(path.read_bytes())
    start = data.find(b"\xff\xd8\xff")
    data[start + 2 : start + 200] = b"\x00" * 198
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(out), "--no-progress"]) == 1
    report = capsys.readouterr().out
    assert f"bad shard  {shard.name}: sha256/size differ" in report
    assert f"bad sample {shard.name} " in report and "1 bad samples" in report


def test_refused_output_is_a_clean_error(tmp_path, capsys):
    root = write_jpeg_folder(tmp_path / "imgs")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["shard", "folder", str(root), str(out), "--no-progress"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "fastdata", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.startswith("fastdata ")


def _archive_rows(archive: Path, member: str) -> dict:
    with tarfile.open(archive) as tar:
        return pickle.load(io.BytesIO(tar.extractfile(member).read()), encoding="latin1")


@pytest.mark.realdata
def test_real_cifar100(real_data, tmp_path):
    wds = pytest.importorskip("webdataset")  # absent on the bare GPU machine
    out = tmp_path / "cifar100"
    assert (
        main(
            [
                "shard",
                "cifar100",
                str(real_data / "cifar-100-python.tar.gz"),
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    manifest = load_manifest(out)
    assert manifest.num_classes == 100
    assert (
        manifest.split("train").num_samples == 50_000
        and manifest.split("test").num_samples == 10_000
    )
    assert set(manifest.split("train").class_counts) == {500}
    assert set(manifest.split("test").class_counts) == {100}
    rows = _archive_rows(real_data / "cifar-100-python.tar.gz", "cifar-100-python/train")
    checked = 0
    for sample in wds.WebDataset(
        manifest.shard_url(manifest.split("train").shards[0]), shardshuffle=False
    ):
        label, sample_id = np.frombuffer(sample["lid"], dtype="<i8")
        expected = rows["data"][sample_id].reshape(3, 32, 32).transpose(1, 2, 0)
        np.testing.assert_array_equal(
            np.frombuffer(sample["rgb"], np.uint8).reshape(32, 32, 3), expected
        )
        assert label == rows["fine_labels"][sample_id]
        checked += 1
        if checked == 200:
            break


@pytest.mark.realdata
def test_real_clothing_folder(real_data, tmp_path):
    wds = pytest.importorskip("webdataset")  # absent on the bare GPU machine
    out = tmp_path / "clothing"
    assert (
        main(["shard", "folder", str(real_data / "clothing-small"), str(out), "--no-progress"]) == 0
    )
    manifest = load_manifest(out)
    assert {k: v.num_samples for k, v in manifest.splits.items()} == {
        "train": 800,
        "validation": 341,
        "test": 372,
    }
    assert manifest.num_classes == 10 and manifest.split("train").encoding == "jpeg"
    from fastdata.write.sources import FolderSource

    source = FolderSource(real_data / "clothing-small")
    samples = list(
        wds.WebDataset(manifest.shard_url(manifest.split("test").shards[0]), shardshuffle=False)
    )
    assert len(samples) == 372
    for sample in samples:  # each sample's bytes are its own source file's, byte for byte
        label, sample_id = np.frombuffer(sample["lid"], dtype="<i8")
        item = source.item("test", int(sample_id))
        assert sample["jpg"] == item.path.read_bytes() and label == item.label


def test_index_and_shard_parse_without_loading_torch():
    """`fastdata index` is built in (as `shard` is): its parser loads no feature command."""
    code = (
        "import sys\nfrom fastdata.cli import main\n"
        "for command in ('index', 'shard'):\n"
        "    try:\n        main([command, '--help'])\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('torch', 'lightning', 'fastdata.tune') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("[]"), result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--classes", "names.txt"],
            "--classes is for the list, segmentation, parquet, video sources",
        ),
        (["--split", "val"], "--split is for the coco, parquet sources, not folder"),
        (["--max-json-bytes", "4GB"], "--max-json-bytes is for the coco source, not folder"),
        (["--max-classes", "5"], "--max-classes is for the list, video sources, not folder"),
        (["--ignore-index", "0"], "--ignore-index is for the segmentation source, not folder"),
        (["--download"], "--download is for the cifar10, cifar100 sources, not folder"),
    ],
)
def test_a_source_flag_goes_only_to_the_sources_the_registry_names(
    tmp_path, capsys, flags, message
):
    root = write_jpeg_folder(tmp_path / "imgs")
    assert main(["shard", "folder", str(root), str(tmp_path / "out"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_shard_defaults_are_shard_options_defaults():
    from dataclasses import fields

    from fastdata.cli import build_parser
    from fastdata.write import ShardOptions

    args = build_parser(features=False).parse_args(["shard", "folder", "in", "out"])
    for f in fields(ShardOptions):
        if f.name != "progress":
            assert getattr(args, f.name) == getattr(ShardOptions(), f.name), f.name


def test_a_part_names_the_command_of_every_part_with_its_flags(tmp_path, capsys):
    root = write_jpeg_folder(tmp_path / "imgs")
    out = tmp_path / "out"
    flags = ["--max-count", "5", "--max-size", "1MiB", "--strict", "--no-progress"]
    assert main(["shard", "folder", str(root), str(out), *flags, "--part", "0/2"]) == 0
    capsys.readouterr()
    assert main(["merge", str(out)]) == 2  # part 1 has not run: merge names its command
    expected = f"fastdata shard folder {root} {out} --max-count 5 --max-size 1048576 --strict"
    assert f"run `{expected} --part 1/2`" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["shard", "index"])
def test_a_classes_file_is_read_one_way_by_shard_and_index(tmp_path, capsys, command):
    """Line i names class i: a blank line inside would shift every later class (index dropped
    it silently), so both commands refuse it naming the file."""
    names = tmp_path / "names.txt"
    names.write_text("cat\n\ndog\n")
    argv = (
        ["shard", "list", "labels.csv", str(tmp_path / "out"), "--classes", str(names)]
        if command == "shard"
        else ["index", str(tmp_path), "--out", str(tmp_path / "out"), "--classes", str(names)]
    )
    assert main(argv) == 2
    assert f"--classes {names}: needs one non-empty name a line" in capsys.readouterr().err
