"""The DALI backend (CPU operators, device_id=None): fed the epoch plan, presets as DALI graphs.

Label order against the other backends and the refusal of user callables are tested in
tests/test_contract.py; these test DALI's own graphs, resume and errors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nvidia.dali")

from fastdata.augment import get_preset  # noqa: E402
from fastdata.manifest import load_manifest  # noqa: E402
from fastdata.read.base import LoaderSpec  # noqa: E402
from fastdata.read.dali import make_dali_loader  # noqa: E402
from fastdata.read.plan import PAD_LABEL  # noqa: E402
from fastdata.read.shardio import ShardReader  # noqa: E402
from fastdata.schema import label_and_id  # noqa: E402

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
    assert loader.normalized and y.tolist() == expected  # eval: row order
    assert torch.allclose(x, get_preset("cifar").apply(raw, train=False), atol=1e-4)


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
