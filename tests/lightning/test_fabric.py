"""Lightning Fabric: `setup_dataloaders` takes `loader.as_dataloader()`; epochs advance."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from fastdata import ShardDataModule, WorkerSettings


def test_fabric_setup_dataloaders_takes_the_loader_and_epochs_advance(tiny_shards):
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    dm = ShardDataModule(
        tiny_shards, batch_size=32, backend="cpu", workers=WorkerSettings(num_workers=0)
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    as_torch = loader.as_dataloader()
    assert isinstance(as_torch, DataLoader) and len(as_torch) == len(loader) == 9
    train = fabric.setup_dataloaders(as_torch)
    assert len(train) == 9 and len(train.dataset) == 9

    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, dm.num_classes))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    epochs: list[list[int]] = []
    for _ in range(2):
        epochs.append([])
        for batch in train:
            x, y = dm.on_after_batch_transfer(batch, 0)  # the device augmentation + normalization
            assert x.dtype == torch.float32 and x.shape == (32, 3, 8, 8)
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            epochs[-1].extend(y.tolist())
    assert [len(set(e)) for e in epochs] == [9 * 32, 9 * 32]  # two whole epochs, no repeat
    assert epochs[0] != epochs[1]  # the second is epoch 1's shuffle, not epoch 0 again
    assert dm.state_dict()["epoch"] == 1 and dm.state_dict()["steps"] == 9
