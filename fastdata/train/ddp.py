"""Data parallelism: gradient accumulation from a global batch size, the strategy, gradient compression.

Accumulation without extra communication. With ``accumulate_grad_batches = k`` Lightning runs the
first ``k - 1`` micro-batches of every optimizer step inside ``strategy.block_backward_sync()``,
which is ``DistributedDataParallel.no_sync()`` (lightning/pytorch/loops/optimization/automatic.py:
``_block_parallel_sync_behavior``; lightning/pytorch/strategies/parallel.py:
``block_backward_sync``), so gradients are all-reduced once per optimizer step, on the k-th
backward. That holds for automatic optimization; a module with manual optimization must skip the
sync itself (``with self.trainer.strategy.block_backward_sync(): self.manual_backward(loss)``),
and `AccumulationCheck` warns when it would not.

Metrics. ``self.log(..., sync_dist=True)`` all-reduces on every call it is computed for; log
per-step values with ``sync_dist=False`` (rank-local) and reduce only epoch aggregates:
``self.log(name, value, on_step=False, on_epoch=True, sync_dist=True)``. That is one small
collective per metric per epoch instead of one per step.

Gradient compression (``"bf16"`` / ``"fp16"``) registers PyTorch's
``default_hooks.bf16_compress_hook`` / ``fp16_compress_hook`` through
``DDPStrategy(ddp_comm_hook=...)``: gradients travel at half the bytes and are averaged back in
fp32. Lightning registers DDP communication hooks on CUDA devices only, so it is refused on CPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn

__all__ = [
    "COMPRESSION_HOOKS",
    "AccumulationCheck",
    "accumulation_steps",
    "end_process_group",
    "make_strategy",
]

#: grad_compression name -> hook name in torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
COMPRESSION_HOOKS: dict[str, str] = {"bf16": "bf16_compress_hook", "fp16": "fp16_compress_hook"}

#: DDP strategy names -> DDPStrategy start method (used when a hook must be passed).
_DDP_START_METHODS: dict[str, str] = {
    "ddp": "popen",
    "ddp_spawn": "spawn",
    "ddp_fork": "fork",
    "ddp_notebook": "fork",
}


def _has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _has_fsdp() -> bool:
    return torch.distributed.is_available()


#: Strategy name prefix -> (availability check, what to install).
_OPTIONAL_STRATEGIES: dict[str, tuple[Callable[[], bool], str]] = {
    "deepspeed": (_has_deepspeed, "pip install deepspeed"),
    "fsdp": (_has_fsdp, "a PyTorch build with torch.distributed"),
}


def accumulation_steps(
    global_batch_size: int | None, batch_size: int | None, world_size: int
) -> int:
    """Micro-batches per optimizer step: ``global_batch_size / (batch_size * world_size)``.

    Args:
        global_batch_size: samples per optimizer step over all devices; None means no accumulation.
        batch_size: samples per micro-batch on one device.
        world_size: number of processes (devices x nodes).

    Raises:
        ValueError: when the division is not a positive integer (the message has the figures).
    """
    if global_batch_size is None:
        return 1
    if batch_size is None or batch_size < 1 or world_size < 1:
        raise ValueError(
            f"global_batch_size={global_batch_size} needs the per-device batch_size (got {batch_size}) "
            f"and world_size >= 1 (got {world_size})"
        )
    per_micro_step = batch_size * world_size
    steps, rest = divmod(global_batch_size, per_micro_step)
    if rest or steps < 1:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of batch_size x world_size = "
            f"{batch_size} x {world_size} = {per_micro_step}; choose a global batch size of "
            f"{max(steps, 1) * per_micro_step} or {(steps + 1) * per_micro_step}, or another batch_size"
        )
    return steps


def make_strategy(
    strategy: str | Strategy, world_size: int, grad_compression: str | None, on_cuda: bool
) -> str | Strategy:
    """The Trainer's ``strategy`` argument for these settings.

    A Strategy instance and plain names pass through (Lightning picks DDP for ``"auto"`` with
    several devices); optional strategies ("deepspeed*", "fsdp*") are checked to be installed;
    with `grad_compression` a `DDPStrategy` carrying the compression hook is built.

    Raises:
        ValueError: for compression without CUDA, with one process, or with a non-DDP strategy;
            ImportError: for an optional strategy that is not installed.
    """
    if isinstance(strategy, str):
        for prefix, (available, install) in _OPTIONAL_STRATEGIES.items():
            if strategy.startswith(prefix) and not available():
                raise ImportError(
                    f"strategy={strategy!r} is not available here: it needs {install}"
                )
    if grad_compression is None:
        return strategy
    if grad_compression not in COMPRESSION_HOOKS:
        raise ValueError(
            f"grad_compression must be None or one of {sorted(COMPRESSION_HOOKS)}, got {grad_compression!r}"
        )
    if not on_cuda:
        raise ValueError(
            f"grad_compression={grad_compression!r} needs CUDA devices: Lightning registers DDP "
            "communication hooks only there"
        )
    if world_size < 2:
        raise ValueError(
            f"grad_compression={grad_compression!r} needs more than one process, got {world_size}"
        )
    name = "ddp" if strategy == "auto" else strategy
    if not isinstance(name, str) or name not in _DDP_START_METHODS:
        raise ValueError(
            f"grad_compression works with the DDP strategies {sorted(_DDP_START_METHODS)} or 'auto', "
            f"not {strategy!r}; pass DDPStrategy(ddp_comm_hook=...) yourself for other setups"
        )
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = getattr(default_hooks, COMPRESSION_HOOKS[grad_compression])
    return DDPStrategy(ddp_comm_hook=hook, start_method=_DDP_START_METHODS[name])


class AccumulationCheck(pl.Callback):
    """Warns at fit start when accumulated micro-batches would each all-reduce gradients: the
    module uses manual optimization (Lightning only skips the sync for automatic optimization)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (
            trainer.accumulate_grad_batches > 1
            and trainer.world_size > 1
            and not pl_module.automatic_optimization
        ):
            rank_zero_warn(
                f"{type(pl_module).__name__} uses manual optimization with accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}: wrap the backward of non-stepping micro-batches in "
                "`self.trainer.strategy.block_backward_sync()` or every micro-batch all-reduces gradients"
            )


def end_process_group(timeout_s: float = 120.0) -> None:
    """Tear down torch.distributed's default process group, if one is up, after a bounded barrier.

    Call it once at the end of a DDP script, after the last `trainer.fit`/`validate`/`test`.
    A gloo group left for the interpreter's exit to destroy can abort the process ("terminate
    called without an active exception", exit -6), so a run whose work all succeeded fails under
    any scheduler. No-op without a process group.

    Args:
        timeout_s: the most seconds the closing barrier waits for the other ranks (gloo's
            `monitored_barrier`, which names the ranks that did not arrive).

    Raises:
        RuntimeError: a rank did not reach the barrier within `timeout_s` (the group is still
            destroyed).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
        else:
            dist.barrier()
    finally:
        dist.destroy_process_group()
