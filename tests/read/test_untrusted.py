"""Untrusted data on the read side: every file a manifest names stays inside the dataset, and the
bytes that place a sample (index, tar header, label, counts) are checked on every read."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from fastdata import WorkerSettings
from fastdata.format import manifest_io
from fastdata.format.manifest import ManifestError
from fastdata.format.manifest_io import load_manifest
from fastdata.read.backends import memory
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.backends.memory import make_memory_loader
from fastdata.read.base import LoaderSpec
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.read.stores.decoded_cache import decode_split
from tests.conftest import rehash_indexes, unique_label_source
from tests.format.test_manifest_load import _edit_manifest


def _spec(root: Path, **kw) -> LoaderSpec:
    base = dict(manifest=load_manifest(root), split="train", train=False, batch_size=64, seed=5)
    return LoaderSpec(**{**base, **kw})


@pytest.fixture(autouse=True)
def _fresh_device_store():
    memory.clear_device_cache()
    yield
    memory.clear_device_cache()


# ----------------------------------------------------------------------------- one rule for paths


def test_a_fifo_index_is_refused_at_load_and_never_blocks_a_reader(tiny_shards):
    index = tiny_shards / "train-000000.idx"
    index.unlink()
    os.mkfifo(index)
    with pytest.raises(ManifestError, match=r"train-000000\.idx is not a regular file"):
        load_manifest(tiny_shards)
    # A FIFO swapped in after the manifest was loaded: the reader refuses it without blocking.
    index.unlink()
    manifest = load_manifest(tiny_shards)
    os.mkfifo(index)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            ShardReader(manifest, "train").key(0, 0)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout=20)
    if thread.is_alive():  # the old reader blocks in open(): unblock it before failing
        os.close(os.open(index, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the reader blocked opening a FIFO index")
    assert len(errors) == 1 and isinstance(errors[0], ShardReadError)
    assert "train-000000.tar" in str(errors[0]) and "not a regular file" in str(errors[0])


# ----------------------------------------------------------------------------- counts and labels


def _two_classes(data: dict) -> None:
    data["classes"] = data["classes"][:2]
    for split in data["splits"].values():
        split["class_counts"] = [sum(split["class_counts"]), 0]  # counts still add up


def test_labels_outside_the_class_list_are_refused_on_every_backend(tiny_shards):
    _edit_manifest(tiny_shards, _two_classes)  # the shards hold labels up to 299
    with pytest.raises(ShardReadError, match=r"label \d+ is outside the manifest's 2 classes"):
        list(make_cpu_loader(_spec(tiny_shards)))
    with pytest.raises(ShardReadError, match=r"train-\d{6}\.tar, sample 'train_\d{8}'.*2 classes"):
        decode_split(load_manifest(tiny_shards), "train", cache_dir=tiny_shards / "cache")


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _component(root: Path, line: int, ext: str) -> tuple[int, int, str]:
    """(offset, size, member) of component `ext` of sample `line` - 1 in train-000000."""
    fields = (root / "train-000000.idx").read_text().splitlines()[line].split()
    at = fields.index(ext)
    return int(fields[at + 1]), int(fields[at + 2]), fields[at + 3]


def test_a_flipped_label_byte_out_of_range_is_refused(tiny_shards):
    offset, _, member = _component(tiny_shards, 1, "lid")
    _flip(tiny_shards / "train-000000.tar", offset + 7, 0x40)  # the label's top byte
    with pytest.raises(
        ShardReadError, match=rf"{member.split('.')[0]}.*'lid' label \d+ is outside"
    ):
        list(make_cpu_loader(_spec(tiny_shards)))


# ----------------------------------------------------------------------------- index and headers


def _shift_index(root: Path) -> None:
    """Every offset of train-000000's index moved one sample on (each sample: 3 components)."""
    index = root / "train-000000.idx"
    lines = index.read_text().splitlines()
    step = int(lines[2].split()[1]) - int(lines[1].split()[1])
    out = [lines[0]]
    for line in lines[1:]:
        fields = line.split()
        for i in range(0, len(fields), 4):
            fields[i + 1] = str(int(fields[i + 1]) + step)
        out.append(" ".join(fields))
    index.write_text("\n".join(out) + "\n")


def test_a_changed_index_is_refused_by_its_checksum(tiny_shards):
    _shift_index(tiny_shards)
    with pytest.raises(ShardReadError, match=r"train-000000\.tar: index file .* differs"):
        list(make_cpu_loader(_spec(tiny_shards)))
    with pytest.raises(ShardReadError, match=r"train-000000\.tar: index file .* differs"):
        decode_split(load_manifest(tiny_shards), "train", cache_dir=tiny_shards / "cache")


def test_a_shifted_index_the_manifest_vouches_for_is_caught_by_the_tar_headers(tiny_shards):
    _shift_index(tiny_shards)
    rehash_indexes(tiny_shards)  # an index written wrong, with a matching checksum
    with pytest.raises(ShardReadError, match=r"tar header names 'train_\d{8}\.cls' where the"):
        list(make_cpu_loader(_spec(tiny_shards)))
    with pytest.raises(ShardReadError, match=r"sample 'train_\d{8}': tar header names"):
        decode_split(load_manifest(tiny_shards), "train", cache_dir=tiny_shards / "cache")


def test_an_index_line_mixing_two_samples_is_caught_by_the_tar_headers(tiny_shards):
    index = tiny_shards / "train-000000.idx"
    lines = index.read_text().splitlines()
    first, second = lines[1].split(), lines[2].split()
    first[4:8], second[4:8] = second[4:8], first[4:8]  # swap the samples' lid entries
    lines[1], lines[2] = " ".join(first), " ".join(second)
    index.write_text("\n".join(lines) + "\n")
    rehash_indexes(tiny_shards)
    with pytest.raises(ShardReadError, match=r"names 'train_\d{8}\.lid' where the index places"):
        list(make_cpu_loader(_spec(tiny_shards)))
    with pytest.raises(ShardReadError, match=r"sample 'train_\d{8}': tar header names"):
        decode_split(load_manifest(tiny_shards), "train", cache_dir=tiny_shards / "cache")


def test_a_garbage_index_names_the_shard_on_the_memory_backend(tiny_shards):
    index = tiny_shards / "train-000000.idx"
    lines = index.read_text().splitlines()
    lines[5] = lines[5].replace(lines[5].split()[1], "0x1f", 1)
    index.write_text("\n".join(lines) + "\n")
    rehash_indexes(tiny_shards)
    with pytest.raises(ShardReadError, match=r"train-000000\.tar: index line 6 has a non-number"):
        make_memory_loader(_spec(tiny_shards, train=True))


# ----------------------------------------------------------------------------- old manifests


def _as_version_1(data: dict) -> None:
    data["format_version"] = 1
    for split in data["splits"].values():
        for shard in split["shards"]:
            for key in ("index_sha256", "sums", "sums_sha256"):
                shard.pop(key)


def test_an_old_manifest_loads_with_one_warning(tiny_shards, caplog, monkeypatch):
    monkeypatch.setattr(manifest_io, "_WARNED_NO_INDEX_SUMS", set())
    _edit_manifest(tiny_shards, _as_version_1)
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        first = load_manifest(tiny_shards)
        load_manifest(tiny_shards)
    warnings = [r for r in caplog.records if "carries no index checksums" in r.getMessage()]
    assert len(warnings) == 1 and str(tiny_shards) in warnings[0].getMessage()
    assert first.format_version == 1
    labels = sorted(int(v) for _, y in make_cpu_loader(_spec(tiny_shards)) for v in y)
    assert labels == list(range(300))


# ----------------------------------------------------------------------------- verify_samples


def test_the_writer_records_index_and_sample_checksums(tiny_shards):
    manifest = load_manifest(tiny_shards)
    for shard in manifest.split("train").shards:
        assert shard.index_sha256 and shard.sums and shard.sums_sha256
        lines = (tiny_shards / shard.sums).read_text().splitlines()
        assert lines[0] == f"fastdata-sums v1 blake2b-128 {shard.num_samples}"


def test_verify_samples_catches_a_flipped_pixel_that_every_read_check_lets_through(tiny_shards):
    offset, size, member = _component(tiny_shards, 4, "rgb")
    _flip(tiny_shards / "train-000000.tar", offset + size // 2)
    assert len(list(make_cpu_loader(_spec(tiny_shards)))) == 5  # unchecked: read as is
    with pytest.raises(ShardReadError, match=rf"{member.split('.')[0]}.*differ from the digest"):
        list(make_cpu_loader(_spec(tiny_shards, verify_samples=True)))
    with pytest.raises(ShardReadError, match="differ from the digest"):
        decode_split(
            load_manifest(tiny_shards), "train", cache_dir=tiny_shards / "c", verify_samples=True
        )


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_the_datamodule_passes_verify_samples_down(tiny_shards, backend):
    from fastdata import ShardDataModule

    offset, size, _ = _component(tiny_shards, 4, "rgb")
    _flip(tiny_shards / "train-000000.tar", offset + size // 2)
    dm = ShardDataModule(
        tiny_shards,
        batch_size=32,
        backend=backend,
        verify_samples=True,
        workers=WorkerSettings(num_workers=0),
    )
    dm.setup("fit")
    with pytest.raises(ShardReadError, match="differ from the digest"):
        list(dm.train_dataloader())


def test_verify_samples_catches_an_in_range_label_flip(tiny_shards):
    offset, _, _ = _component(tiny_shards, 2, "lid")
    _flip(tiny_shards / "train-000000.tar", offset)  # label k -> k ^ 1: still a class
    with pytest.raises(ShardReadError, match="differ from the digest"):
        list(make_cpu_loader(_spec(tiny_shards, verify_samples=True)))


def test_shards_without_digests_still_load_with_verify_samples(tiny_shards, caplog, monkeypatch):
    from fastdata.format import integrity

    monkeypatch.setattr(integrity, "_WARNED_NO_SUMS", set())

    def drop_sums(data: dict) -> None:
        for shard in data["splits"]["train"]["shards"]:
            shard["sums"] = shard["sums_sha256"] = None

    _edit_manifest(tiny_shards, drop_sums)
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        batches = list(make_cpu_loader(_spec(tiny_shards, verify_samples=True)))
    assert sum(len(y) for _, y in batches) == 300
    assert any("no per-sample digests" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- memory skip


def test_memory_backend_skip_warns_and_counts(tiny_shards, caplog):
    offset, _, member = _component(tiny_shards, 3, "lid")
    _flip(tiny_shards / "train-000000.tar", offset + 7, 0x40)  # label out of range
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        loader = make_memory_loader(_spec(tiny_shards, train=True, on_error="skip"))
    key = member.split(".")[0]
    assert loader.skipped == 1
    assert any(
        "skipped 1 bad sample" in r.getMessage() and key in r.getMessage() for r in caplog.records
    )
    labels = sorted(int(v) for _, y in loader for v in y)
    assert len(labels) == 299 and int(key.split("_")[1]) not in labels


def test_a_clean_dataset_reads_the_same_with_every_check(tmp_path):
    from fastdata.write import ShardOptions, write_shards

    out = tmp_path / "d"
    write_shards(unique_label_source(), out, ShardOptions(max_count=64, workers=1, progress=False))
    plain = [y.tolist() for _, y in make_cpu_loader(_spec(out))]
    checked = [y.tolist() for _, y in make_cpu_loader(_spec(out, verify_samples=True))]
    assert plain == checked and sorted(v for b in plain for v in b) == list(range(300))
    images, labels, _, ok = decode_split(
        load_manifest(out), "train", cache_dir=tmp_path / "c", verify_samples=True
    )
    assert bool(ok.all()) and sorted(labels.tolist()) == list(range(300))
    row = labels.tolist().index(7)  # labels are sample ids: row of sample 7
    source = unique_label_source().item("train", 7).pixels
    assert np.array_equal(images[row].permute(1, 2, 0).numpy(), source)


@pytest.mark.dali
def test_the_dali_backend_refuses_a_changed_index_and_verify_samples(tiny_shards):
    from fastdata.read.backends.dali import make_dali_loader

    with pytest.raises(ValueError, match="dali backend cannot check per-sample digests"):
        make_dali_loader(_spec(tiny_shards, verify_samples=True))
    _shift_index(tiny_shards)
    with pytest.raises(ShardReadError, match=r"train-000000\.tar: index file .* differs"):
        make_dali_loader(_spec(tiny_shards))
