"""Mid-epoch checkpoints under Ray Train, for `ShardDataModule`'s exact resume.

Ray Train's `ray.train.lightning.RayTrainReportCallback` reports a Lightning checkpoint at each
training epoch's end only. Lightning reads a checkpoint saved in ``on_train_epoch_end`` as a
finished epoch, even when ``max_steps`` ended it early, so no Ray checkpoint can resume in the
middle of an epoch: a worker lost mid-epoch repeats the whole epoch, and a run stopped by
``max_steps`` and resumed skips the rest of its epoch. `RayStepCheckpoint` reports one every
`every_n_steps` training steps, from ``on_train_batch_end``, where Lightning saves a mid-epoch
state and `ShardDataModule.state_dict` the samples consumed; `ray_checkpoint_path` hands the latest
one Ray restored to ``trainer.fit(ckpt_path=...)``:

    def train_func(config):
        dm = ShardDataModule(...)  # rank and world size: the Trainer's, i.e. Ray's
        trainer = prepare_trainer(pl.Trainer(strategy=RayDDPStrategy(),
            plugins=[RayLightningEnvironment()], callbacks=[RayStepCheckpoint(500)]))
        with ray_checkpoint_path() as ckpt_path:  # None on a fresh start
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)

Ray is imported when these run, never when fastdata is imported (`fastdata[ray]`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl

__all__ = ["CHECKPOINT_NAME", "RayStepCheckpoint", "ray_checkpoint_path"]

#: The Lightning checkpoint's file name in a Ray checkpoint (`RayTrainReportCallback`'s too).
CHECKPOINT_NAME = "checkpoint.ckpt"


def _ray_train() -> Any:
    try:
        import ray.train
    except ImportError as err:
        raise ImportError(
            "fastdata.lightning.ray needs Ray Train: pip install 'fastdata[ray]' "
            "(or pip install 'ray[train]')"
        ) from err
    return ray.train


class RayStepCheckpoint(pl.Callback):
    """Report a Lightning checkpoint to Ray Train every `every_n_steps` training steps.

    Every rank calls ``ray.train.report`` (Ray needs all of them); rank 0 writes the checkpoint
    (Lightning's DDP saves on rank 0 only) and hands it over, the others report metrics only.
    The metrics are the Trainer's ``callback_metrics`` plus ``epoch`` and ``step``.

    Args:
        every_n_steps: training steps (optimizer steps, ``trainer.global_step``) between reports.

    Raises:
        ValueError: `every_n_steps` is below 1.
    """

    def __init__(self, every_n_steps: int) -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._last_step = -1

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        step = trainer.global_step
        # global_step counts optimizer steps: with gradient accumulation several batches end on
        # one step (the first ones on step 0), which is reported once, after the batch that made it.
        if step == 0 or step == self._last_step or step % self.every_n_steps != 0:
            return
        self._last_step = step
        self.report(trainer)

    def report(self, trainer: pl.Trainer) -> None:
        """Save a checkpoint of `trainer` now and report it to Ray Train (all ranks must call)."""
        train = _ray_train()
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
        with tempfile.TemporaryDirectory(prefix="fastdata-ray-ckpt-") as folder:
            trainer.save_checkpoint(os.path.join(folder, CHECKPOINT_NAME), weights_only=False)
            # Ray's default upload mode copies the folder before `report` returns.
            checkpoint = train.Checkpoint.from_directory(folder) if trainer.is_global_zero else None
            train.report(metrics=metrics, checkpoint=checkpoint)


@contextmanager
def ray_checkpoint_path() -> Iterator[str | None]:
    """The Lightning checkpoint file of Ray Train's latest checkpoint, for ``trainer.fit``.

    Yields:
        The path of its ``checkpoint.ckpt`` (`RayStepCheckpoint`'s or `RayTrainReportCallback`'s),
        valid inside the ``with``; None when Ray has no checkpoint to resume from (a fresh run).

    Raises:
        FileNotFoundError: the Ray checkpoint holds no ``checkpoint.ckpt`` (saved by other code).
    """
    checkpoint = _ray_train().get_checkpoint()
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as folder:
        path = os.path.join(folder, CHECKPOINT_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"Ray checkpoint {checkpoint.path} holds no {CHECKPOINT_NAME} (files: "
                f"{sorted(os.listdir(folder))}): report checkpoints with RayStepCheckpoint or "
                "ray.train.lightning.RayTrainReportCallback, or pass its Lightning file yourself"
            )
        yield path
