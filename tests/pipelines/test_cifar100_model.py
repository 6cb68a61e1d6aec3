"""The CIFAR-100 recipe pieces: test-time flip averaging, label smoothing, the whitening stem."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipelines.cifar100.model import Cifar100Module, ModelConfig, OptimConfig
from pipelines.cifar100.whitening import WhiteningConv, whitening_layers


def _module(stem: str = "conv", **kwargs: object) -> Cifar100Module:
    # The learned conv stem by default: an unfitted whitening stem outputs zeros.
    torch.manual_seed(0)
    module = Cifar100Module(ModelConfig(width=4, stem=stem), **kwargs)  # type: ignore[arg-type]
    return module.eval()


def _batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 100, (n,), generator=g)


@torch.no_grad()
def test_tta_logits_are_the_mean_of_the_image_and_its_mirror() -> None:
    module = _module(tta=True)
    x, _ = _batch()

    expected = (module(x) + module(x.flip(3))) / 2

    got = module.predict_logits(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # An asymmetric input makes the two views differ, so this is not the plain forward.
    assert not torch.allclose(got, module(x), atol=1e-4)


@torch.no_grad()
def test_without_tta_the_logits_are_the_plain_forward() -> None:
    module = _module(tta=False)
    x, _ = _batch()

    torch.testing.assert_close(module.predict_logits(x), module(x))


def test_training_loss_uses_the_configured_label_smoothing() -> None:
    smoothing = 0.3
    module = _module(optim=OptimConfig(label_smoothing=smoothing))
    x, y = _batch()
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # no Trainer here

    loss = module.training_step((x, y), 0)

    with torch.no_grad():
        logits = module(x)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y, label_smoothing=smoothing))
    assert abs(float(loss.detach()) - float(F.cross_entropy(logits, y))) > 1e-4


def _correlated_images(n: int = 16) -> torch.Tensor:
    """Smooth, channel-correlated images: their raw 2x2 patches are far from white."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(n, 1, 8, 8, generator=g)
    img = F.interpolate(base, size=(32, 32), mode="bilinear", align_corners=False)
    return torch.cat((img, 0.8 * img, -0.5 * img), 1) + 0.05 * torch.randn(
        n, 3, 32, 32, generator=g
    )


@pytest.mark.parametrize(("kernel_size", "components"), [(2, None), (3, 12)])
def test_whitening_conv_decorrelates_the_patches_it_was_fitted_on(
    kernel_size: int, components: int | None
) -> None:
    x = _correlated_images()
    layer = WhiteningConv(3, kernel_size=kernel_size, components=components, eps=0.0)
    assert not bool(layer.fitted)

    layer.fit(x)

    assert bool(layer.fitted) and layer.out_channels == 24
    out = F.conv2d(x, layer.weight)  # valid positions only: exactly the fitted patches
    flat = out.permute(0, 2, 3, 1).reshape(-1, 24).double()
    covariance = flat[:, :12].T @ flat[:, :12] / len(flat)
    torch.testing.assert_close(covariance, torch.eye(12, dtype=torch.float64), atol=2e-3, rtol=0)
    torch.testing.assert_close(out[:, 12:], -out[:, :12])
    assert layer(x).shape == (16, 24, 32, 32)  # "same" size with the padding
    # The kept directions are the leading ones: they hold nearly all of the patches' variance.
    k = kernel_size
    patches = x.unfold(2, k, 1).unfold(3, k, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * k * k)
    raw = (patches.T @ patches / len(patches)).double()
    directions = torch.nn.functional.normalize(layer.weight[:12].reshape(12, -1).double(), dim=1)
    captured = torch.einsum("ij,jk,ik->", directions, raw, directions) / raw.trace()
    assert captured > 0.95


def test_module_fits_the_whitening_stem_on_the_first_training_batch_only() -> None:
    module = _module(stem="whiten")
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    (layer,) = whitening_layers(module.net)
    x, y = _batch(16)

    module.training_step((_correlated_images(), y), 0)
    fitted = layer.weight.clone()
    module.training_step((x, y), 1)

    assert bool(layer.fitted) and fitted.abs().sum() > 0
    torch.testing.assert_close(layer.weight, fitted)  # frozen after the first batch
    restored = Cifar100Module(ModelConfig(width=4))
    restored.load_state_dict(module.state_dict())  # checkpoints carry the fitted filters
    (copy,) = whitening_layers(restored.net)
    assert bool(copy.fitted)
    torch.testing.assert_close(copy.weight, fitted)


def test_conv_stem_has_no_whitening_layer() -> None:
    module = Cifar100Module(ModelConfig(width=4, stem="conv"))

    assert whitening_layers(module.net) == []
    assert module(torch.randn(2, 3, 32, 32)).shape == (2, 100)


def test_progressive_resizing_trains_the_first_epochs_at_their_size_and_evaluates_full_size() -> (
    None
):
    module = _module(train_sizes=(16,))
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    seen: list[tuple[int, ...]] = []
    module.net.blocks.register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape)))
    x, y = _batch()

    module.training_step((x, y), 0)  # epoch 0 (no Trainer): the first size
    with torch.no_grad():
        module.predict_logits(x)

    assert seen == [(6, 3, 16, 16), (12, 3, 32, 32)]  # evaluation: both flip views at once
    with pytest.raises(ValueError, match="train_sizes"):
        Cifar100Module(ModelConfig(width=4), train_sizes=(4,))


def test_top1_leaves_out_the_eval_padding_of_ddp_ranks() -> None:
    """Padding samples (label -100) are neither hits nor misses: top-1 is over real samples."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    module = _module(tta=False)
    x, y = _batch(6)
    with torch.no_grad():
        pred = module.predict_logits(x).argmax(1)
    y = pred.clone()
    y[:2] = (pred[:2] + 1) % 100  # 2 misses among 4 real samples
    y[4:] = -100  # padding, even where the prediction is "wrong"
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=3)
    metrics = trainer.validate(module, loader, verbose=False)[0]
    assert metrics["test/top1"] == pytest.approx(2 / 4)
