"""DDP with gradient accumulation: accumulation arithmetic, strategy checks, and a 2-process run.

The 2-process run trains this file as a script (``python test_ddp_accumulation.py OUT``): Lightning's
DDP launcher starts rank 1 by re-running the same command, so the worker code lives here, under
``__main__``. It counts gradient all-reduces with a DDP communication hook and records the
parameters; the test compares them with one plain SGD step over the same global batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from fastdata.train import (
    AtomicCheckpointIO,
    TrainPreset,
    accumulation_steps,
    make_strategy,
    make_trainer,
)
from fastdata.train.ddp import end_process_group
from fastdata.train.precision import HardwareFacts

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, MICRO_BATCH, WORLD, STEPS, LR = 32, 4, 2, 2, 0.5
ACCUMULATE = GLOBAL_BATCH // (MICRO_BATCH * WORLD)


# ----------------------------------------------------------------------------- arithmetic / checks
def test_accumulation_steps() -> None:
    assert accumulation_steps(None, None, 4) == 1
    assert accumulation_steps(1024, 128, 2) == 4
    assert accumulation_steps(256, 256, 1) == 1
    with pytest.raises(ValueError, match=r"1000 .* 128 x 2 = 256"):
        accumulation_steps(1000, 128, 2)
    with pytest.raises(ValueError, match="per-device batch_size"):
        accumulation_steps(1024, None, 2)
    with pytest.raises(ValueError, match="64 .* 128 x 1"):
        accumulation_steps(64, 128, 1)


def test_grad_compression_is_a_ddp_comm_hook_on_cuda_only() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    strategy = make_strategy("auto", world_size=2, grad_compression="bf16", on_cuda=True)
    assert isinstance(strategy, DDPStrategy)
    assert strategy._ddp_comm_hook is default_hooks.bf16_compress_hook
    assert (
        make_strategy("ddp_spawn", 2, "fp16", True)._ddp_comm_hook
        is default_hooks.fp16_compress_hook
    )
    with pytest.raises(ValueError, match="needs CUDA"):
        make_strategy("auto", 2, "bf16", on_cuda=False)
    with pytest.raises(ValueError, match="more than one process"):
        make_strategy("auto", 1, "bf16", on_cuda=True)
    with pytest.raises(ValueError, match="'int8'"):
        make_strategy("auto", 2, "int8", on_cuda=True)
    with pytest.raises(ValueError, match="DDP strategies"):
        make_strategy("fsdp", 2, "bf16", on_cuda=True)
    assert make_strategy("ddp", 2, None, on_cuda=False) == "ddp"


def test_optional_strategy_not_installed_is_named() -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here")
    with pytest.raises(ImportError, match="pip install deepspeed"):
        make_strategy("deepspeed_stage_2", 2, None, on_cuda=True)


def test_make_trainer_wires_the_preset(tmp_path: Path) -> None:
    cpu = HardwareFacts(cuda_capability=None, cpu_bf16=False)
    trainer = make_trainer(
        TrainPreset(
            global_batch_size=64, batch_size=16, checkpoint_dir=tmp_path, checkpoint_every_n_steps=3
        ),
        max_epochs=1,
        hardware=cpu,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
    )
    assert trainer.accumulate_grad_batches == 4
    assert trainer.precision == "32-true"
    assert trainer.checkpoint_callback.dirpath == str(tmp_path)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        make_trainer(TrainPreset(), accumulate_grad_batches=2)


def test_atomic_checkpoint_io_replaces_the_file_whole(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "ckpt" / "last.ckpt"
    io.save_checkpoint({"step": 1}, target)
    io.save_checkpoint({"step": 2, "big": torch.zeros(1000)}, target)
    assert torch.load(target, weights_only=False)["step"] == 2
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # no temporary left


# ----------------------------------------------------------------------------- 2-process run
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * GLOBAL_BATCH, 8, generator=g), torch.randint(
        0, 4, (STEPS * GLOBAL_BATCH,), generator=g
    )


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)
    )  # no BatchNorm: no cross-sample state


class _Module(pl.LightningModule):
    """Plain SGD; rank r trains on its half of each global batch, in micro-batches, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.micro = -1

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        self.micro = batch_idx
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        x, y = _data()
        rank, half = self.trainer.global_rank, GLOBAL_BATCH // WORLD
        batches = []
        for step in range(STEPS):
            lo = step * GLOBAL_BATCH + rank * half
            for m in range(ACCUMULATE):
                s = slice(lo + m * MICRO_BATCH, lo + (m + 1) * MICRO_BATCH)
                batches.append((x[s], y[s]))
        return DataLoader(batches, batch_size=None)  # the prepared batches, as they are


class _Recorder(pl.Callback):
    """Registers a counting all-reduce hook; records parameters after each optimizer step."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        # Unannotated: DDP rejects a string annotation (from __future__ import annotations).
        def counting_hook(state, bucket):  # noqa: ANN001, ANN202
            self.calls.append(pl_module.micro)
            return default_hooks.allreduce_hook(None, bucket)

        # Lightning registers comm hooks only on CUDA; on CPU the test registers its own on the DDP model.
        trainer.strategy.model.register_comm_hook(None, counting_hook)
        self.params.append(_state(pl_module))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object
    ) -> None:
        if len(self.params) == trainer.global_step:  # an optimizer step just happened
            self.params.append(_state(pl_module))


def _state(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def _worker(out: Path) -> None:
    recorder = _Recorder()
    trainer = make_trainer(
        TrainPreset(
            precision="32-true",
            global_batch_size=GLOBAL_BATCH,
            batch_size=MICRO_BATCH,
            devices=WORLD,
        ),
        max_epochs=1,
        callbacks=[recorder],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(_Module())
    torch.save(
        {
            "calls": recorder.calls,
            "params": recorder.params,
            "accumulate": trainer.accumulate_grad_batches,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


@pytest.mark.slow
def test_two_process_ddp_syncs_once_per_step_and_matches_one_process(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = ["timeout", "-k", "10", "240", sys.executable, __file__, str(tmp_path)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    last_micro = [ACCUMULATE * (s + 1) - 1 for s in range(STEPS)]
    for rank in ranks:
        assert rank["accumulate"] == ACCUMULATE
        assert rank["calls"] == last_micro  # one all-reduce, on the stepping micro-batch only

    # The same optimizer steps in one process over the whole global batch.
    net, (x, y) = _net(), _data()
    net.load_state_dict(ranks[0]["params"][0])
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        s = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        F.cross_entropy(net(x[s]), y[s]).backward()
        opt.step()
        for rank in ranks:
            for name, value in net.state_dict().items():
                torch.testing.assert_close(
                    rank["params"][step + 1][name], value, msg=f"step {step} {name}"
                )


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    end_process_group()


def test_end_process_group_tears_down_the_group_and_is_a_no_op_without_one(tmp_path: Path) -> None:
    import torch.distributed as dist

    end_process_group()  # no group: nothing to do
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert dist.is_initialized()
    end_process_group(timeout_s=10)
    assert not dist.is_initialized()
