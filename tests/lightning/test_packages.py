"""ShardDataModule is a DataModule to the Trainer of `lightning.pytorch` and of `pytorch_lightning`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from fastdata import ShardDataModule, WorkerSettings
from tests.lightning.models import PACKAGES, QUIET, lightning_package, small_cnn

pytest.importorskip("pytorch_lightning")


def _dm(root: Path, **kwargs) -> ShardDataModule:
    options = dict(
        batch_size=32, workers=WorkerSettings(num_workers=0, prefetch_factor=2), backend="cpu"
    )
    return ShardDataModule(root, splits={"val": "test"}, **(options | kwargs))


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("how", ["datamodule=", "positional"])
def test_each_packages_trainer_fits_and_tests(tiny_shards, package, how):
    pkg = lightning_package(package)
    dm = _dm(tiny_shards)
    assert isinstance(dm, pkg.LightningDataModule)
    model = small_cnn(pkg)()
    trainer = pkg.Trainer(max_epochs=1, limit_val_batches=1, **QUIET)
    if how == "positional":  # Lightning's own tutorials call fit(model, dm)
        trainer.fit(model, dm)
        results = trainer.test(model, dm, verbose=False)
    else:
        trainer.fit(model, datamodule=dm)
        results = trainer.test(model, datamodule=dm, verbose=False)
    labels = [label for batch in model.seen for label in batch]
    assert len(labels) == 9 * 32 and len(set(labels)) == len(labels)  # 300 // 32 batches, no repeat
    assert model.shapes == {(3, 8, 8)} and model.head.out_features == 300
    assert model.val_seen and torch.isfinite(torch.tensor(results[0]["test_loss"]))


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []


@pytest.mark.parametrize("package", PACKAGES)
def test_the_modules_own_transfer_hooks_run_and_the_datamodules_augmentation_too(
    tiny_shards, package
):
    """Hooks the DataModule leaves alone are not 'overridden' in the eyes of either Trainer."""
    pkg = lightning_package(package)
    record = _Recorder()

    class Hooked(small_cnn(pkg)):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            record.calls.append("before")
            return batch

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            record.calls.append("transfer")
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def training_step(self, batch, batch_idx):
            assert batch[0].dtype == torch.float32  # normalized by the DataModule's hook
            return super().training_step(batch, batch_idx)

    trainer = pkg.Trainer(max_steps=2, limit_val_batches=0, **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Hooked(), datamodule=_dm(tiny_shards))
    assert record.calls == ["before", "transfer"] * 2
    assert not [w for w in caught if "in both" in str(w.message)]  # the module's hooks won


def test_without_pytorch_lightning_it_is_a_lightning_pytorch_datamodule(tiny_shards):
    """pytorch_lightning blocked from importing: the class still builds and trains."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["pytorch_lightning"] = None  # as if not installed: import raises ImportError
        import lightning.pytorch as L
        from fastdata import ShardDataModule, WorkerSettings
        from fastdata.lightning.compat import DATAMODULE_BASES
        assert DATAMODULE_BASES == (L.LightningDataModule,), DATAMODULE_BASES
        assert "pytorch_lightning" not in [c.__module__.split(".")[0] for c in ShardDataModule.__mro__]
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from tests.lightning.models import QUIET, small_cnn
        dm = ShardDataModule({str(tiny_shards)!r}, batch_size=32,
                             workers=WorkerSettings(num_workers=0), backend="cpu")
        model = small_cnn(L)()
        L.Trainer(max_steps=3, limit_val_batches=0, **QUIET).fit(model, dm)
        assert len(model.seen) == 3 and dm.num_classes == 300
        print("OK")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


@pytest.mark.parametrize("package", PACKAGES)
def test_a_model_with_example_input_array_gets_its_summary(tiny_shards, package):
    """Lightning sends `example_input_array` through the DataModule's transfer hooks."""
    pkg = lightning_package(package)

    class WithExample(small_cnn(pkg)):
        def __init__(self) -> None:
            super().__init__()
            self.example_input_array = torch.zeros(2, *ShardDataModule(tiny_shards).image_shape)

    quiet = QUIET | {"enable_model_summary": True}
    model = WithExample()
    trainer = pkg.Trainer(max_steps=2, limit_val_batches=0, **quiet)
    trainer.fit(model, datamodule=_dm(tiny_shards))
    assert len(model.seen) == 2 and model.shapes == {(3, 8, 8)}
