"""`ShardDataModule` under Ray Train: a 2-worker `TorchTrainer` fitting a LightningModule
(`RayDDPStrategy`, `RayLightningEnvironment`, `prepare_trainer`, `RayTrainReportCallback`) on
CIFAR-100-style shards (synthetic 32x32 raw samples, 100 classes) on a local Ray cluster of 2 CPUs.

Ray workers are other processes: each rank appends the keys of every batch it trained on
(`keys=True`) and the keys it evaluated to files under tmp_path, which the test reads back.

- Ranks: rank and world size come from Ray (through the Trainer), each rank's training keys are
  disjoint from the other's, they hold the same number of batches, and together the epoch once;
  each rank's order is the one `ShardDataModule(rank=r, world_size=2)` plans outside Ray.
- Evaluation: 45 val samples are not a multiple of 2 ranks x 8, so the plan pads with one sample
  labelled -100; every val key is evaluated once across ranks, and the ``val_total`` reported to
  Ray (a ``sync_dist`` sum over ranks of labels != -100) is the split's size.
- Resume: `RayStepCheckpoint` reports a checkpoint every 3 steps (mid-epoch; Ray's own
  `RayTrainReportCallback` reports at epoch ends only); every rank raises after step 4, Ray
  restarts the workers (``FailureConfig(max_failures=1)``) and they resume from the step-3
  checkpoint (`ray_checkpoint_path` -> ``trainer.fit(ckpt_path=...)``): per rank, the first
  attempt trained the planned batches 1-4, the second exactly the planned batches 4-12.

Timing (2-core CPU shared with other jobs, load average 15-23): the Ray fit 206 s (cluster
start 27 s, two worker-group starts; 24 training steps in all), the guide 128 s (`heavy`: not in
CI's default run), the rest < 20 s each. Most of it is Ray starting processes on a saturated CPU,
not training.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ray.train.lightning")

import lightning.pytorch as pl  # noqa: E402
import ray  # noqa: E402
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.lightning import (  # noqa: E402
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from ray.train.torch import TorchTrainer  # noqa: E402

from fastdata import ShardDataModule, WorkerSettings  # noqa: E402
from fastdata.lightning.ray import RayStepCheckpoint, ray_checkpoint_path  # noqa: E402
from fastdata.read.plan import PAD_LABEL  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"train": 192, "val": 45}
BATCH, WORLD = 8, 2
EVERY, CRASH_AFTER = 3, 4  # a Ray checkpoint every 3 steps; a crash after step 4
STEPS = SIZES["train"] // (BATCH * WORLD)  # 12 per epoch


def _datamodule(shards: str, **rank: int) -> ShardDataModule:
    return ShardDataModule(
        shards,
        batch_size=BATCH,
        backend="cpu",
        train_transforms="none",
        keys=True,
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
        **rank,
    )


class _Recorder(pl.LightningModule):
    """A linear classifier that appends each batch's keys to files under `out` (one per rank)."""

    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.out, self.tag = Path(out), tag
        self.head = torch.nn.Linear(3 * 32 * 32, 100)

    def _record(self, what: str, keys: list[str | None]) -> None:
        line = " ".join(k if k is not None else "PAD" for k in keys)
        with open(self.out / f"{self.tag}-{what}-rank{self.global_rank}.txt", "a") as f:
            f.write(line + "\n")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self._record("train", ids["key"])
        return torch.nn.functional.cross_entropy(self.head(x.flatten(1)), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, ids = batch
        self._record("val", ids["key"])
        real = y != PAD_LABEL
        loss = torch.nn.functional.cross_entropy(self.head(x.flatten(1)), y, ignore_index=-100)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(y))
        total = real.sum().float()
        self.log("val_total", total, sync_dist=True, reduce_fx="sum", batch_size=len(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _CrashOnce(pl.Callback):
    """Raises on every rank after training step `at`, once per rank (a marker file remembers)."""

    def __init__(self, out: str, at: int) -> None:
        self.out, self.at = Path(out), at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        marker = self.out / f"crashed-rank{trainer.global_rank}"
        if trainer.global_step == self.at and not marker.exists():
            marker.touch()
            raise RuntimeError(f"planned crash after step {self.at}")


def train_func(config: dict[str, Any]) -> None:
    """One Ray Train worker: the Lightning fit, resumed from Ray's latest checkpoint if any."""
    context = ray.train.get_context()
    dm = _datamodule(config["shards"])
    attempt = "first" if ray.train.get_checkpoint() is None else "resumed"
    model = _Recorder(config["out"], attempt)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[
            RayStepCheckpoint(EVERY),
            RayTrainReportCallback(),
            _CrashOnce(config["out"], CRASH_AFTER),
        ],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer = prepare_trainer(trainer)
    assert (trainer.global_rank, trainer.world_size) == (
        context.get_world_rank(),
        context.get_world_size(),
    )
    with ray_checkpoint_path() as ckpt_path:
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)


def _fit(shards: Path, out: Path, storage: Path) -> Any:
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"shards": str(shards), "out": str(out)},
        scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False),
        run_config=RunConfig(
            name="fit", storage_path=str(storage), failure_config=FailureConfig(max_failures=1)
        ),
    )
    return trainer.fit()


# ----------------------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def local_ray(request: pytest.FixtureRequest) -> None:
    if ray.is_initialized():
        pytest.skip("a Ray session is already running in this process")
    # Workers unpickle `train_func` and `_Recorder` by value: pytest imports this file under a
    # module name the workers could not import.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    request.addfinalizer(ray.shutdown)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources.arrays import ArraySource

    rng = np.random.default_rng(30)
    arrays = {
        split: (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 100, n))
        for split, n in SIZES.items()
    }
    source = ArraySource(arrays, [f"class{i}" for i in range(100)])
    out = tmp_path_factory.mktemp("ray-train") / "shards"
    write_shards(source, out, ShardOptions(max_count=64, workers=1, progress=False))
    return out


def _lines(out: Path, tag: str, what: str, rank: int) -> list[list[str]]:
    path = out / f"{tag}-{what}-rank{rank}.txt"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _planned(shards: Path) -> tuple[list[list[str]], set[str], set[str]]:
    """Per rank, epoch 0's training keys in order as planned outside Ray; all train, val keys."""
    order = []
    for rank in range(WORLD):
        dm = _datamodule(str(shards), rank=rank, world_size=WORLD)
        order.append([k for _, _, ids in dm.train_dataloader() for k in ids["key"]])
    dm = _datamodule(str(shards))
    train = {k for _, _, ids in dm.train_dataloader() for k in ids["key"]}
    val = {k for _, _, ids in dm.val_dataloader() for k in ids["key"]}
    return order, train, val


@pytest.mark.slow
def test_two_ray_workers_split_the_epoch_evaluate_exactly_and_resume_mid_epoch(
    local_ray: None, shards: Path, tmp_path: Path
) -> None:
    order, train_keys, val_keys = _planned(shards)
    assert len(train_keys) == SIZES["train"] and len(val_keys) == SIZES["val"]
    out, storage = tmp_path / "records", tmp_path / "ray"
    out.mkdir()

    result = _fit(shards, out, storage)
    assert result.error is None, result.error
    assert isinstance(result.checkpoint, Checkpoint)
    assert (out / "crashed-rank0").exists() and (out / "crashed-rank1").exists()

    trained = {}
    for rank in range(WORLD):
        first = _lines(out, "first", "train", rank)
        rest = _lines(out, "resumed", "train", rank)
        assert len(first) == CRASH_AFTER and len(rest) == STEPS - EVERY, (rank, first, rest)
        assert all(len(batch) == BATCH for batch in first + rest), "equal batches on each rank"
        # The first attempt trained the planned batches up to the crash; the second resumed at
        # the checkpoint (step 3), so it retrains step 4's batch and then the rest of the epoch.
        assert [k for b in first for k in b] == order[rank][: CRASH_AFTER * BATCH]
        keys = [k for batch in first[:EVERY] + rest for k in batch]
        assert keys == order[rank], f"rank {rank}: not the planned order, or not resumed there"
        trained[rank] = keys
    assert not set(trained[0]) & set(trained[1]), "the ranks trained on common samples"
    together = trained[0] + trained[1]
    assert len(together) == len(set(together)) and set(together) == train_keys

    # Validation ran once, at the end of the resumed epoch: each val sample once across ranks.
    assert not any(_lines(out, "first", "val", r) for r in range(WORLD))
    evaluated = [k for r in range(WORLD) for b in _lines(out, "resumed", "val", r) for k in b]
    real = [k for k in evaluated if k != "PAD"]
    assert sorted(real) == sorted(val_keys), "a val sample missed or counted twice"
    assert evaluated.count("PAD") == (-SIZES["val"]) % WORLD  # padded to a multiple of ranks
    assert result.metrics["val_total"] == SIZES["val"]
    assert result.metrics["step"] == STEPS


@pytest.mark.slow
@pytest.mark.heavy  # 130-175 s of Ray start-up on 2 cores; the fit above covers the same calls
def test_the_guide_example_runs(tmp_path: Path) -> None:
    """docs/guides/ray-train.md's python block, run as written (its own local Ray cluster).

    Not in CI's default run (`heavy`): the test above fits through the same Ray Train calls
    (TorchTrainer, RayDDPStrategy, RayLightningEnvironment, prepare_trainer, RayStepCheckpoint,
    ray_checkpoint_path) and checks more; run this one with `-m heavy` after editing the guide.
    """
    page = (ROOT / "docs" / "guides" / "ray-train.md").read_text()
    assert page.startswith(f"<!-- docs-test: covered-by {Path(__file__).relative_to(ROOT)}::")
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)
    assert len(blocks) == 1, "the guide has one python block"
    script = tmp_path / "guide.py"
    script.write_text(blocks[0])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert re.search(r"val accuracy \d\.\d{3} on 99 samples, 8 steps", done.stdout), done.stdout


# ----------------------------------------------------------------------------- fast checks
def test_auto_workers_are_sized_for_every_ray_worker_on_the_node(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under Ray Train each worker's Trainer has one CPU device while the node runs
    $LOCAL_WORLD_SIZE workers (Ray exports it): "auto" sizes the loader for that many ranks."""
    from fastdata.lightning.runtime import size_workers

    seen = []

    def measured(spec: Any, backend: str, ranks_per_node: int | None, decode_threads: Any) -> Any:
        seen.append(ranks_per_node)
        return SimpleNamespace(num_workers=1, prefetch_factor=2, pin_memory=False, decode_threads=1)

    monkeypatch.setattr("fastdata.lightning.runtime.auto_settings", measured)
    spec = _datamodule(str(tiny_shards)).loader_spec("train", train=True)
    one_device = SimpleNamespace(num_devices=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    auto = WorkerSettings(num_workers="auto", prefetch_factor="auto")
    assert size_workers(spec, auto, "cpu", one_device).workers.num_workers == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    size_workers(spec, auto, "cpu", SimpleNamespace(num_devices=4))
    assert seen == [2, 4]


def test_ray_step_checkpoint_checks_its_interval() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        RayStepCheckpoint(0)
    with pytest.raises(ValueError, match="an int >= 1"):
        RayStepCheckpoint(2.5)  # type: ignore[arg-type]


def test_fastdata_imports_no_ray() -> None:
    code = "import fastdata, fastdata.lightning.datamodule, sys; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


class _SaveAtEpochEnd(pl.Callback):
    """Saves where `RayTrainReportCallback` does: at each training epoch's end."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize(
    ("stop_at", "resume_steps", "steps", "warned"),
    [(3, -1, 9, True), (-1, -1, 9, False), (3, 5, 2, False)],
)
def test_an_epoch_end_checkpoint_of_a_cut_epoch_warns_of_the_samples_left(
    tiny_shards: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    stop_at: int,
    resume_steps: int,
    steps: int,
    warned: bool,
) -> None:
    """A checkpoint saved at the end of an epoch that max_steps cut short (after 3 of its 9
    batches: 300 samples, batch 32), resumed with max_steps=-1: Lightning starts epoch 1 (9
    batches), so the 6 batches left of epoch 0 are never trained, which is said once. A
    checkpoint of a whole epoch resumes epoch 1 silently. Resumed with max_steps=5, Lightning
    stays in epoch 0 and the DataModule continues it: its batches 4 and 5, no warning."""
    from tests.lightning.test_datamodule import SmallCNN

    def trainer(**options: Any) -> pl.Trainer:
        options = {"max_epochs": 2, **options}
        return pl.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False,
            **options,
        )  # fmt: skip

    def dm() -> ShardDataModule:
        workers = WorkerSettings(num_workers=0, prefetch_factor=2)
        return ShardDataModule(tiny_shards, batch_size=32, backend="cpu", workers=workers)

    path = tmp_path / "end.ckpt"
    first = SmallCNN(300)
    cut = trainer(max_steps=stop_at, max_epochs=1, callbacks=[_SaveAtEpochEnd(path)])
    cut.fit(first, datamodule=dm())
    model = SmallCNN(300)
    with caplog.at_level("WARNING", logger="fastdata"):
        trainer(max_steps=resume_steps).fit(model, datamodule=dm(), ckpt_path=path)
    assert len(model.seen) == steps * 32
    said = "the 6 batches left of epoch 0 are not trained" in caplog.text
    assert said == warned, caplog.text
    if warned:
        assert "epoch 0 after 96 of its samples" in caplog.text
    if resume_steps == 5:  # the next planned batches of epoch 0 (labels == sample ids)
        whole = SmallCNN(300)
        trainer(max_steps=5).fit(whole, datamodule=dm())
        assert model.seen == whole.seen[3 * 32 :]
