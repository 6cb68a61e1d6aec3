"""Trainer presets: precision, activation checkpointing, DDP accumulation, mid-epoch resume.

    from fastdata.train import TrainPreset, make_trainer
    trainer = make_trainer(TrainPreset(precision="auto", activation_checkpointing=True,
                                       checkpoint_dir="runs/ckpt", checkpoint_every_n_steps=100),
                           max_epochs=10)

Modules: `precision` (the "auto" rule), `checkpointing` (activation checkpointing), `ddp`
(accumulation from a global batch size, strategies, gradient compression), `preset`
(`make_trainer`, step checkpoints for resume). The ``fastdata train`` command is
`fastdata.cli.train`.
"""

from __future__ import annotations

from fastdata.train.checkpointing import (
    ActivationCheckpointing,
    CheckpointPolicy,
    SavedTensorMeter,
    apply_activation_checkpointing,
    find_checkpoint_blocks,
)
from fastdata.train.ddp import (
    COMPRESSION_HOOKS,
    AccumulationCheck,
    accumulation_steps,
    end_process_group,
    make_strategy,
)
from fastdata.train.precision import HardwareFacts, detect_hardware, resolve_precision
from fastdata.train.preset import (
    LAST_CHECKPOINT,
    AtomicCheckpointIO,
    TrainPreset,
    last_checkpoint,
    make_trainer,
    step_checkpoint,
)

__all__ = [
    "COMPRESSION_HOOKS",
    "LAST_CHECKPOINT",
    "AccumulationCheck",
    "AtomicCheckpointIO",
    "ActivationCheckpointing",
    "CheckpointPolicy",
    "HardwareFacts",
    "SavedTensorMeter",
    "TrainPreset",
    "accumulation_steps",
    "apply_activation_checkpointing",
    "detect_hardware",
    "end_process_group",
    "find_checkpoint_blocks",
    "last_checkpoint",
    "make_strategy",
    "make_trainer",
    "resolve_precision",
    "step_checkpoint",
]
