"""The DALI backend (CPU operators, device_id=None): fed the epoch plan, presets as DALI graphs.

Label order against the other backends and the refusal of user callables are tested in
tests/read/test_contract.py; these test DALI's own graphs, resume and errors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nvidia.dali")

from fastdata.augment import crop_with_padding, flip_horizontal  # noqa: E402
from fastdata.format.manifest_io import load_manifest  # noqa: E402
from fastdata.format.schema import label_and_id  # noqa: E402
from fastdata.read.backends.dali import make_dali_loader  # noqa: E402
from fastdata.read.base import LoaderSpec  # noqa: E402
from fastdata.read.plan import PAD_LABEL  # noqa: E402
from fastdata.read.shardio import ShardReader  # noqa: E402
from tests.conftest import unique_label_source  # noqa: E402

pytestmark = pytest.mark.dali


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


def _pad_crop_flip_candidates(pixels: torch.Tensor) -> torch.Tensor:
    """All 81 x 2 outcomes of the cifar train crop and flip for one uint8 CHW image."""
    n = 9 * 9 * 2
    offsets = torch.tensor([[dy, dx] for dy in range(9) for dx in range(9)] * 2)
    flips = torch.arange(n) >= n // 2
    batch = pixels[None].expand(n, *pixels.shape)
    return flip_horizontal(crop_with_padding(batch, 4, offsets), flips)


def test_cifar_train_is_a_padded_crop_and_flip_of_the_source(tiny_shards):
    source = unique_label_source()
    outcomes = set()
    loader = make_dali_loader(_spec(tiny_shards, preset="cifar"))
    assert (loader.normalized, loader.applied_ops) == (False, 1)  # the PadCrop, in the graph
    for images, labels in loader:
        assert images.dtype == torch.uint8
        for image, label in zip(images, labels.tolist(), strict=True):
            pixels = torch.from_numpy(source.item("train", label).pixels).permute(2, 0, 1)
            candidates = _pad_crop_flip_candidates(pixels).int()
            error = (candidates - image.int()).abs().flatten(1).amax(dim=1)
            assert error.min() == 0, f"sample {label} is no padded crop / flip of its source"
            outcomes.add(int(error.argmin()))
    assert len(outcomes) > 50  # random offsets and flips (of 162), not one fixed choice


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
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
