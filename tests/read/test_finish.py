"""`fastdata.read.finish.finish_sample`: a dict batch's device-side augmentation."""

from __future__ import annotations

import torch

from fastdata.augment import get_preset
from fastdata.format.fields import FieldSpec
from fastdata.read.finish import finish_sample

FIELDS = {
    "mask": FieldSpec("mask", "mask", ("mask.png",)),
    "boxes": FieldSpec("boxes", "boxes", ("boxes.npy",)),
}


def _batch(n: int = 2, h: int = 24, w: int = 32) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "image": torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8),
        "mask": torch.randint(0, 5, (n, h, w), generator=g, dtype=torch.uint8),
        "boxes": [torch.tensor([[0.0, 0.0, w, h]]) for _ in range(n)],
        "box_labels": [torch.tensor([1]) for _ in range(n)],
    }


def test_a_batch_whose_loader_applied_every_op_passes_through():
    preset = get_preset("photo", image_size=16)
    batch = _batch(h=16, w=16)
    out = finish_sample(batch, FIELDS, preset, True, 7, applied=len(preset.ops(True)))
    assert out is not batch and out["image"] is batch["image"] and out["mask"] is batch["mask"]


def test_a_batch_left_unwarped_moves_image_mask_and_boxes_together():
    preset = get_preset("photo", image_size=16)
    batch = _batch()
    first = finish_sample(batch, FIELDS, preset, False, 7, applied=0)
    again = finish_sample(batch, FIELDS, preset, False, 7, applied=0)
    assert first["image"].shape == (2, 3, 16, 16) and first["mask"].shape == (2, 16, 16)
    assert torch.equal(first["image"], again["image"]) and torch.equal(first["mask"], again["mask"])
    # The whole-image box follows the eval crop: it is clipped to the 16 x 16 output.
    assert [b.tolist() for b in first["boxes"]] == [[[0.0, 0.0, 16.0, 16.0]]] * 2
    assert [lab.tolist() for lab in first["box_labels"]] == [[1], [1]]
