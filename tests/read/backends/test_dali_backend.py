"""The DALI backend (CPU operators, device_id=None): one pipeline fed the epoch plan and the cpu
backend's crop windows.

Label order and pixels against the other backends are also tested in
tests/read/test_contract_matrix.py; these test DALI's crops on photos, the pipeline built once,
resume, the decoder's settings and errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali")

from fastdata import ShardDataModule, WorkerSettings  # noqa: E402
from fastdata.format.manifest_io import load_manifest  # noqa: E402
from fastdata.format.schema import label_and_id  # noqa: E402
from fastdata.read.backends.dali import make_dali_loader  # noqa: E402
from fastdata.read.backends.dali.loader import _device_id  # noqa: E402
from fastdata.read.backends.dali.pipeline import HW_DECODER_LOAD  # noqa: E402
from fastdata.read.base import LoaderSpec  # noqa: E402
from fastdata.read.plan import PAD_LABEL  # noqa: E402
from fastdata.read.shardio import ShardReader  # noqa: E402
from tests.read.test_contract_matrix import GREY_TOLERANCE  # noqa: E402

pytestmark = pytest.mark.dali
CPU = torch.device("cpu")


def _spec(root, **kw) -> LoaderSpec:
    base = dict(manifest=load_manifest(root), split="train", train=True, batch_size=32, seed=5)
    base.update(kw)
    return LoaderSpec(**base)


def test_eval_batches_equal_the_preset_on_the_raw_pixels(tiny_shards):
    spec = _spec(tiny_shards, split="test", train=False, preset="cifar")
    loader = make_dali_loader(spec)
    reader = ShardReader(spec.manifest, "test")
    x, y = next(iter(loader))
    raw = torch.stack(
        [
            torch.frombuffer(bytearray(reader.sample(0, i)["rgb"]), dtype=torch.uint8)
            .view(8, 8, 3)
            .permute(2, 0, 1)
            for i in range(len(y))
        ]
    )
    expected = [label_and_id(reader.key(0, i), reader.sample(0, i))[0] for i in range(len(y))]
    assert y.tolist() == expected  # eval: row order
    # uint8, like every backend's batches: cifar's eval ops are none, so the pixels themselves.
    assert (loader.normalized, loader.applied_ops, x.dtype) == (False, 0, torch.uint8)
    assert torch.equal(x, raw)


def test_train_batches_are_augmented_with_the_plan_and_resume(tiny_shards):
    spec = _spec(tiny_shards, preset="cifar", drop_last=True)
    loader = make_dali_loader(spec)
    batches = [y.tolist() for _, y in loader]
    assert len(batches) == len(loader) == 9  # 300 // 32
    loader.set_epoch(0, consumed=4 * 32, steps_before=4)
    assert [y.tolist() for _, y in loader] == batches[4:] and len(loader) == 9


def test_eval_padding_is_marked(tiny_shards):
    spec = _spec(tiny_shards, split="test", train=False, rank=2, world_size=3, batch_size=8)
    labels = [v for _, y in make_dali_loader(spec) for v in y.tolist()]
    assert labels.count(PAD_LABEL) == 1  # 50 samples on 3 ranks


def test_on_error_skip_is_refused(tiny_shards):
    with pytest.raises(ValueError, match="cannot skip"):
        make_dali_loader(_spec(tiny_shards, on_error="skip"))


# ---------------------------------------------------------------------------- restored checks
# (from the pre-issue-9 file, adapted: DALI is now fed the plan, so it matches the cpu backend
# batch for batch, padding included)


def _labels(loader) -> list[list[int]]:
    return [y.tolist() for _, y in loader]


@pytest.mark.parametrize(
    ("world_size", "batch_size", "drop_last"),
    [(2, 32, False), (2, 32, True), (3, 32, False), (4, 7, False), (3, 7, True)],
)
def test_every_rank_gets_the_cpu_backends_batches_and_the_split_is_covered(
    tiny_shards, world_size, batch_size, drop_last
):
    from fastdata.read.backends.cpu import make_cpu_loader

    seen: list[int] = []
    lengths = set()
    for rank in range(world_size):
        spec = _spec(
            tiny_shards,
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            drop_last=drop_last,
            preset="none",
        )
        dali, cpu = make_dali_loader(spec), make_cpu_loader(spec)
        batches = _labels(dali)
        assert batches == _labels(cpu) and len(batches) == len(dali) == len(cpu), f"rank {rank}"
        lengths.add(len(batches))
        seen += [v for batch in batches for v in batch]
    assert len(lengths) == 1, "every rank must take the same number of batches"
    if drop_last:
        assert (
            len(seen)
            == len(set(seen))
            == 300 // (world_size * batch_size) * world_size * batch_size
        )
    else:  # the whole split, plus fewer than world_size padding repeats
        assert set(seen) == set(range(300)) and len(seen) - 300 < world_size


def test_new_order_each_epoch_same_order_for_the_same_epoch(tiny_shards):
    loader = make_dali_loader(_spec(tiny_shards, preset="none"))
    first = _labels(loader)
    assert _labels(loader) == first  # no set_epoch: the same epoch again
    loader.set_epoch(1)
    second = _labels(loader)
    assert second != first and sorted(sum(second, [])) == sorted(sum(first, [])) == list(range(300))


def _photos(root: Path, n: int = 24, png_every: int = 3) -> Path:
    """JPEG (and every `png_every`-th a PNG) photos of 40..60 px a side, labels == ids, as shards:
    below twice the 32 px output, so the cpu backend decodes them at full resolution (no DCT
    scaling), the pixels DALI decodes."""
    import csv

    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources.listfile import ListSource

    rng = np.random.default_rng(7)
    root.mkdir(parents=True)
    with open(root / "list.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["path", "label", "split"])
        for i in range(n):
            h, w = (int(v) for v in rng.integers(40, 61, 2))
            yy, xx = np.mgrid[0:h, 0:w]
            smooth = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 4 % 256], -1)
            pixels = (smooth + rng.integers(-25, 26, smooth.shape)).clip(0, 255).astype(np.uint8)
            name = f"img{i}.{'png' if i % png_every == 0 else 'jpg'}"
            Image.fromarray(pixels).save(root / name)
            rows.writerow([name, i, "train" if i < n - 8 else "val"])
    options = ShardOptions(workers=1, progress=False, max_count=6, encoding="keep")
    write_shards(ListSource(root / "list.csv"), root / "shards", options)
    return root / "shards"


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return _photos(tmp_path_factory.mktemp("dali-photos") / "files")


@pytest.mark.parametrize(
    ("preset", "split", "image_size"),
    [("photo", "train", 32), ("photo", "val", 32), ("none", "train", 32), ("photo", "train", 80)],
)
def test_dali_decodes_the_cpu_backends_crops(photos, preset, split, image_size):
    # rrc + flip (train), centre crop (val), cover (none), and an upscale: DALI decodes the windows
    # the cpu backend draws, with Pillow's filter, to within a grey level of its pixels.
    from fastdata.read.backends.cpu import make_cpu_loader

    spec = _spec(
        photos, split=split, train=split == "train", preset=preset, image_size=image_size,
        batch_size=5,
    )  # fmt: skip
    dali, cpu = make_dali_loader(spec), make_cpu_loader(spec)
    assert dali.applied_ops == cpu.applied_ops
    batches = 0
    for (x, y), (xc, yc) in zip(dali, cpu, strict=True):
        assert torch.equal(y, yc) and x.shape == xc.shape and x.dtype == torch.uint8
        diff = (x.int() - xc.int()).abs()
        assert diff.max() <= GREY_TOLERANCE, f"labels {y.tolist()}: {diff.amax(dim=(1, 2, 3))}"
        batches += 1
    assert batches == len(dali) > 0


def test_one_pipeline_for_the_loaders_life(photos, dali_pipelines):
    built = dali_pipelines
    loader = make_dali_loader(_spec(photos, preset="photo", image_size=32, batch_size=4))
    first = [x for x, _ in loader]
    next(iter(loader))  # a pass abandoned after one batch: the next one starts afresh
    assert all(torch.equal(a, b) for a, b in zip(first, (x for x, _ in loader), strict=True))
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        assert len([y for _, y in loader]) == len(first)
    assert len(built) == loader.builds == 1
    assert built[0]["prefetch_queue_depth"] >= 2


def test_decoder_hints_come_from_the_manifest(photos):
    loader = make_dali_loader(_spec(photos, preset="photo", image_size=32))
    stats = loader.spec.manifest.split("train").image_stats
    assert loader.decoder.preallocate_width_hint == stats["max_width"] > 0
    assert loader.decoder.preallocate_height_hint == stats["max_height"]
    assert loader.decoder.hw_decoder_load == HW_DECODER_LOAD and loader.device_id is None


def test_the_gpu_is_the_local_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _device_id("cuda") == 3 and _device_id("cuda:1") == 1
    monkeypatch.delenv("LOCAL_RANK")
    assert _device_id("cuda") == 0


def _module(root: Path) -> ShardDataModule:
    return ShardDataModule(
        root,
        backend="dali",
        batch_size=4,
        seed=3,
        image_size=32,
        train_transforms="photo",
        workers=WorkerSettings(num_workers=0),
    )


def test_a_mid_epoch_resume_is_exact(photos):
    full = _module(photos)
    full.setup("fit")
    epoch = [(x, y) for x, y in full.prepared(full.train_dataloader(), CPU)]
    partial = _module(photos)
    partial.setup("fit")
    for step, batch in enumerate(partial.train_dataloader(), start=1):
        partial.on_after_batch_transfer(partial.transfer_batch_to_device(batch, CPU, 0), 0)
        if step == 2:
            break
    resumed = _module(photos)
    resumed.load_state_dict(partial.state_dict())
    resumed.setup("fit")
    rest = list(resumed.prepared(resumed.train_dataloader(), CPU))
    assert len(rest) == len(epoch) - 2
    for (x, y), (xr, yr) in zip(epoch[2:], rest, strict=True):
        assert torch.equal(y, yr) and torch.equal(x, xr)


def test_cifar_pad_crop_runs_on_the_device_as_for_the_cpu_backend(tiny_shards):
    batches = {}
    for backend in ("cpu", "dali"):
        dm = ShardDataModule(
            tiny_shards, backend=backend, batch_size=32, seed=3, train_transforms="cifar",
            workers=WorkerSettings(num_workers=0),
        )  # fmt: skip
        dm.setup("fit")
        batches[backend] = list(dm.prepared(dm.train_dataloader(), CPU))
    assert len(batches["dali"]) == len(batches["cpu"]) == 9  # drop_last
    for (x, y), (xc, yc) in zip(batches["dali"], batches["cpu"], strict=True):
        assert torch.equal(y, yc) and torch.equal(x, xc)


@pytest.mark.realdata
@pytest.mark.parametrize("train", [True, False])
def test_photo_preset_on_real_jpegs(tmp_path, train):
    import shutil

    from fastdata_pipelines.env import data_dir

    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources.folder import FolderSource

    source_root = data_dir() / "clothing-small"
    if not source_root.is_dir():
        pytest.skip(f"real data not found at {source_root} (set FASTDATA_DATA_DIR)")
    root = tmp_path / "photos"
    for split in ("train", "test"):
        for cls in ("hat", "shoes"):
            (root / split / cls).mkdir(parents=True)
            for f in sorted((source_root / split / cls).glob("*.jpg"))[:3]:
                shutil.copy(f, root / split / cls / f.name)
    options = ShardOptions(max_count=5, workers=1, progress=False)
    manifest = write_shards(FolderSource(root), tmp_path / "shards", options)
    assert manifest.split("train").encoding == "jpeg"
    spec = _spec(tmp_path / "shards", train=train, preset="photo", image_size=64, batch_size=4)
    batches = list(make_dali_loader(spec))
    images = torch.cat([x for x, _ in batches])
    assert images.shape == (6, 3, 64, 64) and images.dtype == torch.uint8
    x = spec.preset.apply(images, train, skip=len(spec.preset.ops(train)))  # normalize only
    assert torch.isfinite(x).all()
    assert -3 < x.mean().item() < 3 and x.std().item() > 0.1  # ImageNet-normalized
    assert sorted(v for _, y in batches for v in y.tolist()) == [0, 0, 0, 1, 1, 1]


def test_a_missing_index_is_rebuilt_from_the_tar(tiny_shards):
    # DALI's own reader needed every .idx (the old test expected an error naming the shard);
    # fed by the plan through the shared ShardReader, it reads the tar as the cpu backend does.
    import os

    from fastdata.read.backends.cpu import make_cpu_loader

    manifest = load_manifest(tiny_shards)
    os.remove(manifest.index_url(manifest.split("train").shards[1]))
    spec = _spec(tiny_shards, preset="none")
    labels = _labels(make_dali_loader(spec))
    assert labels == _labels(make_cpu_loader(spec))
    assert sorted(sum(labels, [])) == list(range(300))


def test_fastdata_imports_without_dali(tiny_shards):
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent(
        f"""
        import sys
        import fastdata.read.backends.dali as dali
        assert "nvidia.dali" not in sys.modules, "importing the backend module imported DALI"
        sys.modules["nvidia.dali"] = None  # DALI now cannot be imported
        import fastdata
        from fastdata.format.manifest_io import load_manifest
        from fastdata.read import get_backend
        from fastdata.read.base import LoaderSpec
        ok, why = dali.dali_status()
        assert not ok and "pip install fastdata[dali]" in why, why
        assert get_backend("dali").check()[0] is False
        spec = LoaderSpec(load_manifest({str(tiny_shards)!r}), "train", True, 4)
        try:
            get_backend("dali").load()(spec)
        except ImportError as exc:
            assert "pip install fastdata[dali]" in str(exc), exc
        else:
            raise AssertionError("no ImportError without DALI")
        """
    )
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
