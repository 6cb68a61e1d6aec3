"""`fastdata.format.manifest_io.load_manifest` on untrusted manifests: every file a manifest
names stays inside the dataset (one rule for paths), and its counts are checked, at load.

What the readers check on every read: tests/read/test_untrusted.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from fastdata.format.manifest import ManifestError
from fastdata.format.manifest_io import load_manifest


def _edit_manifest(root: Path, change) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _first_shard(data: dict) -> dict:
    return data["splits"]["train"]["shards"][0]


# ----------------------------------------------------------------------------- one rule for paths


def test_an_absolute_shard_path_is_refused_at_load(tiny_shards, tmp_path):
    outside = tmp_path / "elsewhere.tar"
    shutil.copy(tiny_shards / "train-000000.tar", outside)
    _edit_manifest(tiny_shards, lambda d: _first_shard(d).update(name=str(outside)))
    with pytest.raises(ManifestError, match=r"shard .*elsewhere\.tar.* leaves the dataset"):
        load_manifest(tiny_shards)


def test_a_dotdot_index_path_is_refused_at_load(tiny_shards, tmp_path):
    shutil.copy(tiny_shards / "train-000000.idx", tmp_path / "x.idx")
    _edit_manifest(tiny_shards, lambda d: _first_shard(d).update(index="../x.idx"))
    with pytest.raises(ManifestError, match=r"train-000000\.tar.*index: '\.\./x\.idx' leaves"):
        load_manifest(tiny_shards)


def test_a_percent_encoded_dotdot_is_refused(tiny_shards):
    _edit_manifest(tiny_shards, lambda d: _first_shard(d).update(name="%2e%2e/x.tar"))
    with pytest.raises(ManifestError, match="leaves the dataset"):
        load_manifest(tiny_shards)


def test_a_symlink_out_of_the_dataset_is_refused_at_load(tiny_shards, tmp_path):
    shard = tiny_shards / "train-000000.tar"
    os.replace(shard, tiny_shards / "real.tar")
    shard.symlink_to("real.tar")  # a symlink that stays inside the dataset is fine
    assert len(load_manifest(tiny_shards).split("train").shards) == 5
    outside = tmp_path / "outside.tar"
    os.replace(tiny_shards / "real.tar", outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(ManifestError, match=r"train-000000\.tar.*outside the dataset folder"):
        load_manifest(tiny_shards)


# ----------------------------------------------------------------------------- counts


@pytest.mark.parametrize("count", [0, -5, "64", 1.5, True])
def test_a_non_positive_or_non_integer_count_is_refused_naming_the_shard(tiny_shards, count):
    _edit_manifest(tiny_shards, lambda d: _first_shard(d).update(num_samples=count))
    with pytest.raises(ManifestError, match=r"train-000000\.tar.*num_samples must be a positive"):
        load_manifest(tiny_shards)
