"""Batch keys (`keys=True`, `fastdata.read.source_ids`): every batch of every split says which
samples it holds (sample key and the source's own id; None for evaluation padding), the same on
every backend, across ranks, Lightning's transfer and a resume; the manifest records COCO's
category ids; datasets without source ids keep their manifest bytes."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from fastdata import (
    CacheSettings,
    DetectionDataModule,
    SegmentationDataModule,
    ShardDataModule,
    WorkerSettings,
)
from fastdata.format.manifest_io import load_manifest, manifest_from_dict
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.backends.nvjpeg import NvjpegLoader
from fastdata.read.base import LoaderSpec
from fastdata.read.plan import PAD_LABEL
from fastdata.read.source_ids import SourceIdError, load_source_ids
from fastdata.write.sources.coco import CocoSource
from fastdata.write.sources.folder import FolderSource
from fastdata.write.sources.segmentation import SegmentationSource
from fastdata.write.writer import ShardOptions, write_shards
from tests.conftest import write_jpeg_folder
from tests.write.sources.family_data import write_coco, write_segmentation

OPTIONS = ShardOptions(max_count=4, workers=1, progress=False)


@pytest.fixture
def folder_shards(tmp_path: Path) -> Path:
    """A folder dataset: 3 classes, 15 train and 9 val images, shards of 4."""
    write_jpeg_folder(tmp_path / "images" / "train", per_class=5)
    write_jpeg_folder(tmp_path / "images" / "val", per_class=3)
    out = tmp_path / "shards"
    write_shards(FolderSource(tmp_path / "images"), out, OPTIONS)
    return out


def _val_rows(root: Path, backend: str, world: int, **kw) -> list[tuple[str | None, object, int]]:
    """(key, source id, label) of every val row on every rank, in rank then batch order."""
    rows = []
    for rank in range(world):
        dm = ShardDataModule(
            root, batch_size=4, backend=backend, image_size=32, keys=True, rank=rank,
            world_size=world, **{"workers": WorkerSettings(num_workers=0), **kw},
        )  # fmt: skip
        dm.setup()
        for images, labels, ids in dm.val_dataloader():
            assert len(ids["key"]) == len(ids["source_id"]) == len(labels) == len(images)
            rows += zip(ids["key"], ids["source_id"], labels.tolist(), strict=True)
    return rows


@pytest.mark.parametrize("backend,workers", [("cpu", 0), ("cpu", 2), ("memory", 0)])
def test_classification_batches_name_their_samples_once_across_ranks(
    folder_shards, backend, workers
):
    rows = _val_rows(folder_shards, backend, world=2, workers=WorkerSettings(num_workers=workers))
    real = [r for r in rows if r[0] is not None]
    padding = [r for r in rows if r[0] is None]
    # 9 samples on 2 ranks: 5 rows each, one of them a padding repeat.
    assert len(rows) == 10 and len(padding) == 1
    assert all(sid is None and label == PAD_LABEL for _, sid, label in padding)
    assert sorted(k for k, _, _ in real) == [f"val_{i:08d}" for i in range(9)]
    for key, source_id, label in real:  # the source path: val/class<label>/img<i>.<ext>
        assert source_id.startswith(f"val/class{label}/img"), (key, source_id, label)
    assert len({sid for _, sid, _ in real}) == 9


def test_every_backend_gives_the_same_keys_for_the_same_plan(folder_shards):
    cpu = _val_rows(folder_shards, "cpu", world=2)
    assert _val_rows(folder_shards, "memory", world=2) == cpu
    assert _val_rows(folder_shards, "cpu", world=2, workers=WorkerSettings(num_workers=2)) == cpu


def test_nvjpeg_loader_hands_over_the_cpu_loaders_keys(folder_shards):
    from tests.read.backends.test_nvjpeg import FakeDecoder

    spec = LoaderSpec(
        manifest=load_manifest(folder_shards), split="val", train=False, batch_size=4,
        preset="photo", image_size=32, world_size=2, rank=1, keys=True,
    )  # fmt: skip
    nv = [batch[2] for batch in NvjpegLoader(spec, decoder=FakeDecoder())]
    assert nv == [batch[2] for batch in make_cpu_loader(spec)]
    assert None in nv[-1] and all(k is None or k.startswith("val_") for b in nv for k in b)


def test_keys_survive_transfer_and_the_device_transforms(folder_shards):
    dm = ShardDataModule(
        folder_shards, batch_size=4, image_size=32, keys=True, workers=WorkerSettings(num_workers=0)
    )
    dm.setup()
    loader = dm.val_dataloader()
    raw = [batch[2] for batch in loader]
    finished = list(dm.prepared(loader, "cpu"))
    assert [b[2] for b in finished] == raw
    assert all(b[0].dtype == torch.float32 and b[0].shape[1:] == (3, 32, 32) for b in finished)


def test_without_keys_batches_stay_pairs(folder_shards):
    dm = ShardDataModule(
        folder_shards, batch_size=4, image_size=32, workers=WorkerSettings(num_workers=0)
    )
    dm.setup()
    assert all(len(batch) == 2 for batch in dm.val_dataloader())


def test_training_keys_continue_after_a_resume(folder_shards):
    def module() -> ShardDataModule:
        return ShardDataModule(
            folder_shards,
            batch_size=4,
            image_size=32,
            keys=True,
            drop_last=False,
            seed=5,
            workers=WorkerSettings(num_workers=0),
        )

    whole = module()
    whole.setup()
    keys = [b[2]["key"] for b in whole.prepared(whole.train_dataloader(), "cpu")]
    assert sorted(k for b in keys for k in b) == [f"train_{i:08d}" for i in range(15)]
    first = module()
    first.setup()
    batches = first.prepared(first.train_dataloader(), "cpu")
    taken = [next(batches)[2]["key"] for _ in range(2)]
    state = first.state_dict()
    resumed = module()
    resumed.load_state_dict(state)
    resumed.setup()
    rest = [b[2]["key"] for b in resumed.prepared(resumed.train_dataloader(), "cpu")]
    assert taken + rest == keys


@pytest.fixture
def coco_shards(tmp_path: Path) -> Path:
    images, ann = write_coco(tmp_path / "coco")
    out = tmp_path / "coco-shards"
    write_shards(CocoSource(images, ann, split="val"), out, OPTIONS)
    return out


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_detection_batches_carry_coco_image_ids(coco_shards, backend):
    manifest = load_manifest(coco_shards)
    assert manifest.classes == ["cat", "dog"] and manifest.class_ids == [4, 20]
    rows = []
    for rank in range(2):
        dm = DetectionDataModule(
            coco_shards,
            batch_size=3,
            backend=backend,
            image_size=32,
            keys=True,
            rank=rank,
            world_size=2,
            workers=WorkerSettings(num_workers=0),
        )
        dm.setup("validate")
        for batch in dm.val_dataloader():
            assert batch["padded"].tolist() == [k is None for k in batch["key"]]
            rows += zip(batch["key"], batch["source_id"], batch["box_labels"], strict=True)
    real = {sid: labels.tolist() for key, sid, labels in rows if key is not None}
    # The classes of each image's boxes, as category ids: COCO's own annotations.
    by_image = {i: sorted(manifest.class_ids[c] for c in labels) for i, labels in real.items()}
    assert by_image == {3: [4], 5: [], 7: [20], 9: [20]}


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_segmentation_batches_carry_the_image_paths(tmp_path, backend):
    images, masks = write_segmentation(tmp_path / "seg", count=5, splits=("val",))
    out = tmp_path / "seg-shards"
    write_shards(SegmentationSource(images, masks), out, OPTIONS)
    dm = SegmentationDataModule(
        out,
        batch_size=2,
        backend=backend,
        image_size=32,
        keys=True,
        workers=WorkerSettings(num_workers=0),
    )
    dm.setup("validate")
    ids = [
        sid
        for b in dm.val_dataloader()
        for k, sid in zip(b["key"], b["source_id"], strict=True)
        if k
    ]
    # The image's path relative to the images folder: a prediction maps back to its file.
    assert sorted(ids) == [f"val/a{i:02d}.png" for i in range(5)]


def test_manifest_without_source_ids_keeps_its_bytes(tiny_shards):
    text = (tiny_shards / "manifest.json").read_text()
    assert "source_ids" not in text and "class_ids" not in text  # CIFAR-like: no own ids
    assert load_manifest(tiny_shards).to_json() == text
    assert load_source_ids(load_manifest(tiny_shards), "train").ids == {}


def test_classification_shards_hold_no_new_components(folder_shards):
    manifest = load_manifest(folder_shards)
    for shard in manifest.split("val").shards:
        with tarfile.open(folder_shards / shard.name) as tar:
            exts = {m.name.split(".", 1)[1] for m in tar.getmembers()}
        assert exts <= {"jpg", "png", "cls", "lid"}
    assert manifest.split("val").source_ids == "val-source-ids.json"


def test_an_altered_source_id_file_is_refused_by_name(folder_shards):
    path = folder_shards / "val-source-ids.json"
    data = json.loads(path.read_text())
    data["ids"]["val_00000000"] = "val/class2/elsewhere.jpg"
    path.write_text(json.dumps(data))
    dm = ShardDataModule(
        folder_shards, batch_size=4, image_size=32, keys=True, workers=WorkerSettings(num_workers=0)
    )
    dm.setup()
    with pytest.raises(SourceIdError, match=r"val-source-ids\.json.*sha256"):
        next(iter(dm.val_dataloader()))


def test_a_manifest_naming_a_file_outside_the_dataset_is_refused(folder_shards):
    data = json.loads((folder_shards / "manifest.json").read_text())
    data["splits"]["val"]["source_ids"] = "../elsewhere.json"
    with pytest.raises(ValueError, match="source_ids"):
        manifest_from_dict(data, str(folder_shards))


def test_a_field_named_key_is_refused_with_keys(tmp_path):
    from tests.lightning.family.conftest import rectangles, write_field_shards

    root = write_field_shards(tmp_path / "f", {"val": rectangles(5, 1)})
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    fields = data["splits"]["val"]["fields"]
    fields["key"] = fields.pop("caption")  # a dataset whose own field is named "key"
    path.write_text(json.dumps(data))
    dm = ShardDataModule(
        root,
        batch_size=4,
        image_size=16,
        keys=True,
        backend="cpu",
        workers=WorkerSettings(num_workers=0),
    )
    dm.setup("validate")
    with pytest.raises(ValueError, match=r"field\(s\) \['key'\].*keys=False"):
        next(iter(dm.val_dataloader()))


def test_list_and_coco_sources_give_their_own_ids(tmp_path):
    from fastdata.write.sources import open_source

    lst = tmp_path / "lists" / "labels.csv"
    lst.parent.mkdir()
    lst.write_text("path,label,split\nimg/1.jpg,dog,\n/abs/3.png,cat,val\n")
    src = open_source("list", lst)
    assert src.item("train", 0).source_id == "img/1.jpg"  # as listed, relative to the root
    assert src.item("val", 0).source_id == "/abs/3.png"
    images, ann = write_coco(tmp_path / "coco")
    coco = CocoSource(images, ann, split="val")
    assert [coco.item("val", i).source_id for i in range(4)] == [3, 5, 7, 9]  # image-id order
    assert coco.class_ids == [4, 20]  # category ids behind classes ["cat", "dog"]


def test_indexed_foreign_shards_carry_their_keys_only(tmp_path):
    import webdataset as wds

    from fastdata.write.index import index_shards
    from tests.write.index.conftest import solid_jpeg

    out = tmp_path / "wds"
    out.mkdir()
    with wds.ShardWriter(str(out / "val-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(5):
            sink.write({"__key__": f"part.v1/s{i:05d}", "jpg": solid_jpeg(i), "cls": str(i % 2)})
    manifest = index_shards(out)
    assert manifest.split("val").source_ids is None
    dm = ShardDataModule(
        out,
        batch_size=4,
        image_size=16,
        keys=True,
        backend="cpu",
        splits={"val": "val"},
        workers=WorkerSettings(num_workers=0),
    )
    dm.setup("validate")
    ids = [batch[2] for batch in dm.val_dataloader()]
    assert sorted(k for b in ids for k in b["key"]) == [f"part.v1/s{i:05d}" for i in range(5)]
    assert all(s is None for b in ids for s in b["source_id"])


def test_source_ids_of_a_remote_dataset_come_over_http(folder_shards):
    from tests.remote.servers import FileServer

    server = FileServer(folder_shards)
    try:
        local = _val_rows(folder_shards, "cpu", world=1)
        cache = CacheSettings(dir=str(folder_shards.parent / "c"))
        remote = _val_rows(server.url, "cpu", world=1, cache=cache)
    finally:
        server.stop()
    assert remote == local and all(sid is not None for _, sid, _ in remote)


def _loader_keys(loader) -> list[list[str | None]]:
    return [list(batch[2]) for batch in loader]


@pytest.mark.parametrize("backend", ["memory", pytest.param("dali", marks=pytest.mark.dali)])
def test_backends_hand_over_the_cpu_backends_keys_at_every_rank_and_resume(tiny_shards, backend):
    if backend == "dali":
        from fastdata.read.backends.dali import make_dali_loader as make
    else:
        from fastdata.read.backends.memory import make_memory_loader as make
    manifest = load_manifest(tiny_shards)
    for train, split in ((False, "test"), (True, "train")):
        for rank in range(3):  # 50 test samples on 3 ranks of 8: padding repeats
            spec = LoaderSpec(
                manifest=manifest, split=split, train=train, batch_size=8, seed=5, keys=True,
                rank=rank, world_size=3, preset="none",
            )  # fmt: skip
            cpu = _loader_keys(make_cpu_loader(spec))
            assert _loader_keys(make(spec)) == cpu, (backend, split, rank)
            if not train:
                continue
            resumed = make(spec)
            resumed.set_epoch(0, consumed=2 * 8 * 3, steps_before=2)
            assert _loader_keys(resumed) == cpu[2:]
    pads = []
    for rank in range(3):
        spec = LoaderSpec(
            manifest=manifest, split="test", train=False, batch_size=8, keys=True, rank=rank,
            world_size=3, preset="none",
        )  # fmt: skip
        pads += [k for batch in _loader_keys(make_cpu_loader(spec)) for k in batch]
    assert sorted(k for k in pads if k) == [f"test_{i:08d}" for i in range(50)]
    assert pads.count(None) == 1  # 50 on 3 ranks: 17 each, one repeat


def test_a_trainer_hands_the_keys_to_validation_step(folder_shards):
    import lightning.pytorch as pl

    class Record(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[tuple[str, str]] = []

        def validation_step(self, batch, batch_idx) -> None:
            images, labels, ids = batch  # transferred and normalized, the ids as they were
            assert images.dtype == torch.float32 and len(ids["key"]) == len(labels)
            self.seen += zip(ids["key"], ids["source_id"], strict=True)

    dm = ShardDataModule(
        folder_shards, batch_size=4, image_size=32, keys=True, workers=WorkerSettings(num_workers=0)
    )
    model = Record()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.validate(model, datamodule=dm, verbose=False)
    assert sorted(k for k, _ in model.seen) == [f"val_{i:08d}" for i in range(9)]
    assert all(sid.startswith("val/class") for _, sid in model.seen)


def test_a_skipped_sample_takes_its_key_with_it(folder_shards):
    """on_error='skip': the keys stay aligned with the images that remain (decode failures are
    found after the batch is read, so the keys follow the decoder's survivors)."""
    manifest = load_manifest(folder_shards)
    shard = manifest.split("val").shards[0]
    path = Path(manifest.shard_url(shard))
    data = bytearray(path.read_bytes())
    first_jpg = data.find(b"\xff\xd8\xff")
    data[first_jpg : first_jpg + 64] = b"\x00" * 64  # wreck the first JPEG's header
    path.write_bytes(bytes(data))
    spec = LoaderSpec(
        manifest=manifest, split="val", train=False, batch_size=4, preset="photo", image_size=32,
        on_error="skip", keys=True,
    )  # fmt: skip
    loader = make_cpu_loader(spec)
    batches = list(loader)
    with tarfile.open(path) as tar:
        broken = next(m.name for m in tar.getmembers() if m.name.endswith(".jpg"))
    broken_key = broken.split(".", 1)[0]
    keys = [k for _, _, ks in batches for k in ks]
    assert loader.skipped == 1 and broken_key not in keys and len(keys) == 8
    for images, labels, ks in batches:
        assert len(images) == len(labels) == len(ks)
        for label, key in zip(labels.tolist(), ks, strict=True):
            assert f"/class{label}/" in "/" + load_source_ids(manifest, "val").ids[key]


def test_parts_merged_write_the_single_runs_source_ids_and_class_ids(tmp_path):
    from fastdata.write.parts import Part, merge_parts, write_part

    images, ann = write_coco(tmp_path / "coco")
    source = CocoSource(images, ann, split="val")
    options = ShardOptions(max_count=1, workers=1, progress=False)  # 4 shards: 2 per part
    write_shards(source, tmp_path / "single", options)
    for index in (1, 0):
        write_part(source, tmp_path / "parts", options, Part(index, 2))
    merge_parts(tmp_path / "parts")
    for name in ("manifest.json", "val-source-ids.json"):
        single = (tmp_path / "single" / name).read_text()
        assert (tmp_path / "parts" / name).read_text() == single, name
    assert load_manifest(tmp_path / "parts").class_ids == [4, 20]
