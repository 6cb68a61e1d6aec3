"""Dict batches on the cpu and memory backends, train and eval: after every augmentation the box
encloses exactly the coloured pixels (within 1 px) and the mask equals them (away from a 1 px
band at the rectangle's edge); multi-label and caption fields arrive with their own sample;
evaluation padding is marked per target; a mid-epoch resume gives exactly the remaining samples.

The images are black with one white rectangle, so the coloured pixels of a batch image are those
above mid-grey once the normalization is undone: the property cannot hold by accident (a crop,
flip or resize applied to the image and not to the targets, or the reverse, moves one off the
other).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdata import DetectionDataModule, SegmentationDataModule, ShardDataModule, WorkerSettings
from fastdata.augment import Preset
from fastdata.format.manifest import ManifestError
from fastdata.read.decoders.dict_batch import EvalSample, TrainSample
from tests.lightning.family.conftest import IGNORE, NUM_CLASSES, rectangles, write_field_shards

CASES = {
    # name: (preset, image_size, fixed image size of the data or None)
    "photo": ("photo", 32, None),  # random-resized crop + flip; eval: resize + centre crop
    "cifar": ("cifar", None, (28, 28)),  # pad-crop (outside pixels: ignore_index) + flip
    "none": ("none", 24, None),  # the whole image resized
    "detection": ("detection", 40, None),  # DetectionDataModule's default: resize + flip
}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    out = {}
    for fixed in (None, (28, 28)):
        splits = {
            "train": rectangles(40, 11, fixed=fixed),
            "val": rectangles(13, 12, fixed=fixed),
        }
        root = tmp_path_factory.mktemp("rects") / "shards"
        write_field_shards(root, splits)
        out[str(fixed)] = root, {r.key: r for rs in splits.values() for r in rs}
    return out


def _dm(root: Path, backend: str, case: str, **kw) -> ShardDataModule:
    preset, size, _ = CASES[case]
    options = dict(
        batch_size=8,
        workers=WorkerSettings(num_workers=0),
        backend=backend,
        image_size=size,
        drop_last=False,
    )
    if case == "detection":
        return DetectionDataModule(root, **(options | kw))
    return SegmentationDataModule(root, train_transforms=preset, **(options | kw))


def _pixels(dm: ShardDataModule, image: torch.Tensor) -> torch.Tensor:
    """The 0..255 image the normalization came from."""
    mean = torch.tensor(dm.transforms.mean).view(3, 1, 1)
    std = torch.tensor(dm.transforms.std).view(3, 1, 1)
    return image.float() * std + mean


def _cpu(batch):
    """The batch's tensors on the CPU (the DataModule's device is CUDA where there is one)."""
    out = type(batch)(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.cpu()
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            out[key] = [v.cpu() for v in value]
    return out


def check_sample(batch, i: int, rects: dict, dm: ShardDataModule) -> None:
    """Every property of sample `i` of a prepared dict batch (see the module docstring)."""
    batch = _cpu(batch)
    rect = rects[batch["meta"][i]["key"]]
    assert batch["caption"][i] == f"a white box of class {rect.cls} in {rect.key}"
    expected = torch.zeros(NUM_CLASSES)
    mask, boxes, labels = batch["mask"][i], batch["boxes"][i], batch["box_labels"][i]
    if bool(batch["padded"][i]):
        assert (mask == IGNORE).all() and len(boxes) == 0 and len(labels) == 0
        assert (batch["labels"][i] == 0).all()
        return
    expected[[rect.cls, (rect.cls + 2) % NUM_CLASSES]] = 1
    assert torch.equal(batch["labels"][i], expected)
    colour = _pixels(dm, batch["image"][i])[0] > 127.5
    h, w = colour.shape
    assert mask.shape == (h, w) and mask.dtype == torch.int64
    assert set(mask.unique().tolist()) <= {0, rect.cls + 1, IGNORE}
    assert len(boxes) == len(labels) <= 1
    if len(boxes):
        assert labels.tolist() == [rect.cls]
        x0, y0, x1, y1 = boxes[0].tolist()
        assert 0 <= x0 <= x1 <= w and 0 <= y0 <= y1 <= h
    if colour.any():
        ys, xs = colour.nonzero(as_tuple=True)
        seen = [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]
        assert len(boxes) == 1, f"{rect.key}: coloured pixels at {seen} but no box"
        assert max(abs(a - b) for a, b in zip(seen, boxes[0].tolist(), strict=True)) <= 1.0, (
            f"{rect.key}: box {boxes[0].tolist()} vs coloured pixels {seen}"
        )
    else:  # the crop missed the rectangle, or left a sliver thinner than a pixel
        assert len(boxes) == 0 or min(x1 - x0, y1 - y0) < 1.0
    if len(boxes):
        x0, y0, x1, y1 = boxes[0].tolist()
        yy = torch.arange(h).view(-1, 1) + 0.5
        xx = torch.arange(w).view(1, -1) + 0.5
        inner = (xx > x0 + 1) & (xx < x1 - 1) & (yy > y0 + 1) & (yy < y1 - 1)
        outer = (xx > x0 - 1) & (xx < x1 + 1) & (yy > y0 - 1) & (yy < y1 + 1)
    else:
        inner = torch.zeros_like(colour)
        outer = colour | (mask == rect.cls + 1)
    assert (mask[inner] == rect.cls + 1).all() and colour[inner].all()
    assert (mask[~outer] != rect.cls + 1).all() and not colour[~outer].any()


def _walk(dm: ShardDataModule, loader, rects: dict, kind: type) -> list[str]:
    keys = []
    for batch in dm.prepared(loader):
        assert isinstance(batch, kind), type(batch)
        assert batch["image"].dtype == torch.float32
        for i in range(len(batch["meta"])):
            check_sample(batch, i, rects, dm)
            if not batch["padded"][i]:
                keys.append(batch["meta"][i]["key"])
    return keys


@pytest.mark.parametrize("backend", ["cpu", "memory"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_targets_follow_every_augmentation(datasets, backend: str, case: str) -> None:
    root, rects = datasets[str(CASES[case][2])]
    dm = _dm(root, backend, case)
    dm.setup("fit")
    train = {k for k in rects if k.startswith("s11")}
    for _epoch in range(2):  # two epochs: other regions
        keys = _walk(dm, dm.train_dataloader(), rects, TrainSample)
        assert sorted(keys) == sorted(train)
    val = _walk(dm, dm.val_dataloader(), rects, EvalSample)
    assert sorted(val) == sorted(k for k in rects if k.startswith("s12"))


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_evaluation_padding_is_marked_per_target_and_each_sample_counts_once(datasets, backend):
    root, rects = datasets["None"]
    keys, padded = [], 0
    for rank in (0, 1):  # 13 val samples on 2 ranks: one padding sample (plan rule 3)
        dm = _dm(root, backend, "photo", batch_size=4, rank=rank, world_size=2)
        dm.setup("validate")
        for batch in dm.prepared(dm.val_dataloader()):
            for i in range(len(batch["meta"])):
                check_sample(batch, i, rects, dm)
            padded += int(batch["padded"].sum())
            keys += [m["key"] for m, p in zip(batch["meta"], batch["padded"], strict=True) if not p]
    assert padded == 1
    assert sorted(keys) == sorted(k for k in rects if k.startswith("s12"))


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_ignore_index_is_an_option_of_the_base_module(datasets, backend):
    """`ShardDataModule(ignore_index=)` (not only the segmentation member) marks a pad-crop's
    outside pixels in training and every pixel of an evaluation padding sample."""
    root, _ = datasets["(28, 28)"]
    marks = {"train": 0, "padding": 0}
    for rank in (0, 1):  # 13 val samples on 2 ranks: one padding sample
        dm = ShardDataModule(
            root, backend=backend, batch_size=8, train_transforms="cifar", ignore_index=7,
            workers=WorkerSettings(num_workers=0), rank=rank, world_size=2, drop_last=False,
        )  # fmt: skip
        assert dm.loader_spec("val", train=False).ignore_index == 7
        for batch in dm.prepared(dm.train_dataloader()):
            mask = torch.stack(list(_cpu(batch)["mask"]))
            assert IGNORE not in mask.unique().tolist()
            marks["train"] += int((mask == 7).sum())
        for batch in dm.prepared(dm.val_dataloader()):
            batch = _cpu(batch)
            for mask, padded in zip(batch["mask"], batch["padded"], strict=True):
                assert (mask == 7).all() if padded else not (mask == 7).any()
                marks["padding"] += int(padded)
    assert marks["train"] > 0 and marks["padding"] == 1  # 4 px pads: drawn on some images


def test_ignore_index_out_of_range_is_refused(datasets):
    root, _ = datasets["None"]
    for bad in (-1, 65536):
        with pytest.raises(ValueError, match=f"ignore_index must be in 0..65535, got {bad}"):
            ShardDataModule(root, ignore_index=bad)


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_a_mid_epoch_resume_gives_exactly_the_remaining_samples(datasets, backend):
    root, rects = datasets["None"]
    dm = _dm(root, backend, "photo", seed=3)
    taken = []
    for step, batch in enumerate(dm.prepared(dm.train_dataloader()), start=1):
        taken += [m["key"] for m in batch["meta"]]
        if step == 2:
            break
    state = dm.state_dict()
    resumed = _dm(root, backend, "photo", seed=3)
    resumed.load_state_dict(state)
    rest = [m["key"] for b in resumed.prepared(resumed.train_dataloader()) for m in b["meta"]]
    assert len(taken) == 16 and sorted(taken + rest) == sorted(k for k in rects if "s11" in k)


def test_classification_batches_stay_tuples(tiny_shards):
    dm = ShardDataModule(
        tiny_shards, batch_size=16, backend="cpu", workers=WorkerSettings(num_workers=0)
    )
    x, y = next(iter(dm.prepared(dm.train_dataloader())))
    assert x.shape == (16, 3, 8, 8) and y.shape == (16,)


def test_a_preset_with_a_user_callable_is_refused_for_a_dict_split(datasets):
    root, _ = datasets["None"]
    dm = SegmentationDataModule(
        root,
        batch_size=4,
        backend="cpu",
        image_size=16,
        train_transforms=lambda x: x,
        workers=WorkerSettings(num_workers=0),
    )
    with pytest.raises(ValueError, match="moves only the images"):
        next(iter(dm.train_dataloader()))
    assert Preset  # a Preset of built-in ops is the way


def test_worker_processes_give_the_same_dict_batches_as_the_training_process(datasets):
    root, _ = datasets["None"]

    def epochs(workers: int) -> list:
        dm = _dm(
            root, "cpu", "photo", workers=WorkerSettings(num_workers=workers, prefetch_factor=2)
        )
        return [list(dm.prepared(dm.train_dataloader())) for _epoch in range(2)]

    for one, other in zip(epochs(0), epochs(2), strict=True):  # epoch 2: the look-ahead batch
        assert len(one) == len(other) == 5
        for a, b in zip(one, other, strict=True):
            assert type(a) is type(b) is TrainSample and a.keys() == b.keys()
            assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])
            assert a["meta"] == b["meta"] and a["caption"] == b["caption"]
            assert all(torch.equal(x, y) for x, y in zip(a["boxes"], b["boxes"], strict=True))


def test_a_mix_of_dict_datasets_keeps_fields_and_merges_classes(tmp_path: Path) -> None:
    """Two datasets whose classes are listed in other orders: the mix's class of every target
    (label list, box labels) is the one its name has in the mix."""
    import json

    a = write_field_shards(tmp_path / "a", {"train": rectangles(16, 21), "val": rectangles(4, 22)})
    b = write_field_shards(tmp_path / "b", {"train": rectangles(16, 23), "val": rectangles(4, 24)})
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["classes"] = manifest["classes"][::-1]  # b's class i is the mix's class 4 - i
    (b / "manifest.json").write_text(json.dumps(manifest))
    # Mask pixels are a dataset's own class indices, never remapped: such a mix is refused...
    with pytest.raises(ManifestError, match="mask pixels are not remapped"):
        SegmentationDataModule(
            [a, b], batch_size=8, backend="cpu", workers=WorkerSettings(num_workers=0)
        ).setup("fit")
    for root in (a, b):  # ...so this test reads the other targets only
        data = json.loads((root / "manifest.json").read_text())
        for split in data["splits"].values():
            del split["fields"]["mask"]
        (root / "manifest.json").write_text(json.dumps(data))
    rects = {r.key: r for s in (21, 23) for r in rectangles(16, s)}
    dm = DetectionDataModule(
        [a, b],
        batch_size=8,
        backend="cpu",
        image_size=16,
        drop_last=False,
        workers=WorkerSettings(num_workers=0),
    )
    seen = 0
    for batch in dm.prepared(dm.train_dataloader()):
        for i, meta in enumerate(batch["meta"]):
            rect = rects[meta["key"]]
            cls = rect.cls if meta["key"].startswith("s21") else NUM_CLASSES - 1 - rect.cls
            other = (rect.cls + 2) % NUM_CLASSES
            other = other if meta["key"].startswith("s21") else NUM_CLASSES - 1 - other
            assert batch["labels"][i].nonzero().flatten().tolist() == sorted({cls, other})
            assert batch["box_labels"][i].tolist() in ([cls], [])
            seen += 1
    assert seen == 32
