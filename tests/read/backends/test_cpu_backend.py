"""The CPU backend: exact lengths, reproducible epochs, workers, resume, corrupt shards."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fastdata.augment import Flip, Preset, RandomResizedCrop, ResizeCenterCrop
from fastdata.format.manifest_io import load_manifest
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.base import LoaderSpec, WorkerSettings
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.folder import FolderSource
from tests.conftest import rehash_indexes, unique_label_source, write_jpeg_folder


def _spec(root: Path, **kw) -> LoaderSpec:
    worker_keys = {"num_workers", "prefetch_factor", "decode_threads", "pin_memory"}
    workers = WorkerSettings(**{k: kw.pop(k) for k in list(kw) if k in worker_keys})
    base = dict(manifest=load_manifest(root), split="train", train=True, batch_size=32, seed=5)
    base.update(kw)
    return LoaderSpec(workers=workers, **base)


def _labels(loader) -> list[int]:
    return [int(v) for _, y in loader for v in y]


def test_epoch_yields_every_sample_once_in_exact_batches(tiny_shards):
    loader = make_cpu_loader(_spec(tiny_shards, drop_last=False))
    batches = list(loader)
    assert len(batches) == len(loader) == 10  # ceil(300 / 32)
    x, y = batches[0]
    assert (
        x.dtype.is_floating_point is False
        and x.shape == (32, 3, 8, 8)
        and y.dtype.is_floating_point is False
    )
    assert sorted(_labels(loader)) == list(range(300))


def test_workers_do_not_change_the_batches(tiny_shards):
    reference = [y.tolist() for _, y in make_cpu_loader(_spec(tiny_shards))]
    with_workers = [y.tolist() for _, y in make_cpu_loader(_spec(tiny_shards, num_workers=2))]
    assert with_workers == reference and len(reference) == 10  # ceil(300 / 32)


def test_new_shuffle_each_epoch_and_resume_mid_epoch(tiny_shards):
    loader = make_cpu_loader(_spec(tiny_shards, num_workers=2))
    epoch0 = [y.tolist() for _, y in loader]
    loader.set_epoch(1)
    epoch1 = [y.tolist() for _, y in loader]
    assert epoch0 != epoch1
    loader.set_epoch(1, consumed=4 * 32, steps_before=4)  # 4 steps of 32 on one rank
    assert [y.tolist() for _, y in loader] == epoch1[4:] and len(loader) == len(epoch1) == 10


def test_eval_split_is_in_file_order_and_complete(tiny_shards):
    loader = make_cpu_loader(_spec(tiny_shards, split="test", train=False, batch_size=16))
    labels = _labels(loader)
    assert sorted(labels) == list(range(50)) and len(loader) == 4


def _corrupt(root: Path, shard_name: str, truncate_to: int | None = None) -> None:
    path = root / shard_name
    data = path.read_bytes()
    path.write_bytes(data[:truncate_to])


def test_truncated_shard_names_shard_and_key(tiny_shards):
    manifest = load_manifest(tiny_shards)
    shard = manifest.split("train").shards[1]
    _corrupt(tiny_shards, shard.name, truncate_to=shard.bytes // 2)
    with pytest.raises(ShardReadError, match=rf"{shard.name}, sample 'train_\d{{8}}'.*truncated"):
        list(make_cpu_loader(_spec(tiny_shards)))
    loader = make_cpu_loader(_spec(tiny_shards, on_error="skip", drop_last=False))
    labels = _labels(loader)
    assert loader.skipped > 0 and len(labels) == 300 - loader.skipped


def test_missing_component_names_shard_and_key(tiny_shards):
    manifest = load_manifest(tiny_shards)
    shard = manifest.split("train").shards[0]
    index = Path(manifest.index_url(shard))
    lines = index.read_text().splitlines()
    lines[3] = " ".join(lines[3].split()[:8])  # drop the third component (rgb) of sample 3
    index.write_text("\n".join(lines) + "\n")
    manifest = rehash_indexes(tiny_shards)  # a wrong index the manifest vouches for
    reader = ShardReader(manifest, "train")
    with pytest.raises(
        ShardReadError, match=r"sample 'train_\d{8}': sample has no 'rgb' component"
    ):
        reader.sample(0, 2, ("rgb",))


def test_corrupt_jpeg_at_read_time_is_named(tmp_path):
    root = write_jpeg_folder(tmp_path / "imgs", classes=2, per_class=3)
    manifest = write_shards(
        FolderSource(root), tmp_path / "out", ShardOptions(workers=1, progress=False)
    )
    shard = manifest.split(next(iter(manifest.splits))).shards[0]
    path = Path(manifest.shard_url(shard))
    data = bytearray(path.read_bytes())
    first_jpg = data.find(b"\xff\xd8\xff")
    data[first_jpg : first_jpg + 64] = b"\x00" * 64  # wreck the first JPEG's header
    path.write_bytes(bytes(data))
    spec = _spec(tmp_path / "out", split=next(iter(manifest.splits)), image_size=16, batch_size=2)
    with pytest.raises(ShardReadError, match=r"sample '.*': cannot decode image"):
        list(make_cpu_loader(spec))
    skipping = make_cpu_loader(replace(spec, on_error="skip", drop_last=False))
    assert sum(len(y) for _, y in skipping) == 5 and skipping.skipped == 1


def test_photo_geometry_gives_fixed_size_batches(tmp_path):
    root = write_jpeg_folder(tmp_path / "imgs", classes=2, per_class=4, size=(64, 40))
    write_shards(FolderSource(root), tmp_path / "out", ShardOptions(workers=1, progress=False))
    split = next(iter(load_manifest(tmp_path / "out").splits))
    for train in (True, False):
        batches = list(
            make_cpu_loader(
                _spec(
                    tmp_path / "out",
                    split=split,
                    train=train,
                    preset="photo",
                    image_size=24,
                    batch_size=4,
                )
            )
        )
        assert all(x.shape == (4, 3, 24, 24) for x, _ in batches)
        # A preset that does not crop ("none") gets photos decoded straight at image_size (no
        # room for a device crop: floor(24 * 256 / 224) = 27 only when the ops crop).
        plain = _spec(tmp_path / "out", split=split, train=train, image_size=24, batch_size=4)
        assert all(x.shape == (4, 3, 24, 24) for x, _ in make_cpu_loader(plain))


def _identity_photo_preset() -> Preset:
    """A photo-like preset whose crops keep an 8x8 image whole, so only the flip changes pixels."""
    train = (RandomResizedCrop(scale=(1.0, 1.0), ratio=(1.0, 1.0)), Flip(0.5))
    return Preset("photo8", 8, (0.0,) * 3, (255.0,) * 3, train, (ResizeCenterCrop(ratio=1.0),))


def test_photo_preset_flips_at_decode_time_in_training_only(tmp_path):
    from fastdata.read.backends.cpu_batches import decode_geometry

    # Decode-time geometry applies to encoded images (raw splits run every op on the device).
    write_shards(
        unique_label_source(),
        tmp_path / "png",
        ShardOptions(encoding="png", max_count=64, workers=1, progress=False),
    )
    photo = _spec(tmp_path / "png", preset="photo", image_size=8, drop_last=False)
    assert decode_geometry(photo)[0].flip_p == 0.5 and decode_geometry(photo)[1] == 2
    assert decode_geometry(replace(photo, train=False))[0].flip_p == 0.0
    assert decode_geometry(replace(photo, preset="cifar"))[0].flip_p == 0.0
    spec = replace(photo, preset=_identity_photo_preset())
    loader = make_cpu_loader(spec)
    assert loader.applied_ops == 2 and not loader.normalized
    source = unique_label_source()
    flipped = 0
    for x, y in loader:
        for image, label in zip(x.permute(0, 2, 3, 1).numpy(), y.tolist(), strict=True):
            pixels = source.item("train", label).pixels
            mirrored = np.array_equal(image, pixels[:, ::-1])
            assert mirrored or np.array_equal(image, pixels)
            flipped += mirrored
    assert 100 < flipped < 200, f"{flipped} of 300 flipped; expected about half"
    evaluation = make_cpu_loader(replace(spec, split="test", train=False))
    assert evaluation.applied_ops == 1
    for x, y in evaluation:
        for image, label in zip(x.permute(0, 2, 3, 1).numpy(), y.tolist(), strict=True):
            assert np.array_equal(image, source.item("test", label).pixels)


def test_decode_time_flip_mirrors_the_same_crop():
    from fastdata.read.decoders.image import Geometry, decode_image
    from tests.conftest import jpeg_bytes

    pixels = np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    data = jpeg_bytes(pixels)
    for kind in ("rrc", "none"):
        plain = decode_image(data, Geometry(kind, 24), np.random.default_rng(7))
        mirrored = decode_image(data, Geometry(kind, 24, flip_p=1.0), np.random.default_rng(7))
        assert np.array_equal(mirrored, plain[:, ::-1])
    with pytest.raises(ValueError, match="flip_p"):
        Geometry("rrc", 24, flip_p=1.5)


def test_mixed_sizes_without_image_size_is_a_clear_error(tmp_path):
    root = write_jpeg_folder(tmp_path / "imgs", classes=1, per_class=2)
    (root / "class0" / "big.jpg").write_bytes(
        __import__("tests.conftest", fromlist=["jpeg_bytes"]).jpeg_bytes(
            np.zeros((10, 20, 3), np.uint8)
        )
    )
    write_shards(FolderSource(root), tmp_path / "out", ShardOptions(workers=1, progress=False))
    split = next(iter(load_manifest(tmp_path / "out").splits))
    with pytest.raises(ValueError, match="vary in size.*pass image_size"):
        make_cpu_loader(_spec(tmp_path / "out", split=split))


def test_skipping_a_sample_without_label_keeps_images_and_labels_aligned(tiny_shards):
    manifest = load_manifest(tiny_shards)
    shard = manifest.split("train").shards[0]
    index = Path(manifest.index_url(shard))
    lines = index.read_text().splitlines()
    fields = lines[1].split()  # sample 0: cls, lid, rgb components
    # Drop both label components (a missing lid alone falls back to cls, `schema.label_and_id`).
    lines[1] = " ".join(fields[8:])
    index.write_text("\n".join(lines) + "\n")
    rehash_indexes(tiny_shards)
    loader = make_cpu_loader(_spec(tiny_shards, on_error="skip", train=False, batch_size=64))
    for x, y in loader:
        assert len(x) == len(y)
        for image, label in zip(x, y, strict=True):  # every image is still its own label's sample
            source = unique_label_source().item("train", int(label)).pixels
            assert np.array_equal(image.permute(1, 2, 0).numpy(), source)
    assert loader.skipped == 1


def test_errors_from_workers_keep_their_type(tiny_shards):
    manifest = load_manifest(tiny_shards)
    shard = manifest.split("train").shards[2]
    _corrupt(tiny_shards, shard.name, truncate_to=shard.bytes // 3)
    with pytest.raises(ShardReadError, match=rf"{shard.name}, sample 'train_\d{{8}}'"):
        list(make_cpu_loader(_spec(tiny_shards, num_workers=2)))


def test_fixed_size_png_split_keeps_its_size(tmp_path):
    from fastdata.lightning.datamodule import ShardDataModule

    write_shards(
        unique_label_source(n_train=40, n_test=8),
        tmp_path / "png",
        ShardOptions(encoding="png", workers=1, progress=False),
    )
    dm = ShardDataModule(
        tmp_path / "png",
        batch_size=8,
        backend="cpu",
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 8, 8) and dm.transforms.name == "cifar"
    for image, label in zip(x, y, strict=True):
        assert np.array_equal(
            image.permute(1, 2, 0).numpy(), unique_label_source().item("train", int(label)).pixels
        )


class _FakeWorker:
    """`get_worker_info()` of worker 0 of 1: the dataset then behaves as in a persistent worker."""

    id, num_workers = 0, 1


def test_next_epochs_first_batch_is_decoded_ahead_and_equals_a_fresh_decode(
    tiny_shards, monkeypatch
):
    import threading

    from fastdata.read.backends import cpu_batches as cpu

    fresh = make_cpu_loader(_spec(tiny_shards, batch_size=64))  # no workers: nothing ahead
    want = {}
    for epoch in (0, 1, 5):
        fresh.set_epoch(epoch)
        want[epoch] = [(x.clone(), y.clone()) for x, y in fresh]

    monkeypatch.setattr(cpu, "get_worker_info", lambda: _FakeWorker())
    loader = make_cpu_loader(_spec(tiny_shards, batch_size=64))
    dataset = loader.dataset
    made: list[tuple[int, int, str]] = []  # (epoch, batch number, thread) of every batch decoded
    load = dataset._load_batch

    def recording(reader, plan, number, skips):
        made.append((plan.epoch, number, threading.current_thread().name))
        return load(reader, plan, number, skips)

    monkeypatch.setattr(dataset, "_load_batch", recording)
    got = {}
    for epoch in (0, 1, 5):  # 0 -> 1 as foreseen; 1 -> 5: the batch made ahead is dropped
        loader.set_epoch(epoch)
        got[epoch] = list(dataset)
    for epoch in want:
        assert len(got[epoch]) == len(want[epoch]) == 5  # ceil(300 / 64)
        for (x, y), (wx, wy) in zip(got[epoch], want[epoch], strict=True):
            assert np.array_equal(x, wx) and np.array_equal(y, wy)
    dataset._ahead.take((6, 0, 0))  # waits for the last look-ahead thread (started after epoch 5)
    ahead = [(e, n) for e, n, thread in made if thread == "fastdata-next-epoch"]
    assert ahead == [(1, 0), (2, 0), (6, 0)]  # after each epoch's last batch
    assert (1, 0) not in [(e, n) for e, n, thread in made if thread != "fastdata-next-epoch"]
    assert (5, 0) in [(e, n) for e, n, _ in made]  # epoch 5 decoded its own first batch


def test_skips_in_a_batch_made_ahead_count_once_when_it_is_used(tiny_shards, monkeypatch):
    from fastdata.read.backends import cpu_batches as cpu

    manifest = load_manifest(tiny_shards)
    shard = manifest.split("train").shards[0]
    index = Path(manifest.index_url(shard))
    lines = index.read_text().splitlines()
    lines[1] = " ".join(lines[1].split()[8:])  # sample 0 loses its label components
    index.write_text("\n".join(lines) + "\n")
    rehash_indexes(tiny_shards)
    monkeypatch.setattr(cpu, "get_worker_info", lambda: _FakeWorker())
    loader = make_cpu_loader(_spec(tiny_shards, on_error="skip", batch_size=300, drop_last=False))
    for epoch in range(3):  # one batch an epoch: every epoch after the first is made ahead
        loader.set_epoch(epoch)
        assert sum(len(y) for _, y in loader.dataset) == 299
        assert loader.skipped == epoch + 1
    loader.set_epoch(7)  # epoch 3's batch, made ahead, is dropped: its skip is not counted
    list(loader.dataset)
    assert loader.skipped == 4
