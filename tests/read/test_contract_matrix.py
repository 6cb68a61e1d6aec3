"""The contract matrix: every backend x encoding x transforms x image_size x splits x world size x
batch size yields the same shapes, dtypes and label sequences on every backend, or is refused
while the DataModule and its loaders are built, with an error that says what to change.

The product (1,440 combinations, each run on every local backend) is generated, not listed. CI
runs a seeded sample of 60 that covers every pair of values of any two axes (`pairwise`, 23
combinations, then random ones); ``FASTDATA_FULL_MATRIX=1`` runs the whole product. Each dataset is built once per session.
Labels equal sample ids, so a label sequence names the samples.

Dict datasets (detection, segmentation: `test_dict_contract`) of mixed aspect ratios with boxes
and masks at the images' edges are compared field by field between the backends that carry
fields (images within a grey level, boxes within a pixel, the rest exactly); the others must
refuse them.
"""

from __future__ import annotations

import csv
import itertools
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import ShardDataModule, WorkerSettings
from fastdata.augment import PadCrop, Preset
from fastdata.read import BACKENDS
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.arrays import ArraySource
from fastdata.write.sources.listfile import ListSource

SIDE = 8  # the images' own size
N = {"train": 30, "val": 10, "test": 10}
LIMIT = 2  # training batches compared per rank (the whole val split is compared)
LOCAL = ["cpu", "memory"] + (["dali"] if BACKENDS["dali"].check()[0] else [])
CPU = torch.device("cpu")


def coin_flip(x: torch.Tensor) -> torch.Tensor:
    """A user transform drawing from torch's global generator, as a torchvision v2 one does."""
    return x.flip(-1) if bool(torch.rand(1) < 0.5) else x


TYPED = Preset("typed", None, (0.0,) * 3, (255.0,) * 3, (PadCrop(pad=2, flip_p=0.5),))
AXES: dict[str, tuple] = {
    "encoding": ("raw", "png", "jpeg", "mixed"),
    "transforms": ("none", "cifar", "photo", "callable", "preset"),
    "image_size": (None, "native", "smaller", "larger"),
    "val": (True, False),
    "world": (1, 2, 3),
    "batch": (1, 7, 256),
}
SIZES = {None: None, "native": SIDE, "smaller": SIDE - 2, "larger": SIDE + 4}
SPECS = {"callable": coin_flip, "preset": TYPED}


def pairwise(axes: dict[str, tuple], seed: int = 0, candidates: int = 40) -> list[tuple]:
    """A seeded list of combinations covering every pair of values of any two axes (greedy)."""
    rng = random.Random(seed)
    values = list(axes.values())
    k = len(values)
    todo = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(k), 2)
        for a in range(len(values[i]))
        for b in range(len(values[j]))
    }
    chosen = []
    while todo:
        best, gain = None, -1
        for _ in range(candidates):
            pick = [rng.randrange(len(v)) for v in values]
            i, a, j, b = rng.choice(sorted(todo))  # start from an uncovered pair
            pick[i], pick[j] = a, b
            covered = sum(
                (x, pick[x], y, pick[y]) in todo for x, y in itertools.combinations(range(k), 2)
            )
            if covered > gain:
                best, gain = pick, covered
        todo -= {(x, best[x], y, best[y]) for x, y in itertools.combinations(range(k), 2)}
        chosen.append(tuple(values[x][best[x]] for x in range(k)))
    return chosen


def combos(total: int = 60, seed: int = 0) -> list[tuple]:
    """The whole product with FASTDATA_FULL_MATRIX=1; else the pairwise sample, topped up with
    seeded random combinations of the product to `total`."""
    product = list(itertools.product(*AXES.values()))
    if os.environ.get("FASTDATA_FULL_MATRIX") == "1":
        return product
    chosen = pairwise(AXES, seed)
    rest = [c for c in product if c not in set(chosen)]
    return chosen + random.Random(seed).sample(rest, max(0, total - len(chosen)))


def test_the_sample_covers_every_pair_of_values():
    chosen = pairwise(AXES)
    names = list(AXES)
    for x, y in itertools.combinations(range(len(names)), 2):
        pairs = {(c[x], c[y]) for c in chosen}
        assert len(pairs) == len(AXES[names[x]]) * len(AXES[names[y]]), (names[x], names[y])
    assert chosen == pairwise(AXES) and len(chosen) < 60  # seeded, and small enough for CI


# ---------------------------------------------------------------- datasets (once per session)


def _pixels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SIDE, SIDE, 3), dtype=np.uint8)


def _write(encoding: str, val: bool, out: Path) -> Path:
    splits = [s for s in N if val or s != "val"]
    options = ShardOptions(max_count=16, workers=1, progress=False)
    if encoding != "mixed":
        arrays = {s: (_pixels(N[s], i), np.arange(N[s])) for i, s in enumerate(splits)}
        classes = [f"c{i}" for i in range(max(N.values()))]
        enc = {"raw": "raw", "png": "png", "jpeg": "jpeg"}[encoding]
        write_shards(
            ArraySource(arrays, classes), out, ShardOptions(**{**vars(options), "encoding": enc})
        )
        return out
    files = out.parent / f"{out.name}-files"  # JPEG and PNG files side by side, kept as they are
    files.mkdir(parents=True)
    with open(files / "list.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["path", "label", "split"])
        for i, s in enumerate(splits):
            for j, pixels in enumerate(_pixels(N[s], i)):
                name = f"{s}{j}.{'png' if j % 2 else 'jpg'}"
                Image.fromarray(pixels).save(files / name)
                rows.writerow([name, j, s])
    write_shards(
        ListSource(files / "list.csv"), out, ShardOptions(**{**vars(options), "encoding": "keep"})
    )
    return out


@pytest.fixture(scope="session")
def datasets(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("matrix")
    return {
        (enc, val): _write(enc, val, root / f"{enc}-{'val' if val else 'noval'}")
        for enc in AXES["encoding"]
        for val in AXES["val"]
    }


# ---------------------------------------------------------------- one combination


@dataclass(frozen=True)
class Outcome:
    """What a backend made of a combination: the error refusing it, or per rank the batches'
    (shape, dtype, labels) of training (the first `LIMIT`) and of the whole val split, and
    their images on the 0..255 scale (compared within `GREY_TOLERANCE`, not by equality)."""

    refused: str | None = None
    batches: tuple = ()
    images: tuple = ()


def _describe(batches, scale: tuple[torch.Tensor, torch.Tensor], images: list) -> list[tuple]:
    out = []
    mean, std = scale
    for x, y in batches:
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert torch.isfinite(x).all()
        out.append((tuple(x.shape), str(x.dtype), tuple(y.tolist())))
        images.append(x * std + mean)
    return out


def run(root: Path, backend: str, transforms, image_size, world: int, batch: int) -> Outcome:
    per_rank, images = [], []
    for rank in range(world):
        try:  # construction: the only place a combination may be refused
            dm = ShardDataModule(
                root,
                backend=backend,
                batch_size=batch,
                seed=3,
                rank=rank,
                world_size=world,
                image_size=image_size,
                train_transforms=transforms,
                drop_last=False,
                workers=WorkerSettings(num_workers=0),
            )
            dm.setup("fit")
            train, val = dm.train_dataloader(), dm.val_dataloader()
        except ValueError as exc:
            return Outcome(refused=str(exc))
        scale = tuple(
            torch.tensor(v).view(1, 3, 1, 1) for v in (dm.transforms.mean, dm.transforms.std)
        )
        seen = _describe(itertools.islice(dm.prepared(train, CPU), LIMIT), scale, images)
        per_rank.append((tuple(seen), tuple(_describe(dm.prepared(val, CPU), scale, images))))
    return Outcome(batches=tuple(per_rank), images=tuple(images))


def _side(transforms: str, image_size: int | None) -> int:
    if image_size is not None:
        return image_size
    return 224 if transforms == "photo" else SIDE


@pytest.mark.parametrize(("encoding", "transforms", "size", "val", "world", "batch"), combos())
def test_contract(datasets, encoding, transforms, size, val, world, batch):
    root, image_size = datasets[(encoding, val)], SIZES[size]
    spec = SPECS.get(transforms, transforms)
    outcomes = {b: run(root, b, spec, image_size, world, batch) for b in LOCAL}
    for outcome in outcomes.values():
        if outcome.refused is not None:
            assert any(w in outcome.refused for w in ("pass ", "use ", "backend=")), outcome.refused
    # Whether a combination is possible does not depend on the backend.
    for backend in outcomes:
        assert (outcomes[backend].refused is None) == (outcomes["cpu"].refused is None), outcomes
    ran = {b: o.batches for b, o in outcomes.items() if o.refused is None}
    if not ran:
        return
    reference = next(iter(ran.values()))
    for backend, batches in ran.items():
        assert batches == reference, f"{backend} differs from {next(iter(ran))}"
    if "dali" in ran:  # DALI decodes the cpu backend's crop windows and flips: the same pixels
        for i, (a, b) in enumerate(
            zip(outcomes["cpu"].images, outcomes["dali"].images, strict=True)
        ):
            diff = (a - b).abs().amax().item() if a.numel() else 0.0
            assert diff <= GREY_TOLERANCE + 1e-3, f"dali batch {i} differs from cpu's by {diff}"
    side = _side(transforms, image_size)
    for train, evaluation in reference:
        assert len(train) == min(LIMIT, -(-N["train"] // (world * batch)))
        assert (len(evaluation) > 0) == val
        for shape, _, labels in train + evaluation:
            assert shape == (len(labels), 3, side, side)
    labels = [y for _, ev in reference for _, _, ys in ev for y in ys if y >= 0]
    assert sorted(labels) == (list(range(N["val"])) if val else [])


# ---------------------------------------------------------------- dict datasets: every field

# Detection and segmentation splits of mixed aspect ratios (wide, tall, thin strips) whose boxes
# and masks touch the images' edges (`tests.lightning.family.conftest.edge_rectangles`): every backend that
# carries fields yields, for the same plan position, the same sample in every field: images
# within the resize tolerance, boxes within a pixel, masks, classes, multi-hot labels, captions,
# json records and padding marks exactly. The other backends refuse the split at construction.
DICT_AXES: dict[str, tuple] = {
    "module": ("detection", "detection-photo", "segmentation-photo", "segmentation-none"),
    "image_size": (16, 48),
    "world": (1, 2),
    "batch": (1, 5),
}
GREY_TOLERANCE = 1.0  # grey levels (0..255) between two backends' resized pixels
BOX_TOLERANCE = 1.0  # pixels


@pytest.fixture(scope="session")
def dict_dataset(tmp_path_factory) -> Path:
    from tests.lightning.family.conftest import edge_rectangles, write_field_shards

    root = tmp_path_factory.mktemp("matrix-dict") / "shards"
    splits = {"train": edge_rectangles(1), "val": edge_rectangles(2, n=9)}
    return write_field_shards(root, splits, per_shard=5)


def _dict_module(root: Path, backend: str, module: str, **options) -> ShardDataModule:
    from fastdata import DetectionDataModule, SegmentationDataModule

    kind, _, preset = module.partition("-")
    options |= dict(backend=backend, workers=WorkerSettings(num_workers=0), seed=5, drop_last=False)
    if kind == "detection":
        return DetectionDataModule(root, train_transforms=preset or None, **options)
    return SegmentationDataModule(root, train_transforms=preset, **options)


def _dict_run(root: Path, backend: str, module: str, image_size: int, world: int, batch: int):
    """Per rank, the prepared batches of two training epochs and the val split, field by field
    (images back on the 0..255 scale); or the error refusing the combination."""
    out = []
    for rank in range(world):
        try:
            dm = _dict_module(
                root, backend, module, image_size=image_size, batch_size=batch, rank=rank,
                world_size=world,
            )  # fmt: skip
            dm.setup("fit")
            loaders = [dm.train_dataloader(), dm.train_dataloader(), dm.val_dataloader()]
        except ValueError as exc:
            return str(exc)
        mean = torch.tensor(dm.transforms.mean).view(1, 3, 1, 1)
        std = torch.tensor(dm.transforms.std).view(1, 3, 1, 1)
        for loader in loaders:
            for b in dm.prepared(loader, CPU):
                assert b["image"].shape == (len(b["padded"]), 3, image_size, image_size)
                out.append({**b, "image": b["image"] * std + mean})
    return out


def _same_batch(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    keys = [m["key"] for m in a["meta"]]
    for name in a:
        x, y = a[name], b[name]
        if name == "image":
            diff = (x - y).abs().amax().item() if x.numel() else 0.0
            assert x.shape == y.shape and diff <= GREY_TOLERANCE + 1e-3, (where, keys, diff)
        elif name == "boxes":
            for i, (bx, by) in enumerate(zip(x, y, strict=True)):
                assert bx.shape == by.shape, (where, keys[i], bx.tolist(), by.tolist())
                assert torch.allclose(bx, by, atol=BOX_TOLERANCE, rtol=0), (where, keys[i])
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), (where, name, keys)
        elif isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), (where, name, keys)
        else:
            assert x == y, (where, name)


def dict_combos() -> list[tuple]:
    """Every pair of values of any two axes in CI; the whole product with
    FASTDATA_FULL_MATRIX=1."""
    if os.environ.get("FASTDATA_FULL_MATRIX") == "1":
        return list(itertools.product(*DICT_AXES.values()))
    return pairwise(DICT_AXES)


@pytest.mark.parametrize(("module", "image_size", "world", "batch"), dict_combos())
def test_dict_contract(dict_dataset, module, image_size, world, batch):
    from fastdata.read import field_backends

    outcomes = {b: _dict_run(dict_dataset, b, module, image_size, world, batch) for b in LOCAL}
    carriers = [b for b in LOCAL if b in field_backends()]
    assert {"cpu", "memory"} <= set(carriers)
    for backend, outcome in outcomes.items():
        if backend not in carriers:
            assert isinstance(outcome, str) and "carry every field" in outcome, outcome
        else:
            assert not isinstance(outcome, str), (backend, outcome)
    reference = outcomes["cpu"]
    boxes = sum(len(bx) for batch_ in reference for bx in batch_["boxes"])
    assert boxes > 0 and any(batch_["padded"].any() for batch_ in reference) == (world == 2)
    for backend in carriers:
        assert len(outcomes[backend]) == len(reference), backend
        for i, (a, b) in enumerate(zip(reference, outcomes[backend], strict=True)):
            _same_batch(a, b, f"{backend} batch {i} vs cpu")
