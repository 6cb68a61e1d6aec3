"""TensorPool: reuses a CPU buffer only when nothing else holds it."""

from __future__ import annotations

import pytest
import torch

from fastdata._util import pool as _pool
from fastdata._util.pool import TensorPool
from fastdata.augment import get_preset

CPU = torch.device("cpu")
needs_count = pytest.mark.skipif(_pool._ALONE is None, reason="this torch has no storage use count")


@needs_count
def test_released_buffers_are_reused_held_ones_never():
    pool = TensorPool(size=2)
    first = pool.empty((4, 5), torch.float32, CPU)
    address = first.data_ptr()
    del first
    again = pool.empty((4, 5), torch.float32, CPU)
    assert again.data_ptr() == address, "a released buffer is reused"
    view = again[1:]  # a view still holds the storage
    del again
    other = pool.empty((4, 5), torch.float32, CPU)
    assert other.data_ptr() != address
    array = other.numpy()  # so does a numpy array
    kept = other.data_ptr()
    del other
    assert pool.empty((4, 5), torch.float32, CPU).data_ptr() not in (address, kept)
    del view, array
    weight = torch.ones(5, requires_grad=True)
    saved = pool.empty((4, 5), torch.float32, CPU).fill_(1)
    loss = (saved * weight).sum()  # autograd saves `saved` for the backward pass
    saved_at = saved.data_ptr()
    del saved
    assert pool.empty((4, 5), torch.float32, CPU).data_ptr() != saved_at
    loss.backward()


@needs_count
def test_shape_dtype_and_format_must_match_and_the_pool_is_bounded():
    pool = TensorPool(size=1)
    a = pool.empty((2, 3, 4, 4), torch.float32, CPU, torch.channels_last)
    assert a.is_contiguous(memory_format=torch.channels_last)
    address = a.data_ptr()
    del a
    b = pool.empty((2, 3, 4, 4), torch.float32, CPU)
    assert b.is_contiguous() and b.data_ptr() != address  # other format: a new buffer
    assert pool.empty((2, 3, 4, 4), torch.float64, CPU).dtype == torch.float64
    assert len(pool._buffers) == 1


def test_presets_give_the_same_result_with_a_pool():
    x = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    preset, pool = get_preset("cifar"), TensorPool()
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    first = preset.apply(x, True, g1, pool)
    second = preset.apply(x, True, g1, pool)  # `first` is held: must not be overwritten
    assert torch.equal(first, preset.apply(x, True, g2))
    assert torch.equal(second, preset.apply(x, True, g2))
    assert first.data_ptr() != second.data_ptr()
    with pytest.raises(ValueError, match="size"):
        TensorPool(size=-1)


def test_inference_mode_neither_takes_nor_leaves_buffers():
    """A custom evaluation loop under `torch.inference_mode()`: its outputs are fresh tensors,
    so no inference tensor stays in the pool to come back as a training batch (whose backward
    would fail: "Inference tensors cannot be saved for backward")."""
    pool = TensorPool(size=2)
    with torch.inference_mode():
        held = pool.empty((2, 3), torch.float32, torch.device("cpu"))
    assert held.is_inference() and not pool._buffers
    del held
    train = pool.empty((2, 3), torch.float32, torch.device("cpu"))
    assert not train.is_inference()
    weight = torch.ones(3, requires_grad=True)
    (train.fill_(1.0) * weight).sum().backward()  # saved for backward: a normal tensor
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
