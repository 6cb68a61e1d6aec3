"""ShardDataModule: the user contract, a LightningModule trained unchanged, DDP with 2 processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from fastdata import WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.lightning.datamodule import ShardDataModule
from fastdata.read.resume import ResumeError, dataset_fingerprint
from tests.conftest import quiet_trainer


class SmallCNN(pl.LightningModule):
    """An ordinary LightningModule: it knows nothing about fastdata."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, num_classes),
        )
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.extend(y.tolist())
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_contract_of_the_readme(tiny_shards):
    dm = ShardDataModule(
        tiny_shards,
        batch_size=32,
        backend="cpu",
        workers=WorkerSettings(num_workers=2, prefetch_factor=2),
    )
    dm.setup("fit")
    device = torch.device("cpu")
    n = 0
    for batch in dm.train_dataloader():
        x, y = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, device, 0), 0)
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 8, 8) and x.device == device
        assert y.dtype == torch.int64 and y.shape == (x.shape[0],)
        n += 1
    assert n == len(dm.train_dataloader()) == 300 // 32


def _state_after(root: Path, steps: int, batch_size: int = 32) -> dict:
    """The state_dict of a 1-rank run (seed 0) after `steps` batches of epoch 0."""
    manifest = load_manifest(root)
    return {
        "version": 2,
        "epoch": 0,
        "consumed": steps * batch_size,
        "steps": steps,
        "seed": 0,
        "world_size": 1,
        "batch_size": batch_size,
        "num_samples": manifest.split("train").num_samples,
        "dataset": dataset_fingerprint(manifest, "train"),
        # The default window: the whole (small) split, which the node holds many times over.
        "shuffle": f"window:{manifest.split('train').num_samples}",
    }


def test_unchanged_lightning_module_trains_one_epoch(tiny_shards):
    dm = ShardDataModule(
        tiny_shards,
        batch_size=32,
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
        backend="cpu",
        train_transforms="cifar",
        splits={"val": "test"},  # tiny_shards has no val split: validate on test
    )
    model = SmallCNN(num_classes=300)
    trainer = quiet_trainer(devices=1)
    trainer.fit(model, datamodule=dm)
    assert len(model.seen) == 9 * 32 and len(set(model.seen)) == len(model.seen)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert "val_loss" in trainer.callback_metrics
    assert dm.state_dict() == _state_after(tiny_shards, steps=9)


def test_no_val_split_skips_validation_with_a_warning_never_the_training_split(tiny_shards, caplog):
    dm = ShardDataModule(
        tiny_shards,
        batch_size=32,
        backend="cpu",
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )
    with caplog.at_level("WARNING", logger="fastdata"):
        assert dm.val_dataloader() == []
    assert "no validation split" in caplog.text and "splits={'val': 'test'}" in caplog.text
    model = SmallCNN(num_classes=300)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_train_batches=2,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    assert "val_loss" not in trainer.callback_metrics  # no validation on training data


class RangeRecorder(SmallCNN):
    """Records the value range of every batch the model gets, training and validation."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.ranges: dict[str, list[tuple[float, float]]] = {"train": [], "val": []}

    def on_train_batch_start(self, batch, batch_idx):
        self.ranges["train"].append((float(batch[0].min()), float(batch[0].max())))

    def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
        self.ranges["val"].append((float(batch[0].min()), float(batch[0].max())))


def test_memory_backend_fused_training_batches_with_validation_mid_epoch(tiny_shards):
    # The fused cifar loader yields cropped uint8 training batches; a validation run in the
    # middle of the epoch yields plain uint8 batches. The data module must normalize each
    # exactly once (and crop only the plain ones), before and after the validation run.
    dm = ShardDataModule(
        tiny_shards,
        batch_size=32,
        backend="memory",
        train_transforms="cifar",
        splits={"val": "test"},
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )
    model = RangeRecorder(num_classes=300)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, val_check_interval=0.5,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    assert dm.train_dataloader().loader.applied_ops == 1 and not dm.train_dataloader().normalized
    assert len(model.ranges["train"]) == 9 and len(model.ranges["val"]) >= 4
    # CIFAR-100 mean/std on uint8 pixels: about [-1.9, 2.2]; twice-normalized values stay near -1.9.
    for low, high in model.ranges["train"] + model.ranges["val"]:
        assert -2.0 < low < -1.0 and 1.5 < high < 2.3
    assert dm.state_dict() == _state_after(tiny_shards, steps=9)


def test_load_state_dict_resumes_mid_epoch(tiny_shards):
    full = ShardDataModule(
        tiny_shards,
        batch_size=32,
        backend="cpu",
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )
    full.setup()
    epoch0 = [y.tolist() for _, y in full.train_dataloader()]
    # Take the state after 4 batches, as a custom loop (no Trainer) would.
    partial = ShardDataModule(
        tiny_shards,
        batch_size=32,
        backend="cpu",
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )
    partial.setup()
    device = torch.device("cpu")
    for step, batch in enumerate(partial.train_dataloader(), start=1):
        partial.on_after_batch_transfer(partial.transfer_batch_to_device(batch, device, 0), 0)
        if step == 4:
            break
    state = partial.state_dict()
    assert state == _state_after(tiny_shards, steps=4)
    resumed = ShardDataModule(
        tiny_shards,
        batch_size=32,
        backend="cpu",
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )
    resumed.load_state_dict(state)
    resumed.setup()
    loader = resumed.train_dataloader()
    assert len(loader) == len(epoch0)  # the epoch's length counts the batches already taken
    assert [y.tolist() for _, y in loader] == epoch0[4:]


def test_load_state_dict_refuses_states_it_cannot_honour(tiny_shards):
    dm = ShardDataModule(
        tiny_shards, batch_size=32, seed=1, workers=WorkerSettings(num_workers=0, prefetch_factor=2)
    )
    with pytest.raises(ResumeError, match="older fastdata"):
        dm.load_state_dict({"epoch": 0, "batches_seen": 4})
    state = _state_after(tiny_shards, steps=4)
    with pytest.raises(ResumeError, match="seed=0.*pass seed=0"):
        dm.load_state_dict(state)
    with pytest.raises(ResumeError, match="another dataset"):
        dm.load_state_dict({**state, "seed": 1, "dataset": "0" * 16})


def test_bad_arguments_are_refused(tiny_shards):
    with pytest.raises(ValueError, match="num_workers"):
        ShardDataModule(tiny_shards, workers=WorkerSettings(num_workers=-1))
    with pytest.raises(ValueError, match="on_error"):
        ShardDataModule(tiny_shards, on_error="ignore")
    with pytest.raises(ValueError, match="backend must be one of"):
        ShardDataModule(
            tiny_shards, backend="gpu", workers=WorkerSettings(num_workers=0, prefetch_factor=2)
        ).setup()
    with pytest.raises(ValueError, match="no manifest.json"):
        ShardDataModule(tiny_shards / "nowhere").setup()
    with pytest.raises(ValueError, match="decode_threads must be an int >= 1 or 'auto'"):
        ShardDataModule(tiny_shards, workers=WorkerSettings(decode_threads=0))


def test_decode_threads_auto_takes_the_tuners_choice(tiny_shards, monkeypatch):
    import fastdata.lightning.runtime as runtime_module
    from fastdata.tune.sizing import LoaderSettings

    asked = []

    def fake_auto(spec, backend="cpu", ranks_per_node=None, decode_threads=1):
        asked.append(decode_threads)
        return LoaderSettings(1, 3, False, False, decode_threads=3)

    monkeypatch.setattr(runtime_module, "auto_settings", fake_auto)
    spec = ShardDataModule(
        tiny_shards,
        backend="cpu",
        workers=WorkerSettings(num_workers=2, prefetch_factor=2, decode_threads="auto"),
    ).loader_spec("train", train=True)
    assert asked == ["auto"]  # fixed counts stay; only the threads were "auto"
    assert (spec.workers.num_workers, spec.workers.prefetch_factor) == (2, 2)
    assert spec.workers.decode_threads == 3
    spec = ShardDataModule(
        tiny_shards, backend="cpu", workers=WorkerSettings(num_workers=2, prefetch_factor=2)
    )
    assert spec.loader_spec("train", train=True).workers.decode_threads == 1 and asked == ["auto"]


DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {root!r})
    import lightning.pytorch as pl
    from fastdata.lightning.datamodule import ShardDataModule
    from tests.lightning.test_datamodule import SmallCNN

    from fastdata import LoaderMonitor, WorkerSettings

    class Recorder(SmallCNN):
        def on_train_epoch_end(self):
            with open({out!r} + f"/rank{{self.global_rank}}-epoch{{self.current_epoch}}.json", "w") as f:
                json.dump(self.seen, f)
            self.seen = []

        def on_train_end(self):
            own = {{k: monitor.summary[k] for k in ("data_wait_frac", "samples_per_s")}}
            logged = {{k: float(self.trainer.callback_metrics["loader/" + k]) for k in own}}
            with open({out!r} + f"/monitor{{self.global_rank}}.out", "w") as f:
                json.dump({{"own": own, "logged": logged}}, f)

    monitor = LoaderMonitor(resize=False, gpu_reader=None)

    dm = ShardDataModule({shards!r}, batch_size=16,
                         workers=WorkerSettings(num_workers=1, prefetch_factor=2),
                         backend={backend!r}, drop_last=False)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[monitor])
    trainer.fit(Recorder(301), datamodule=dm)
    """
)


def run_ddp(tmp_path: Path, shards: Path, backend: str) -> dict[str, list[int]]:
    script = DDP_SCRIPT.format(
        root=str(Path(__file__).parents[2]), out=str(tmp_path), shards=str(shards), backend=backend
    )
    path = tmp_path / "ddp_run.py"  # a file: Lightning's DDP launcher re-runs the script per rank
    path.write_text(script)
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sync_dist" not in result.stderr, "epoch figures must be reduced across ranks"
    return {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*-epoch*.json")}


@pytest.mark.slow
def test_ddp_two_processes_get_equal_batches_and_the_whole_split(tmp_path):
    from fastdata.write import ShardOptions, write_shards
    from tests.conftest import unique_label_source

    shards = tmp_path / "shards"  # 301 samples: one rank needs one padding sample
    write_shards(
        unique_label_source(n_train=301),
        shards,
        ShardOptions(max_count=64, workers=1, progress=False),
    )
    seen = run_ddp(tmp_path, shards, "cpu")
    assert sorted(seen) == ["rank0-epoch0", "rank0-epoch1", "rank1-epoch0", "rank1-epoch1"]
    for epoch in (0, 1):
        r0, r1 = seen[f"rank0-epoch{epoch}"], seen[f"rank1-epoch{epoch}"]
        assert len(r0) == len(r1) == 151  # ceil(301 / 2) each, in 10 batches of <= 16
        assert set(r0) | set(r1) == set(range(301))
        assert len(set(r0) & set(r1)) == 1 and len(set(r0)) == len(set(r1)) == 151  # the padding
    assert seen["rank0-epoch0"] != seen["rank0-epoch1"]  # a new shuffle each epoch
    # LoaderMonitor's logged epoch figures: the slowest rank's wait, the ranks' summed throughput.
    ranks = [json.loads((tmp_path / f"monitor{r}.out").read_text()) for r in (0, 1)]
    assert ranks[0]["logged"] == ranks[1]["logged"]
    own = [rank["own"] for rank in ranks]
    logged = ranks[0]["logged"]
    assert logged["data_wait_frac"] == pytest.approx(max(o["data_wait_frac"] for o in own))
    assert logged["samples_per_s"] == pytest.approx(sum(o["samples_per_s"] for o in own))
