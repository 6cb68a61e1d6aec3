"""The device-resident backend on tiny real shards: decode + cache, epoch order, ranks, resume."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import WorkerSettings
from fastdata.augment import get_preset
from fastdata.format.manifest import Manifest
from fastdata.read.backends import memory
from fastdata.read.backends.memory import make_memory_loader
from fastdata.read.base import BatchLoader, LoaderSpec
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.read.stores import decoded_cache
from fastdata.read.stores.decoded_cache import decode_split
from fastdata.read.stores.padded import PaddedImages
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.arrays import ArraySource
from fastdata.write.sources.folder import FolderSource
from tests.conftest import rehash_indexes

N_TRAIN, N_TEST = 51, 13  # odd: two ranks need the plan's padding (repeats of the first samples)
OPTIONS = ShardOptions(max_count=8, workers=1, progress=False)


def _arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    pixels = np.random.default_rng(seed).integers(0, 256, (n, 6, 5, 3), dtype=np.uint8)
    return pixels, np.arange(n)  # one class per sample: labels identify samples


@pytest.fixture(autouse=True)
def _fresh_device_store():
    memory.clear_device_cache()
    yield
    memory.clear_device_cache()


@pytest.fixture
def raw_shards(tmp_path: Path) -> tuple[Manifest, dict[str, tuple[np.ndarray, np.ndarray]]]:
    splits = {"train": _arrays(N_TRAIN, 0), "test": _arrays(N_TEST, 1)}
    source = ArraySource(splits, classes=[f"c{i}" for i in range(N_TRAIN)])
    return write_shards(source, tmp_path / "shards", OPTIONS), splits


def _spec(manifest: Manifest, **kw) -> LoaderSpec:
    args = dict(manifest=manifest, split="train", train=True, batch_size=8, seed=3)
    return LoaderSpec(**{**args, **kw})


def _labels(loader: BatchLoader) -> list[list[int]]:
    return [labels.tolist() for _, labels in loader]


def test_decode_split_returns_the_source_pixels_and_labels(raw_shards):
    manifest, splits = raw_shards
    pixels, labels = splits["train"]
    images, got_labels, sample_ids, ok = decode_split(manifest, "train")
    assert images.dtype == torch.uint8 and images.shape == (N_TRAIN, 3, 6, 5)
    assert ok.dtype == torch.bool and bool(ok.all())
    assert sorted(sample_ids.tolist()) == list(range(N_TRAIN))
    np.testing.assert_array_equal(images.permute(0, 2, 3, 1).numpy(), pixels[sample_ids.numpy()])
    np.testing.assert_array_equal(got_labels.numpy(), labels[sample_ids.numpy()])


def test_second_decode_hits_the_cache(raw_shards, monkeypatch, tmp_path):
    manifest, _ = raw_shards
    calls = []
    real = decoded_cache._decode_rows
    monkeypatch.setattr(decoded_cache, "_decode_rows", lambda *a: calls.append(a[3][0]) or real(*a))
    first = decode_split(manifest, "train", cache_dir=tmp_path / "cache")
    assert sorted(calls) == list(range(len(manifest.split("train").shards)))
    calls.clear()
    second = decode_split(manifest, "train", cache_dir=tmp_path / "cache")
    assert calls == []
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert not list((tmp_path / "cache").glob("*.tmp-*")), "temporary files left behind"
    decode_split(manifest, "test", cache_dir=tmp_path / "cache")  # another split: another entry
    assert calls, "the test split must not hit the train split's entry"


def test_cache_dir_comes_from_the_environment(raw_shards, monkeypatch, tmp_path):
    manifest, _ = raw_shards
    monkeypatch.setenv(decoded_cache.CACHE_DIR_ENV, str(tmp_path / "env-cache"))
    decode_split(manifest, "test")
    assert len(list((tmp_path / "env-cache").glob("test-*.json"))) == 1


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_cover_the_split_with_equal_lengths(raw_shards, world_size, drop_last):
    manifest, _ = raw_shards
    spec = _spec(manifest, world_size=world_size, drop_last=drop_last)
    loaders = [make_memory_loader(replace(spec, rank=r)) for r in range(world_size)]
    per_rank = [_labels(loader) for loader in loaders]
    assert len({len(loader) for loader in loaders}) == 1
    assert [len(batches) for batches in per_rank] == [len(loader) for loader in loaders]
    seen = [label for batches in per_rank for batch in batches for label in batch]
    span = -(-N_TRAIN // world_size)
    if drop_last:  # whole steps of world_size * 8 samples only, each sample at most once
        assert len(seen) == len(set(seen)) == N_TRAIN // (world_size * 8) * world_size * 8
    else:  # every sample at least once; only the padding (< world_size samples) repeats
        assert set(seen) == set(range(N_TRAIN))
        assert len(seen) == world_size * span
        assert len(seen) - len(set(seen)) == world_size * span - N_TRAIN < world_size
        assert all(len(batch) == 8 for batches in per_rank for batch in batches[:-1])


def test_same_order_for_same_seed_and_epoch_new_order_next_epoch(raw_shards):
    manifest, _ = raw_shards
    epoch0 = _labels(make_memory_loader(_spec(manifest, epoch=0)))
    assert _labels(make_memory_loader(_spec(manifest, epoch=0))) == epoch0
    epoch1 = _labels(make_memory_loader(_spec(manifest, epoch=1)))
    assert epoch1 != epoch0
    assert sorted(sum(epoch1, [])) == sorted(sum(epoch0, []))
    loader = make_memory_loader(_spec(manifest, epoch=0))
    loader.set_epoch(1)
    assert _labels(loader) == epoch1
    assert _labels(make_memory_loader(_spec(manifest, seed=4))) != epoch0


def test_resume_skips_exactly_the_consumed_batches(raw_shards, monkeypatch):
    manifest, _ = raw_shards
    full = _labels(make_memory_loader(_spec(manifest, epoch=2, drop_last=True)))
    monkeypatch.setattr(decoded_cache, "_decode_rows", _must_not_decode)  # resume never decodes
    resumed = make_memory_loader(
        _spec(manifest, epoch=2, drop_last=True, consumed=2 * 8, steps_before=2)
    )
    assert len(resumed) == len(full), "len is the whole epoch, as for the CPU backend"
    assert _labels(resumed) == full[2:]
    resumed.set_epoch(2)
    assert _labels(resumed) == full, "set_epoch without a position replays the whole epoch"
    with pytest.raises(ValueError, match="consumed"):
        make_memory_loader(_spec(manifest, consumed=N_TRAIN + 1, drop_last=True))


def _must_not_decode(*args):
    raise AssertionError("decoded again although the split is cached")


def test_eval_split_in_file_order_without_drop(raw_shards):
    manifest, _ = raw_shards
    spec = _spec(manifest, split="test", train=False, drop_last=True, batch_size=4)
    batches = _labels(make_memory_loader(spec))
    _, _, sample_ids, _ = decode_split(manifest, "test")
    assert sum(batches, []) == sample_ids.tolist()  # labels == sample ids here
    assert len(batches) == 4 and len(batches[-1]) == 1


def test_batches_are_uint8_nchw_on_the_spec_device(raw_shards):
    manifest, _ = raw_shards
    loader = make_memory_loader(_spec(manifest))
    assert isinstance(loader, BatchLoader) and loader.normalized is False
    images, labels = next(iter(loader))
    assert images.dtype == torch.uint8 and images.shape == (8, 3, 6, 5)
    assert labels.dtype == torch.int64 and images.device == torch.device("cpu")


def _cifar_and_plain(manifest: Manifest, **kw) -> tuple[BatchLoader, BatchLoader]:
    fused = make_memory_loader(_spec(manifest, preset="cifar", **kw))
    return fused, make_memory_loader(_spec(manifest, preset="none", **kw))


def test_cifar_training_fuses_the_crop_into_the_gather(raw_shards):
    manifest, _ = raw_shards
    fused, plain = _cifar_and_plain(manifest, drop_last=False)
    assert isinstance(fused.images, PaddedImages) and fused.images.pad == 4
    assert (fused.normalized, fused.applied_ops, plain.normalized, plain.applied_ops) == (
        False, 1, False, 0,
    )  # fmt: skip
    cifar = get_preset("cifar")
    batches = list(fused)
    assert len(batches) == len(plain)
    for b, ((x, y), (raw, raw_y)) in enumerate(zip(batches, plain, strict=True)):
        assert x.dtype == torch.uint8 and x.shape == raw.shape and torch.equal(y, raw_y)
        # Exactly what on_after_batch_transfer would make of the plain batch with that generator.
        generator = fused.batch_generator(fused.plan.seeds[b])
        expected = cifar.apply(raw, train=True, generator=generator)
        assert torch.equal(cifar.apply(x, train=True, skip=1), expected)


def test_fused_augmentation_is_replayed_on_resume_and_new_each_epoch(raw_shards):
    manifest, _ = raw_shards
    full = list(make_memory_loader(_spec(manifest, preset="cifar", epoch=1, drop_last=True)))
    resumed = make_memory_loader(
        _spec(manifest, preset="cifar", epoch=1, drop_last=True, consumed=2 * 8, steps_before=2)
    )
    for (x, y), (rx, ry) in zip(full[2:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)

    def first_draws(loader):
        return torch.rand(4, generator=loader.batch_generator(loader.plan.seeds[0]))

    epoch1_draws = first_draws(resumed)
    resumed.set_epoch(2)
    assert not torch.equal(first_draws(resumed), epoch1_draws)
    ranks = [
        make_memory_loader(_spec(manifest, preset="cifar", rank=r, world_size=2)) for r in (0, 1)
    ]
    draws = [first_draws(loader) for loader in ranks]
    assert not torch.equal(*draws), "ranks must not share their augmentation draws"


def test_eval_and_other_presets_keep_the_uint8_store(raw_shards):
    manifest, _ = raw_shards
    evaluation = make_memory_loader(_spec(manifest, split="test", train=False, preset="cifar"))
    assert not evaluation.normalized and evaluation.fused is None
    assert next(iter(evaluation))[0].dtype == torch.uint8
    info, none, cifar = manifest.split("train"), get_preset("none"), get_preset("cifar")
    assert memory.resident_nbytes(info, None, none) == N_TRAIN * 3 * 6 * 5
    padded = 2 * N_TRAIN * 3 * (6 + 8) * (5 + 8)  # pad 4 on every side, a mirrored copy
    assert memory.resident_nbytes(info, None, cifar) == padded
    assert memory.resident_nbytes(info, None, cifar, train=False) < padded


@pytest.mark.parametrize("world_size", [1, 2])
def test_same_samples_in_the_same_order_as_the_cpu_backend(raw_shards, world_size):
    from fastdata.read.backends.cpu import make_cpu_loader

    manifest, _ = raw_shards
    for rank in range(world_size):
        spec = _spec(manifest, drop_last=False, rank=rank, world_size=world_size)
        ours, theirs = _labels(make_memory_loader(spec)), _labels(make_cpu_loader(spec))
        assert ours == theirs  # one epoch plan: same batches, same order
        assert Counter(sum(ours, [])) == Counter(sum(theirs, []))


def test_photos_are_stored_at_the_documented_size(tmp_path):
    colours = {"red": (200, 10, 10), "blue": (10, 10, 200)}
    for name, colour in colours.items():
        (tmp_path / "photos" / name).mkdir(parents=True)
        for j, size in enumerate([(90, 60), (50, 120), (64, 64)]):
            Image.new("RGB", size, colour).save(tmp_path / "photos" / name / f"{j}.jpg", quality=95)
    source = FolderSource(tmp_path / "photos")
    manifest = write_shards(source, tmp_path / "shards", OPTIONS)
    with pytest.raises(ValueError, match="image_size"):
        decode_split(manifest, "train")
    images, labels, _, _ = decode_split(manifest, "train", image_size=28)
    assert images.shape == (6, 3, 32, 32)  # floor(28 * 256 / 224)
    for image, label in zip(images, labels, strict=True):
        expected = torch.tensor(colours[source.classes[label]], dtype=torch.float32)
        assert (image.float().mean(dim=(1, 2)) - expected).abs().max() < 6


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_corrupt_sample_named_or_skipped(tmp_path, on_error):
    pixels, labels = _arrays(20, 2)
    source = ArraySource({"train": (pixels, labels)}, classes=[f"c{i}" for i in range(20)])
    opts = replace(OPTIONS, encoding="png")
    manifest = write_shards(source, tmp_path / "shards", opts)
    reader = ShardReader(manifest, "train")
    key = reader.key(0, 1)
    offset, size = reader._get(0)[0].components[1]["png"]
    reader.close()
    with open(manifest.shard_url(manifest.split("train").shards[0]), "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * size)  # the second sample of shard 0 is now unreadable
    if on_error == "raise":
        with pytest.raises(ShardReadError, match=key):
            decode_split(manifest, "train", on_error=on_error)
    else:
        images, _, ids, ok = decode_split(manifest, "train", on_error=on_error)
        # Every row is kept (rows are plan positions); the corrupt one is marked not ok.
        assert len(images) == 20 and int(ok.sum()) == 19 and not bool(ok[1])
        assert int(key.rsplit("_", 1)[1]) not in ids[ok].tolist()


_DDP_SCRIPT = """
import sys
import lightning as L
import torch
from fastdata.lightning.datamodule import ShardDataModule
from fastdata.read import WorkerSettings
from fastdata.train import end_process_group

root, out = sys.argv[1], sys.argv[2]

class Probe(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def on_train_epoch_start(self):
        self.batches = len(self.trainer.train_dataloader)

    def training_step(self, batch, i):
        self.seen.extend(batch[1].tolist())
        return (self.w * batch[0].float().mean()).sum()

    def on_train_epoch_end(self):
        backend = self.trainer.datamodule.backend_name
        with open(f"{out}/rank{self.global_rank}.txt", "w") as f:
            f.write(f"{backend} {self.batches} " + " ".join(map(str, self.seen)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    dm = ShardDataModule(root, batch_size=4, backend="memory", train_transforms="none",
                         workers=WorkerSettings(num_workers=0, prefetch_factor=2), drop_last=True)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Probe(), datamodule=dm)
    end_process_group()
"""


@pytest.mark.slow  # two Lightning processes on a 2-core machine: about 30 s
@pytest.mark.timeout(240)
def test_two_process_ddp_ranks_see_the_same_number_of_batches(raw_shards, tmp_path):
    pytest.importorskip(
        "fastdata.lightning.datamodule", reason="ShardDataModule has not landed yet"
    )
    manifest, _ = raw_shards
    decode_split(manifest, "train")  # decode once here; both ranks then hit the cache
    script = tmp_path / "ddp_probe.py"
    script.write_text(textwrap.dedent(_DDP_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(Path(memory.__file__).parents[3])}
    cmd = ["timeout", "200", sys.executable, str(script), manifest.root, str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    backend, batches, *seen0 = (tmp_path / "rank0.txt").read_text().split()
    backend1, batches1, *seen1 = (tmp_path / "rank1.txt").read_text().split()
    assert backend == backend1 == "memory"
    per_rank = N_TRAIN // (2 * 4)  # 6 whole steps of 2 x 4 samples (drop_last)
    assert int(batches) == int(batches1) == per_rank
    assert len(seen0) == len(seen1) == per_rank * 4
    assert not set(seen0) & set(seen1), "ranks must take disjoint blocks of each step"


@pytest.mark.gpu
def test_batches_live_on_the_gpu_and_match_the_cpu_store(raw_shards):
    manifest, _ = raw_shards
    on_gpu = list(make_memory_loader(_spec(manifest, device="cuda")))
    on_cpu = list(make_memory_loader(_spec(manifest, device="cpu")))
    assert all(x.is_cuda and y.is_cuda for x, y in on_gpu)
    for (xg, yg), (xc, yc) in zip(on_gpu, on_cpu, strict=True):
        assert torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)


@pytest.mark.gpu
def test_fused_cifar_batches_on_the_gpu(raw_shards):
    manifest, _ = raw_shards
    fused, plain = _cifar_and_plain(manifest, device="cuda")
    assert fused.images.data.is_cuda
    cifar = get_preset("cifar")
    for b, ((x, y), (raw, raw_y)) in enumerate(zip(fused, plain, strict=True)):
        # As on the CPU: the crop is fused into the gather (uint8), the rest is the preset's.
        assert x.is_cuda and x.dtype == torch.uint8 and x.shape == raw.shape
        assert torch.equal(y, raw_y)
        expected = cifar.apply(
            raw, train=True, generator=fused.batch_generator(fused.plan.seeds[b])
        )
        assert torch.equal(cifar.apply(x, train=True, skip=1), expected)


@pytest.mark.realdata
def test_clothing_photos_decode_to_the_photo_device_store(tmp_path):
    from fastdata_pipelines.env import data_dir

    folder = data_dir() / "clothing-small"
    if not folder.is_dir():
        pytest.skip(f"real data not found at {folder} (set FASTDATA_DATA_DIR)")
    manifest = write_shards(
        FolderSource(folder), tmp_path / "shards", replace(OPTIONS, max_count=200)
    )
    images, labels, _, _ = decode_split(manifest, "train", image_size=224)
    assert images.shape == (800, 3, 256, 256)
    assert np.bincount(labels.numpy()).tolist() == manifest.split("train").class_counts
    assert 40 < images.float().mean() < 220, "decoded photos should not be blank"


# ---------------------------------------------------------------- building the store fast

_READ_RAW_SHARD = decoded_cache.read_raw_shard


def test_whole_raw_shards_read_equals_the_per_sample_path(raw_shards, monkeypatch, tmp_path):
    manifest, _ = raw_shards
    monkeypatch.setattr(decoded_cache, "read_raw_shard", lambda *a: False)
    slow = decode_split(manifest, "train", cache_dir=tmp_path / "slow")  # sample by sample
    used = []
    real = _READ_RAW_SHARD
    monkeypatch.setattr(
        decoded_cache, "read_raw_shard", lambda *a: used.append(real(*a)) or used[-1]
    )
    fast = decode_split(manifest, "train", cache_dir=tmp_path / "fast")
    assert len(used) == len(manifest.split("train").shards) and all(used), "whole shards read"
    for a, b in zip(slow, fast, strict=True):
        assert torch.equal(a, b)


def test_irregular_raw_shard_falls_back_and_names_the_sample(raw_shards):
    manifest, _ = raw_shards
    shard = manifest.split("train").shards[1]
    index = Path(manifest.index_url(shard))
    lines = index.read_text().splitlines()
    fields = lines[3].split()
    at = fields.index("rgb")
    fields[at + 2] = str(int(fields[at + 2]) - 1)  # sample 2's pixels are one byte short
    lines[3] = " ".join(fields)
    index.write_text("\n".join(lines) + "\n")
    manifest = rehash_indexes(Path(manifest.root))
    with pytest.raises(ShardReadError, match=fields[at + 3].split(".")[0]):
        decode_split(manifest, "train")


class _Terminal:
    """A stand-in stderr that says it is a terminal (tqdm shows a bar only on one)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("progress", "threshold", "terminal", "shown"),
    [
        (None, 1, True, True),  # a large split on a terminal
        (None, 1, False, False),  # not a terminal (a log file, CI)
        (None, 10**9, True, False),  # a small split
        (False, 1, True, False),
        (True, 10**9, False, True),
    ],
)
def test_decode_progress_bar(
    raw_shards, monkeypatch, tmp_path, progress, threshold, terminal, shown
):
    manifest, _ = raw_shards
    monkeypatch.setattr(decoded_cache, "PROGRESS_MIN_SAMPLES", {"raw": threshold, "encoded": 0})
    stderr = _Terminal() if terminal else __import__("io").StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    decode_split(manifest, "train", cache_dir=tmp_path, progress=progress)
    text = stderr.text if terminal else stderr.getvalue()
    assert ("decoding train" in text and f"{N_TRAIN}/{N_TRAIN}" in text) == shown, text


@pytest.mark.parametrize(
    ("env", "rank", "shown"),
    [
        ({}, 0, True),
        ({"LOCAL_RANK": "1"}, 0, False),
        ({}, 1, False),
        ({"SLURM_LOCALID": "0"}, 1, True),
    ],
)
def test_memory_loader_bar_on_local_rank_zero_only(raw_shards, monkeypatch, env, rank, shown):
    manifest, _ = raw_shards
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(decoded_cache, "PROGRESS_MIN_SAMPLES", {"raw": 1, "encoded": 1})
    monkeypatch.setattr(sys, "stderr", terminal := _Terminal())
    make_memory_loader(_spec(manifest, rank=rank, world_size=2))
    assert ("decoding train" in terminal.text) == shown


# ---------------------------------------------------------------- dict splits: frames


def _clothing_coco(folder: Path, out: Path, count: int) -> Path:
    """A COCO json over `count` clothing photos (sizes 400-888 px, portrait and landscape), each
    with a box on the left edge, one in the bottom-right corner and one in the middle."""
    import json

    files = sorted(p for p in folder.glob("train/*/*.jpg"))[:: max(1, 800 // count)][:count]
    images, anns = [], []
    for i, path in enumerate(files):
        with Image.open(path) as im:
            w, h = im.size
        images.append({"id": i + 1, "file_name": str(path.relative_to(folder)), "width": w, "height": h})  # fmt: skip
        for k, (x, y, bw, bh) in enumerate(
            [
                (0, 0.3 * h, 0.15 * w, 0.2 * h),
                (0.8 * w, 0.85 * h, 0.2 * w, 0.15 * h),
                (0.4 * w, 0.4 * h, 0.2 * w, 0.2 * h),
            ]  # fmt: skip
        ):
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": k + 1, "bbox": [x, y, bw, bh], "iscrowd": 0})  # fmt: skip
    categories = [{"id": c, "name": f"c{c}"} for c in (1, 2, 3)]
    path = out / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": categories}))
    return path


def test_real_photos_keep_every_box_and_the_store_is_their_frames(tmp_path):
    """Photos of other aspects than square: the memory backend's eval batches equal the cpu
    backend's (no centre window cuts a box), and its store is the frames at their own size, as
    `frames_nbytes` (what backend="auto" counts) says."""
    from fastdata_pipelines.env import data_dir

    from fastdata import DetectionDataModule
    from fastdata.read.backends.memory_dict import frames_nbytes
    from fastdata.write.sources.coco import CocoSource

    folder = data_dir() / "clothing-small"
    if not folder.is_dir():
        pytest.skip(f"real data not found at {folder} (set FASTDATA_DATA_DIR)")
    ann = _clothing_coco(folder, tmp_path, 24)
    manifest = write_shards(CocoSource(folder, ann, "val"), tmp_path / "shards", OPTIONS)
    batches = {}
    for backend in ("cpu", "memory"):
        dm = DetectionDataModule(
            manifest.root,
            backend=backend,
            image_size=96,
            batch_size=5,
            workers=WorkerSettings(num_workers=0),
        )
        dm.setup("validate")
        loader = dm.val_dataloader()
        batches[backend] = list(dm.prepared(loader, "cpu"))
    store = loader.loader  # the memory backend's
    held = sum(
        t.numel() * t.element_size()
        for values in store.values
        for t in values.values()
        if isinstance(t, torch.Tensor)
    )
    estimate = frames_nbytes(manifest.split("val"))
    print(f"memory store of 24 photos: {held / 2**20:.2f} MiB, estimated {estimate / 2**20:.2f}")
    assert abs(held - estimate) <= 0.05 * held
    assert held > 24 * 3 * 400 * 400  # at their own size (400-888 px), not 96 or 109 px squares
    boxes = 0
    for a, b in zip(batches["cpu"], batches["memory"], strict=True):
        assert (a["image"] - b["image"]).abs().max() * max(dm.transforms.std) <= 1.001
        for x, y in zip(a["boxes"], b["boxes"], strict=True):
            assert x.shape == y.shape and torch.allclose(x, y, atol=1.0, rtol=0)
            boxes += len(x)
    assert boxes == 3 * 24  # every box kept: the edge boxes scaled, not cut


@pytest.mark.parametrize("preset", ["photo", "cifar", "none"])
def test_the_accelerator_warp_equals_the_cpu_warp(preset):
    """`warp_on_device` (the memory backend's warp on a GPU; run here on CPU tensors) against
    `warp_fields` (the cpu backend's): images within a grey level, masks and boxes exactly."""
    from fastdata.augment.targets import draw_regions
    from fastdata.format.fields import FieldSpec
    from fastdata.read.backends.memory_dict import warp_on_device
    from fastdata.read.decoders.dict_batch import SampleSpec, warp_fields

    rng = np.random.default_rng(0)
    fields = {
        "image": FieldSpec("image", "image", ("png",)),
        "mask": FieldSpec("mask", "mask", ("mask.png",)),
        "boxes": FieldSpec("boxes", "boxes", ("boxes.npy", "box_labels.npy")),
    }
    spec = SampleSpec(fields, get_preset(preset, 24), True, (24, 24))
    sizes = [(37, 53), (60, 20), (24, 24), (31, 90)]
    regions = draw_regions(spec.preset, True, sizes, (24, 24), batch_seed=5)
    for (h, w), region in zip(sizes, regions, strict=True):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        mask = rng.integers(0, 6, (h, w), dtype=np.uint8)
        boxes = np.array([[0, 0, w / 3, h / 2], [w / 2, h / 3, w, h]], np.float32)
        labels = np.array([1, 2], np.int64)
        cpu = warp_fields({"image": pixels, "mask": mask, "boxes": (boxes, labels)}, spec, region)
        stored = {  # as `ResidentSamples._to_store` keeps a sample
            "image": torch.from_numpy(pixels).permute(2, 0, 1),
            "mask": torch.from_numpy(mask),
            "boxes": (boxes, labels),
        }
        dev = warp_on_device(stored, spec, region)
        diff = (dev["image"].int() - cpu["image"].int()).abs().max().item()
        assert dev["image"].dtype == torch.uint8 and diff <= 1, (region, diff)
        assert torch.equal(dev["mask"], cpu["mask"]), region
        assert torch.equal(dev["boxes"][0], cpu["boxes"][0]), region
        assert torch.equal(dev["boxes"][1], cpu["boxes"][1]), region
