"""The CIFAR-100 networks (narrow ResNet-9 and ResNet-18) and their LightningModule.

ResNet-9 follows the DAWNBench / airbench family: conv-BN-ReLU blocks, each widening conv followed
at once by a 2x2 max pool (BN and ReLU then run on a quarter of the pixels), two residual blocks, a
max-pooled head with a scaled linear layer. With ``width=64, stem_pool=False, stem="conv"`` it is
the classic 64/128/256/512 ResNet-9. The default here pools after the stem too and is narrower
(24/48/96/192): on a 2-core CPU the first full-resolution convs would take most of an epoch; its
stem is airbench's frozen patch-whitening conv (`pipelines.cifar100.whitening`), fitted on the
first training batch. ResNet-18 is the usual CIFAR variant (3x3 stem, four stages of two basic
blocks).

Both keep their repeated blocks as children of one `nn.Sequential` (`ConvBlock` or `BasicBlock`),
which is what `fastdata.train.apply_activation_checkpointing` detects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .schedule import PlannedSchedule
from .whitening import WhiteningConv, whitening_layers

__all__ = [
    "ARCHITECTURES",
    "BasicBlock",
    "Cifar100Module",
    "ConvBlock",
    "ModelConfig",
    "OptimConfig",
    "build_model",
]


# ----------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class ModelConfig:
    """What network to build.

    Args:
        arch: a key of `ARCHITECTURES` ("resnet9", "resnet18").
        width: channels of the first stage; each later stage doubles it (64 = the classic size).
        num_classes: outputs of the classifier.
        stem_pool: ResNet-9 only: max-pool right after the stem conv, so every later conv runs at
            16x16 or less. On a 2-core CPU that buys twice the width for the same time, which
            scored higher (2 epochs: 38.3% at width 32 with it, 36.2% at width 16 without);
            False gives the classic layout (better for long GPU runs at width 64).
        stem: ResNet-9 only: the first layer. "whiten": a frozen 3x3 patch-whitening conv
            (`pipelines.cifar100.whitening`: the 12 leading of the 27 patch components and their
            negatives, 24 channels whatever `width`), fitted on the first training batch;
            "conv": a learned 3x3 conv to `width` channels. 2 epochs at width 24: 37.0% with
            "conv", 40.1% with 2x2 whitening (all 12 components), 42.6% with 3x3 (12 of 27).
    """

    arch: str = "resnet9"
    width: int = 24
    num_classes: int = 100
    stem_pool: bool = True
    stem: str = "whiten"


@dataclass(frozen=True)
class OptimConfig:
    """SGD with Nesterov momentum under a one-cycle learning-rate schedule (linear warm-up, then a
    linear decay to ~0), as airbench: short runs gain most from a high peak and a full decay.

    Args:
        lr: peak learning rate of the one-cycle schedule.
        momentum: Nesterov momentum.
        weight_decay: L2 penalty on conv / linear weights (not on BatchNorm parameters and biases).
        label_smoothing: cross-entropy label smoothing.
        warmup: fraction of the steps spent rising to `lr`.
    """

    lr: float = 0.5
    momentum: float = 0.9
    weight_decay: float = 5e-4
    label_smoothing: float = 0.2
    warmup: float = 0.25


# ----------------------------------------------------------------------------- network
def _conv_bn(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
    ]


class ConvBlock(nn.Module):
    """conv3x3 -> (max pool 2) -> BN -> ReLU, then optionally a residual pair of conv-BN-ReLU.

    Args:
        c_in: input channels.
        c_out: output channels.
        pool: max-pool 2x2 right after the conv, so BN and ReLU run on a quarter of the pixels
            (the airbench order).
        residual: add ``x + relu(bn(conv(relu(bn(conv(x))))))``.
        conv: the first conv (it must map `c_in` to `c_out` channels); default a learned 3x3.
    """

    def __init__(
        self,
        c_in: int,
        c_out: int,
        pool: bool = False,
        residual: bool = False,
        conv: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False) if conv is None else conv
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()
        self.bn = nn.BatchNorm2d(c_out)
        self.res = (
            nn.Sequential(
                *_conv_bn(c_out, c_out),
                nn.ReLU(inplace=True),
                *_conv_bn(c_out, c_out),
                nn.ReLU(inplace=True),
            )
            if residual
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn(self.pool(self.conv(x))), inplace=True)
        return x if self.res is None else x + self.res(x)


class BasicBlock(nn.Module):
    """The ResNet-18 basic block: two conv-BN, a projection shortcut when the shape changes.

    Args:
        c_in: input channels.
        c_out: output channels.
        stride: stride of the first conv (2 halves the resolution).
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(c_in, c_out, stride), nn.ReLU(inplace=True), *_conv_bn(c_out, c_out)
        )
        self.shortcut = (
            nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class _Net(nn.Module):
    """Blocks, global max (ResNet-9) or average (ResNet-18) pooling, then a linear classifier."""

    def __init__(
        self, blocks: nn.Sequential, features: int, num_classes: int, head_scale: float, pool: str
    ) -> None:
        super().__init__()
        self.blocks = blocks
        self.pool = nn.AdaptiveMaxPool2d(1) if pool == "max" else nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(features, num_classes, bias=False)
        # A small logit scale (airbench / DAWNBench ResNet-9) keeps early softmax outputs soft.
        self.head_scale = head_scale

    def forward(self, x: Tensor) -> Tensor:
        # channels_last is faster for convs on both CPU (oneDNN) and CUDA (cuDNN NHWC kernels).
        x = self.blocks(x.contiguous(memory_format=torch.channels_last))
        return self.fc(torch.flatten(self.pool(x), 1)) * self.head_scale


def _resnet9(config: ModelConfig) -> nn.Module:
    w = config.width
    if config.stem == "whiten":
        whiten = WhiteningConv(3, kernel_size=3, components=12)
        stem = ConvBlock(3, whiten.out_channels, pool=config.stem_pool, conv=whiten)
    elif config.stem == "conv":
        stem = ConvBlock(3, w, pool=config.stem_pool)
    else:
        raise ValueError(f"unknown stem {config.stem!r}; choose 'whiten' or 'conv'")
    blocks = nn.Sequential(
        stem,
        ConvBlock(stem.bn.num_features, 2 * w, pool=True, residual=True),
        ConvBlock(2 * w, 4 * w, pool=True),
        ConvBlock(4 * w, 8 * w, pool=True, residual=True),
    )
    return _Net(blocks, 8 * w, config.num_classes, head_scale=0.125, pool="max")


def _resnet18(config: ModelConfig) -> nn.Module:
    w = config.width
    layers: list[nn.Module] = [nn.Sequential(*_conv_bn(3, w), nn.ReLU(inplace=True))]
    c_in = w
    for stage, c_out in enumerate((w, 2 * w, 4 * w, 8 * w)):
        layers += [BasicBlock(c_in, c_out, stride=1 if stage == 0 else 2), BasicBlock(c_out, c_out)]
        c_in = c_out
    return _Net(nn.Sequential(*layers), c_in, config.num_classes, head_scale=1.0, pool="avg")


#: Architecture name -> builder.
ARCHITECTURES: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "resnet9": _resnet9,
    "resnet18": _resnet18,
}


def build_model(config: ModelConfig) -> nn.Module:
    """The network of `config`, in channels_last memory format."""
    if config.arch not in ARCHITECTURES:
        raise ValueError(f"unknown model {config.arch!r}; choose one of {sorted(ARCHITECTURES)}")
    if config.width < 1:
        raise ValueError(f"model width must be >= 1, got {config.width}")
    return ARCHITECTURES[config.arch](config).to(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------- training
class Cifar100Module(pl.LightningModule):
    """Cross-entropy training with label smoothing, SGD-Nesterov and a one-cycle schedule.

    Logs ``train/loss_step`` per step (this rank only: no collective per step) and, at epoch end,
    ``train/loss``, ``test/loss`` and ``test/top1`` averaged over ranks (``sync_dist`` only with
    ``on_epoch``: DDP adds one small all-reduce per metric per epoch, not one per step).

    Evaluation averages the logits of each test image and of its mirror image (``tta=True``, as
    airbench's level-1 test-time augmentation): training flips at random, so the two views are
    equally likely inputs, and their mean is a better estimate for twice the (small) eval cost.

    Args:
        model: model configuration.
        optim: optimizer and schedule configuration.
        tta: evaluate on the mean logits of the image and its horizontal mirror.
        train_sizes: progressive resizing: epoch i (from 0) trains on batches resized to
            ``train_sizes[i]`` squared (antialiased bilinear); later epochs, and evaluation, keep
            the input size. Small early epochs cost less (the net is all convs and max pools, so it
            takes any size) and the last ones adapt it to the test resolution.
    """

    def __init__(
        self,
        model: ModelConfig = ModelConfig(),
        optim: OptimConfig = OptimConfig(),
        tta: bool = True,
        train_sizes: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_config = model
        self.optim_config = optim
        self.tta = tta
        if any(size < 8 for size in train_sizes):
            raise ValueError(f"train_sizes must be >= 8 pixels each, got {train_sizes}")
        self.train_sizes = tuple(train_sizes)
        self.net = build_model(model)
        self._whitening_checked = False
        self._eval_counts: Tensor | None = None  # [correct, total] of this rank's evaluation
        self.lr_schedule: PlannedSchedule | None = None  # set by configure_optimizers

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def predict_logits(self, x: Tensor) -> Tensor:
        """Test-time logits of a normalized batch: with `tta` the mean of the logits of `x` and
        of `x` mirrored left-right (one batch of both views: one pass through the network)."""
        if not self.tta:
            return self(x)
        both = self(torch.cat((x, x.flip(3))))
        return (both[: len(x)] + both[len(x) :]) / 2

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self._fit_whitening(x)  # on the full-size batch: the size the later epochs and tests see
        x = self._resize_for_epoch(x)
        loss = F.cross_entropy(self(x), y, label_smoothing=self.optim_config.label_smoothing)
        value, n = loss.detach(), len(y)
        # Per step: this rank's value, no collective. Per epoch: the mean over ranks, one all-reduce.
        self.log(
            "train/loss_step", value, on_step=True, on_epoch=False, prog_bar=True, batch_size=n
        )
        self.log("train/loss", value, on_step=False, on_epoch=True, sync_dist=True, batch_size=n)
        return loss

    def _resize_for_epoch(self, x: Tensor) -> Tensor:
        epoch = self.current_epoch
        if epoch >= len(self.train_sizes) or self.train_sizes[epoch] == x.shape[-1]:
            return x
        size = self.train_sizes[epoch]
        return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)

    def _fit_whitening(self, x: Tensor) -> None:
        """Fit the whitening stem on the first training batch (once: a resumed run restores the
        fitted filters from its checkpoint); with several ranks, rank 0's filters go to all."""
        if self._whitening_checked:  # a Python flag: no device sync per step
            return
        self._whitening_checked = True
        for layer in whitening_layers(self.net):
            if bool(layer.fitted):
                continue
            layer.fit(x)
            if self._trainer is not None and self.trainer.world_size > 1:
                layer.weight.copy_(self.trainer.strategy.broadcast(layer.weight, src=0))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Test loss per batch; top-1 from correct/total counts summed over ranks at epoch end.

        Under DDP the loader pads ranks to equal batches with label -100 (fastdata's
        `PAD_LABEL`): those samples are not counted, so top-1 equals a 1-process run's.
        """
        x, y = batch
        logits = self.predict_logits(x)
        real = y != -100
        n = int(real.sum())
        if n:  # a rank's last batch can hold only padding
            # Plain (unsmoothed) loss on test data, so the figure compares across smoothing settings.
            loss = F.cross_entropy(logits, y)  # ignore_index=-100: padding is left out
            self.log("test/loss", loss, on_epoch=True, sync_dist=True, batch_size=n)
        counts = torch.stack([(logits.argmax(1) == y)[real].sum(), real.sum()]).double()
        self._eval_counts = counts if self._eval_counts is None else self._eval_counts + counts

    def on_validation_epoch_end(self) -> None:
        counts, self._eval_counts = self._eval_counts, None
        if counts is None:
            return
        correct, total = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        self.log("test/top1", correct / max(total, 1.0), prog_bar=True, sync_dist=False)

    def configure_optimizers(self) -> dict:
        cfg = self.optim_config
        decay = [p for p in self.parameters() if p.ndim > 1]
        no_decay = [p for p in self.parameters() if p.ndim <= 1]
        optimizer = torch.optim.SGD(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=True,
        )
        # One-cycle (OneCycleLR's linear shape: lr/10 -> lr -> lr/1000) over the planned steps;
        # a `BudgetPlanner` re-fits it once it knows how many steps the budget allows.
        steps = self.trainer.estimated_stepping_batches
        self.lr_schedule = PlannedSchedule(
            int(steps) if math.isfinite(steps) else 1, warmup=cfg.warmup, start=0.1, end=1e-3
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
