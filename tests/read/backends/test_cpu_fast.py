"""The cpu backend's fast paths give the per-sample path's batches, bit for bit.

- raw batches gathered in array operations (`raw_shard.gather_raw_batch`) against the per-sample
  reader (`ShardReader.sample` + `decode_raw` + `_collate`);
- batches handed from persistent workers through shared-memory slots (`read/transport/slots.py`) against
  batches made in the main process.

Odd cases each: the last short batch, a mid-epoch resume, evaluation padding, a mix of two
datasets (merged labels), on_error="skip" with a corrupt sample.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import fastdata.read.backends.cpu_batches as cpu
from fastdata.format.manifest_io import load_manifest
from fastdata.lightning.datamodule import ShardDataModule
from fastdata.lightning.options import ShardSet
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.base import LoaderSpec, WorkerSettings
from fastdata.read.plan import PAD_LABEL
from fastdata.read.shard_index import parse_index
from fastdata.read.shardio import ShardReadError
from fastdata.read.transport.slots import BatchSlots, SlotError
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.arrays import ArraySource


def _spec(root: Path, **kw) -> LoaderSpec:
    keys = {"num_workers", "prefetch_factor"}
    workers = WorkerSettings(**{k: kw.pop(k) for k in list(kw) if k in keys})
    base = dict(manifest=load_manifest(root), split="train", train=True, batch_size=32, seed=5)
    return LoaderSpec(workers=workers, **(base | kw))


def _run(loader, epochs=((0, 0, 0),)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every batch of the given (epoch, consumed, steps before) iterations, kept (held) together."""
    out = []
    for epoch, consumed, steps in epochs:
        loader.set_epoch(epoch, consumed, steps)
        out += [(x.clone(), y.clone()) for x, y in loader]
    return out


def _same(a, b) -> None:
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == xb.dtype == torch.uint8 and ya.dtype == yb.dtype == torch.int64
        assert xa.is_contiguous() and xb.is_contiguous()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.fixture
def gathered(monkeypatch) -> list[bool]:
    """Records, per batch made in this process, whether the array path made it."""
    calls: list[bool] = []
    real = cpu.gather_raw_batch

    def spy(*args, **kw):
        out = real(*args, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu, "gather_raw_batch", spy)
    return calls


def _per_sample(monkeypatch, make):
    """`make()` with the array path and the slots switched off: the per-sample reference."""
    with monkeypatch.context() as m:
        m.setattr(cpu, "gather_raw_batch", lambda *a, **k: None)
        m.setattr(BatchSlots, "create", classmethod(lambda *a, **k: None))
        return make()


EPOCHS = ((0, 0, 0), (1, 0, 0), (1, 4 * 32, 4))  # two epochs, then epoch 1 resumed after 4 steps


def test_gathered_training_batches_equal_the_per_sample_path(tiny_shards, monkeypatch, gathered):
    def make():
        return _run(make_cpu_loader(_spec(tiny_shards, drop_last=False)), EPOCHS)

    reference = _per_sample(monkeypatch, make)
    fast = make()
    _same(fast, reference)
    assert len(reference[-1][1]) == 300 % 32  # the last short batch was compared
    assert gathered and all(gathered) and len(gathered) == len(reference)


def test_gathered_evaluation_padding_equals_the_per_sample_path(tiny_shards, monkeypatch, gathered):
    def make():  # 50 test samples on 3 ranks: one padding sample, marked on the last rank
        spec = _spec(tiny_shards, split="test", train=False, batch_size=16, rank=2, world_size=3)
        return _run(make_cpu_loader(spec))

    reference = _per_sample(monkeypatch, make)
    fast = make()
    _same(fast, reference)
    assert int((torch.cat([y for _, y in fast]) == PAD_LABEL).sum()) == 1
    assert gathered and all(gathered)


def _write_arrays(out: Path, prefix: str, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (n, 6, 5, 3), dtype=np.uint8)  # not square: H, W kept apart
    splits = {"train": (pixels, np.arange(n)), "test": (pixels[:10], np.arange(10))}
    source = ArraySource(splits, [f"{prefix}{i}" for i in range(n)])
    write_shards(source, out, ShardOptions(max_count=16, workers=1, progress=False))
    return out


def test_gathered_mix_of_two_datasets_equals_the_per_sample_path(tmp_path, monkeypatch, gathered):
    roots = [_write_arrays(tmp_path / "a", "a", 40, 1), _write_arrays(tmp_path / "b", "b", 70, 2)]

    def make():
        dm = ShardDataModule(
            [ShardSet(roots[0], weight=3), ShardSet(roots[1])],
            batch_size=12,
            seed=5,
            drop_last=False,
            backend="cpu",
            workers=WorkerSettings(num_workers=0),
        )
        dm.setup("fit")
        loader = dm.train_dataloader()
        return [(x.clone(), y.clone()) for _ in range(2) for x, y in loader]

    reference = _per_sample(monkeypatch, make)
    fast = make()
    _same(fast, reference)
    labels = torch.cat([y for _, y in fast])
    assert labels.max() >= 40 and labels.min() < 40  # B's labels were mapped past A's classes
    assert fast[0][0].shape[1:] == (3, 6, 5)
    assert gathered and all(gathered)


def _corrupt_label(root: Path, shard: int, index: int) -> None:
    """Store a label outside the class list in one sample's `lid` (a corrupt sample)."""
    manifest = load_manifest(root)
    info = manifest.split("train").shards[shard]
    layout = parse_index(Path(manifest.index_url(info)).read_text(), info.name).layout
    offset = int(layout["lid"][0][index])
    with open(manifest.shard_url(info), "r+b") as f:
        f.seek(offset)
        f.write(np.array([10**6], dtype="<i8").tobytes())


def test_a_corrupt_sample_is_skipped_or_named_as_on_the_per_sample_path(
    tiny_shards, monkeypatch, gathered
):
    _corrupt_label(tiny_shards, shard=1, index=5)

    def make():
        loader = make_cpu_loader(_spec(tiny_shards, on_error="skip", drop_last=False))
        return _run(loader, EPOCHS), loader.skipped

    reference, skipped = _per_sample(monkeypatch, make)
    fast, fast_skipped = make()
    _same(fast, reference)
    # Once in each whole epoch (the resumed one may have passed it).
    assert fast_skipped == skipped >= 2
    assert sum(len(y) for _, y in fast[:10]) == 299
    # Only the batches holding the bad sample took the per-sample path.
    assert gathered.count(False) == skipped and gathered.count(True) == len(fast) - skipped
    with pytest.raises(ShardReadError, match=r"train-000001\.tar, sample 'train_\d{8}'.*label"):
        list(make_cpu_loader(_spec(tiny_shards)))


def test_worker_batches_through_slots_equal_main_process_batches(tiny_shards, monkeypatch):
    taken: list[int] = []
    real = BatchSlots.take

    def spy(self, ref, pin=False):
        taken.append(ref.slot)
        return real(self, ref, pin)

    monkeypatch.setattr(BatchSlots, "take", spy)
    reference = _per_sample(
        monkeypatch, lambda: _run(make_cpu_loader(_spec(tiny_shards, drop_last=False)), EPOCHS)
    )
    loader = make_cpu_loader(_spec(tiny_shards, drop_last=False, num_workers=2, prefetch_factor=2))
    try:
        assert loader.dataset.slots is not None
        fast = _run(loader, EPOCHS)  # every batch held until the end: no slot reused under it
        _same(fast, reference)
        assert len(taken) == len(fast)  # every batch came through a slot
        # Epochs left after two batches: their batches in flight are dropped by the DataLoader
        # unread; the next iteration frees their slots, so none falls back to tensors.
        for _ in range(4):
            for step, _batch in enumerate(loader):
                if step == 1:
                    break
        taken.clear()
        loader.set_epoch(0)
        assert len(list(loader)) == len(taken) == len(loader)
    finally:
        loader.close()


def test_evaluation_batches_through_slots_keep_their_padding(tiny_shards, monkeypatch):
    def make(workers):
        spec = _spec(tiny_shards, split="test", train=False, batch_size=16, rank=2, world_size=3)
        spec = spec.__class__(**(spec.__dict__ | {"workers": WorkerSettings(num_workers=workers)}))
        loader = make_cpu_loader(spec)
        try:
            return _run(loader), loader.dataset.slots
        finally:
            loader.close()

    reference, _ = _per_sample(monkeypatch, lambda: make(0))
    fast, slots = make(2)
    assert slots is not None
    _same(fast, reference)


def test_slots_refuse_what_they_cannot_hold_and_detect_a_rewritten_slot():
    slots = BatchSlots.create(1, 2, 4, (3, 2, 2))
    assert slots is not None
    images = torch.arange(4 * 12, dtype=torch.uint8).view(4, 3, 2, 2)
    labels = torch.arange(4, dtype=torch.int64)
    first = slots.put(0, images, labels)
    second = slots.put(0, images[:3] + 1, labels[:3] + 1)
    assert first is not None and second is not None
    assert slots.put(0, images, labels) is None  # both slots held: sent as tensors instead
    x, y = slots.take(second)
    assert torch.equal(x, images[:3] + 1) and torch.equal(y, labels[:3] + 1)
    assert slots.put(0, images[:, :, :1], labels) is None  # another image shape
    assert slots.put(0, torch.zeros((5, 3, 2, 2), dtype=torch.uint8), torch.arange(5)) is None
    with pytest.raises(SlotError, match="slot 1 of loader worker 0"):
        slots.take(second)  # already taken: the slot is free
    slots.release(0)  # a new iteration: slot 0 is written first
    again = slots.put(0, images * 2, labels)  # the first slot, rewritten
    assert again is not None and again.slot == first.slot
    with pytest.raises(SlotError, match="does not hold the batch"):
        slots.take(first)
    x, _ = slots.take(again)
    assert torch.equal(x, images * 2)
    assert BatchSlots.create(8, 8, 4096, (3, 64, 64)) is None  # over MAX_SLOT_BYTES


def test_slots_take_at_most_a_quarter_of_the_free_shared_memory_fewer_if_need_be(monkeypatch):
    import fastdata.read.transport.slots as slots_module

    slot = 4 * (3 * 32 * 32 + 8) + 8  # one slot of 4 images
    for free, depth in [(4 * 6 * slot, 3), (4 * 6 * slot - 1, 2), (4 * 4 * slot - 1, None)]:
        monkeypatch.setattr(slots_module, "_shm_free", lambda free=free: free)
        found = BatchSlots.create(2, 3, 4, (3, 32, 32))  # 2 workers x 3 slots asked
        assert (found and found.state.shape[1]) == depth, free
    monkeypatch.setattr(slots_module, "_shm_free", lambda: 4 * 2 * slot)
    assert BatchSlots.create(2, 1, 4, (3, 32, 32)).state.shape[1] == 1  # one asked: one given


@pytest.mark.gpu  # pinned memory needs CUDA
def test_slots_copy_into_pinned_memory_when_the_loader_pins(tiny_shards):
    spec = _spec(tiny_shards, num_workers=2, prefetch_factor=2)
    spec = spec.__class__(**(spec.__dict__ | {"workers": WorkerSettings(2, 2, pin_memory=True)}))
    loader = make_cpu_loader(spec)
    try:
        assert loader.dataset.slots is not None
        batches = list(loader)
        assert batches and all(x.is_pinned() for x, _ in batches)
    finally:
        loader.close()


def test_a_persistent_worker_opens_local_shards_once_not_every_epoch(tiny_shards, monkeypatch):
    import multiprocessing

    made = multiprocessing.get_context("fork").Value("i", 0)
    real = cpu.ShardReader.__init__

    def counting(self, *args, **kw):
        with made.get_lock():
            made.value += 1
        real(self, *args, **kw)

    monkeypatch.setattr(cpu.ShardReader, "__init__", counting)
    spec = _spec(tiny_shards, split="test", train=False, batch_size=8, num_workers=2)
    loader = make_cpu_loader(replace(spec, workers=replace(spec.workers, mp_context="fork")))
    try:
        epochs = [[y.tolist() for _, y in loader] for _ in range(3)]
    finally:
        loader.close()
    assert epochs[0] == epochs[1] == epochs[2] and len(epochs[0]) == 7
    assert made.value == 2  # one reader per worker, kept from epoch to epoch


def test_photo_batches_decoded_into_the_slots_equal_main_process_batches(tmp_path, monkeypatch):
    """JPEG batches are decoded straight into the worker's next free slot (`BatchSlots.target`):
    the same uint8 batches as in the main process, over two epochs, with photos that fail to
    decode skipped (their batch is then collated anew and copied into the slot)."""
    from PIL import Image

    from fastdata.write.sources import open_source

    rng = np.random.default_rng(0)
    for c in range(3):
        (tmp_path / "photos" / f"class{c}").mkdir(parents=True)
        for i in range(22):
            h, w = (int(v) for v in rng.integers(40, 90, 2))
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "photos" / f"class{c}" / f"{i}.jpg")
    root = tmp_path / "shards"
    write_shards(open_source("folder", tmp_path / "photos"), root, ShardOptions(progress=False))

    real_decode = cpu.decode_batch

    def failing(payloads, *args, **kw):  # the same photos fail in every process
        found = real_decode(payloads, *args, **kw)
        pairs = zip(payloads, found, strict=True)
        return [ValueError("bad") if bytes(p)[-3] % 7 == 0 else r for p, r in pairs]

    monkeypatch.setattr(cpu, "decode_batch", failing)
    in_place = torch.zeros(2, dtype=torch.int64).share_memory_()  # seen from forked workers
    real_target = BatchSlots.target

    def spy(self, worker, n):
        found = real_target(self, worker, n)
        in_place[int(found is None)] += 1
        return found

    def batches(workers: int, prefetch: int = 2, slow: bool = False) -> list:
        dm = ShardDataModule(
            root,
            batch_size=8,
            workers=WorkerSettings(
                num_workers=workers,
                prefetch_factor=prefetch if workers else "auto",
                mp_context="fork",  # the patches above reach the workers
            ),
            backend="cpu",
            image_size=32,
            seed=3,
            drop_last=False,
            on_error="skip",
        )
        dm.setup("fit")
        loader = dm.train_dataloader()
        try:
            out = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                for x, y in loader:
                    out.append((x.clone(), y.clone()))
                    if slow:  # the workers run ahead and find their next slot still held
                        time.sleep(0.05)
            return out
        finally:
            loader.loader.close()

    reference = _per_sample(monkeypatch, lambda: batches(0))
    monkeypatch.setattr(BatchSlots, "target", spy)
    fast = batches(2)
    _same(fast, reference)
    assert sum(len(y) for _, y in reference) < 2 * 66  # some photos failed and were skipped
    # Every batch but each epoch's look-ahead one (decoded by another thread) went in place.
    assert in_place[0] >= len(fast) - 2 * 2 and in_place[1] == 0
    # Two slots per worker where four batches may be in flight: a worker whose next slot is
    # still held decodes into its own array, and no batch is torn.
    import fastdata.read.transport.slots as slots_module

    per_slot = 8 * (3 * 32 * 32 + 8) + 8
    monkeypatch.setattr(slots_module, "_shm_free", lambda: 4 * 2 * 2 * per_slot)
    in_place.zero_()
    _same(batches(2, prefetch=4, slow=True), reference)
    assert in_place[1] > 0 and in_place[0] > 0
