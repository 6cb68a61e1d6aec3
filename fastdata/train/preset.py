"""`make_trainer`: a Lightning Trainer with the precision, memory, parallelism and resume presets.

    from fastdata.train import TrainPreset, make_trainer
    trainer = make_trainer(
        TrainPreset(global_batch_size=1024, batch_size=256, devices=2, checkpoint_dir="runs/x/ckpt",
                    checkpoint_every_n_steps=50),
        max_epochs=10,
    )
    trainer.fit(model, datamodule=dm, ckpt_path="last")  # "last": resume when runs/x/ckpt/last.ckpt exists

Resuming mid-epoch. The step checkpoint is taken in ``on_train_batch_end`` every N optimizer
steps and always overwrites ``last.ckpt``, atomically (`AtomicCheckpointIO`: a temporary file in
the same folder, fsync, rename), so a kill during a save leaves the previous checkpoint whole. It
holds the loops' progress (epoch, batches done in the epoch) and the DataModule's ``state_dict()``.
On ``fit(ckpt_path=...)`` Lightning 2.6 calls, in order: ``datamodule.setup("fit")``,
``datamodule.load_state_dict(...)``, restores model / optimizer / schedulers / loops, then
``train_dataloader()``; it calls ``iter()`` on that loader twice (once only to check that it is
iterable, the iterator is dropped) and continues the epoch at batch k + 1 without restarting it:
it expects the iterator to yield only the ``len(loader) - k`` remaining batches while
``len(loader)`` stays the full epoch, and its first ``next()`` comes after the loops were reset
(``trainer.current_epoch`` is then the epoch that runs, also when the checkpoint was taken at the
last batch of the previous one). `fastdata.lightning.datamodule.ShardDataModule` keeps that position.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import Strategy
from torch import nn

from fastdata.train.checkpointing import ActivationCheckpointing
from fastdata.train.ddp import AccumulationCheck, accumulation_steps, make_strategy
from fastdata.train.precision import HardwareFacts, detect_hardware, resolve_precision

__all__ = [
    "LAST_CHECKPOINT",
    "AtomicCheckpointIO",
    "TrainPreset",
    "last_checkpoint",
    "make_trainer",
    "step_checkpoint",
]

LAST_CHECKPOINT = "last.ckpt"
_PRESET_OWNED = ("precision", "strategy", "devices", "num_nodes", "accumulate_grad_batches")
# Strategies that save sharded checkpoints with their own IO.
_OWN_CHECKPOINT_IO = ("deepspeed", "fsdp")


@dataclass(frozen=True)
class TrainPreset:
    """Trainer settings that fastdata derives or checks for you.

    Args:
        precision: "auto" (see `fastdata.train.precision`) or a Lightning precision string.
        activation_checkpointing: False, True (repeated blocks / ``model.checkpoint_blocks``) or
            a set of module classes (see `fastdata.train.checkpointing`).
        global_batch_size: samples per optimizer step over all devices; with `batch_size` it
            sets ``accumulate_grad_batches``. None: no accumulation.
        batch_size: samples per micro-batch on each device (the DataModule's batch size).
        devices: devices (processes) per node.
        num_nodes: nodes.
        strategy: a Lightning strategy name or instance ("auto": DDP for several devices).
        grad_compression: None, "bf16" or "fp16" gradient all-reduce compression (CUDA DDP).
        checkpoint_dir: folder of ``last.ckpt``; None: no step checkpoints.
        checkpoint_every_n_steps: save every N optimizer steps (mid-epoch resume); None: at the end
            of every training epoch.
    """

    precision: str = "auto"
    activation_checkpointing: bool | frozenset[type[nn.Module]] = False
    global_batch_size: int | None = None
    batch_size: int | None = None
    devices: int = 1
    num_nodes: int = 1
    strategy: str | Strategy = "auto"
    grad_compression: str | None = None
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every_n_steps: int | None = None

    @property
    def world_size(self) -> int:
        """Processes over all nodes."""
        return self.devices * self.num_nodes


def make_trainer(
    preset: TrainPreset = TrainPreset(),
    *,
    max_epochs: int | None = None,
    callbacks: Sequence[Callback] = (),
    hardware: HardwareFacts | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    """A `lightning.Trainer` configured by `preset`.

    Args:
        preset: the settings (see `TrainPreset`).
        max_epochs: passed to the Trainer.
        callbacks: extra callbacks, after the preset's own.
        hardware: the machine's facts for precision="auto" (default: `detect_hardware()`).
        **trainer_kwargs: any other Trainer argument (accelerator, logger, limit_train_batches, ...).

    Raises:
        ValueError: for an argument the preset owns given in `trainer_kwargs`, bad devices /
            nodes, or settings the helpers reject (precision, accumulation, compression).
    """
    owned = sorted(set(trainer_kwargs) & set(_PRESET_OWNED))
    if owned:
        raise ValueError(f"set {owned} through TrainPreset, not as Trainer arguments")
    if preset.devices < 1 or preset.num_nodes < 1:
        raise ValueError(
            f"devices and num_nodes must be >= 1, got {preset.devices} and {preset.num_nodes}"
        )
    facts = hardware if hardware is not None else detect_hardware()
    accelerator = str(trainer_kwargs.get("accelerator", "auto"))
    on_cuda = accelerator in ("gpu", "cuda") or (
        accelerator == "auto" and facts.cuda_capability is not None
    )
    preset_callbacks: list[Callback] = [AccumulationCheck()]
    if preset.activation_checkpointing:
        preset_callbacks.append(ActivationCheckpointing(preset.activation_checkpointing))
    if preset.checkpoint_dir is not None:
        preset_callbacks.append(
            step_checkpoint(preset.checkpoint_dir, preset.checkpoint_every_n_steps)
        )
    plugins = list(trainer_kwargs.pop("plugins", None) or [])
    if _wants_atomic_io(preset.strategy, plugins):
        plugins.append(AtomicCheckpointIO())
    return pl.Trainer(
        plugins=plugins or None,
        precision=resolve_precision(preset.precision, facts, accelerator),
        strategy=make_strategy(
            preset.strategy, preset.world_size, preset.grad_compression, on_cuda
        ),
        devices=preset.devices,
        num_nodes=preset.num_nodes,
        accumulate_grad_batches=accumulation_steps(
            preset.global_batch_size, preset.batch_size, preset.world_size
        ),
        max_epochs=max_epochs,
        callbacks=[*preset_callbacks, *callbacks],
        **trainer_kwargs,
    )


def step_checkpoint(
    dirpath: str | os.PathLike[str], every_n_steps: int | None = None
) -> ModelCheckpoint:
    """A ModelCheckpoint that keeps one file, ``DIR/last.ckpt``, rewritten every `every_n_steps`
    optimizer steps (or at every training epoch end when None)."""
    if every_n_steps is not None and every_n_steps < 1:
        raise ValueError(f"checkpoint_every_n_steps must be >= 1 or None, got {every_n_steps}")
    by_epoch = every_n_steps is None
    return ModelCheckpoint(
        dirpath=os.fspath(dirpath),
        save_last=True,
        save_top_k=0,  # only last.ckpt: the resume point, not a model zoo
        every_n_train_steps=None if by_epoch else every_n_steps,
        every_n_epochs=1 if by_epoch else None,
        save_on_train_epoch_end=True if by_epoch else None,
        enable_version_counter=False,  # a new run in the same folder continues to write last.ckpt
    )


def last_checkpoint(dirpath: str | os.PathLike[str]) -> Path | None:
    """``DIR/last.ckpt`` when it exists (the resume point), else None."""
    path = Path(dirpath) / LAST_CHECKPOINT
    return path if path.is_file() else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves a local checkpoint to ``NAME.tmp-PID`` beside it, fsyncs, then renames it into place.

    Lightning's own save goes through an fsspec transaction whose temporary file is made in
    TMPDIR; when that is another file system (a tmpfs /tmp), the final step is a copy, and a kill
    during it leaves a truncated ``last.ckpt``. A rename within one folder is atomic. Remote paths
    ("s3://...") keep Lightning's behaviour.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        if storage_options is not None or "://" in os.fspath(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return None


def _wants_atomic_io(strategy: str | Strategy, plugins: list[Any]) -> bool:
    from lightning.pytorch.plugins.io import CheckpointIO

    if any(isinstance(p, CheckpointIO) for p in plugins):
        return False  # the caller chose one
    if isinstance(strategy, Strategy):
        return strategy._checkpoint_io is None
    return not strategy.startswith(_OWN_CHECKPOINT_IO)
