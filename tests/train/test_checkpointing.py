"""Activation checkpointing: which blocks are wrapped, memory saved, same loss / gradients / stats."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastdata.train.checkpointing import (
    SavedTensorMeter,
    apply_activation_checkpointing,
    find_checkpoint_blocks,
)
from pipelines.cifar100.model import BasicBlock, ConvBlock, ModelConfig, build_model


class _Tokens(nn.Module):
    """4x4 patches -> (N, tokens, dim)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, 4, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


def _vit(dim: int = 64, depth: int = 4) -> nn.Module:
    layer = nn.TransformerEncoderLayer(
        dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True, norm_first=True
    )
    return nn.Sequential(
        _Tokens(dim),
        nn.TransformerEncoder(layer, depth, enable_nested_tensor=False),
        nn.LayerNorm(dim),
        nn.Flatten(1),
        nn.LazyLinear(10),
    )


def _run(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict, int]:
    model.zero_grad(set_to_none=True)
    meter = SavedTensorMeter(exclude=model.parameters())
    with meter.measure():
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, meter.bytes


MODELS = {
    "resnet9": lambda: build_model(ModelConfig("resnet9", width=8, num_classes=10)),
    "resnet18": lambda: build_model(ModelConfig("resnet18", width=8, num_classes=10)),
    "vit": _vit,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_saves_60_percent_of_activation_memory_with_same_loss_and_grads(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    model(x)  # materialize lazy layers before copying
    plain = copy.deepcopy(model)
    wrapped = apply_activation_checkpointing(model, True)
    assert wrapped, "no blocks were found"

    loss0, grads0, bytes0 = _run(plain, x, y)
    loss1, grads1, bytes1 = _run(model, x, y)

    assert bytes1 <= 0.4 * bytes0, f"saved {bytes1} B with checkpointing vs {bytes0} B without"
    torch.testing.assert_close(loss1, loss0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-5, msg=n)


def test_batchnorm_running_stats_update_once_per_step() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig("resnet9", width=4, num_classes=10))
    plain = copy.deepcopy(model)
    apply_activation_checkpointing(model, True)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for m in (plain, model):
        F.cross_entropy(m(x), y).backward()
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, msg=name)


def test_auto_detection_picks_outermost_repeated_blocks() -> None:
    r9 = build_model(ModelConfig("resnet9", width=4))
    assert find_checkpoint_blocks(r9) == [f"blocks.{i}" for i in range(4)]
    r18 = build_model(ModelConfig("resnet18", width=4))
    assert find_checkpoint_blocks(r18) == [f"blocks.{i}" for i in range(1, 9)]  # not the stem
    assert find_checkpoint_blocks(_vit(depth=3)) == [f"1.layers.{i}" for i in range(3)]
    assert find_checkpoint_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []


def test_policy_by_types_and_listed_blocks() -> None:
    r18 = build_model(ModelConfig("resnet18", width=4))
    assert find_checkpoint_blocks(r18, {ConvBlock}) == []
    assert len(find_checkpoint_blocks(r18, {BasicBlock})) == 8
    assert find_checkpoint_blocks(r18, False) == []

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    model.checkpoint_blocks = [model[0]]
    assert find_checkpoint_blocks(model) == ["0"]
    model.checkpoint_blocks = ["1"]
    assert find_checkpoint_blocks(model) == ["1"]
    model.checkpoint_blocks = ["nope"]
    with pytest.raises(ValueError, match="nope"):
        find_checkpoint_blocks(model)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        find_checkpoint_blocks(model, {int})


def test_wrapping_is_idempotent_and_keeps_state_dict_and_pickling() -> None:
    model = build_model(ModelConfig("resnet9", width=4, num_classes=10))
    keys = list(model.state_dict())
    apply_activation_checkpointing(model)
    apply_activation_checkpointing(model)
    assert list(model.state_dict()) == keys
    clone = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, 3, 32, 32)
    model.eval(), clone.eval()
    torch.testing.assert_close(clone(x), model(x))
