"""Activation checkpointing: keep only the inputs of repeated blocks, recompute the rest in backward.

A block's intermediate activations (conv outputs, BatchNorm inputs, attention scores) are what fills
memory during training; its input is small in comparison. Wrapping each repeated block with
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` saves only the block inputs and runs the
block's forward a second time during backward: about a third more compute for most of the
activation memory (figures: ``benchmarks/bench_checkpointing.py``).

Which blocks (`find_checkpoint_blocks`):

- ``True``: the blocks the model lists in a ``checkpoint_blocks`` attribute (modules or submodule
  names), else every child of an ``nn.Sequential`` / ``nn.ModuleList`` whose class occurs there at
  least twice and that has children of its own (ResNet stages, transformer layers; not single
  convs or activations), outermost first.
- a set of module classes: every module of those classes, outermost first.

The wrapping replaces the block's ``forward`` on the instance, so parameter names, ``state_dict``
keys and checkpoints are the same with and without it. Recomputation runs BatchNorm in training mode
a second time; the wrapper freezes running statistics during the recompute so they are updated
once per step, as without checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeAlias

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "ActivationCheckpointing",
    "CheckpointPolicy",
    "SavedTensorMeter",
    "apply_activation_checkpointing",
    "find_checkpoint_blocks",
]

#: ``True`` (auto-detect / ``model.checkpoint_blocks``), ``False`` (off), or module classes.
CheckpointPolicy: TypeAlias = bool | Iterable[type[nn.Module]]

_MARK = "_fastdata_checkpointed"
_CONTAINERS = (nn.Sequential, nn.ModuleList)


def find_checkpoint_blocks(model: nn.Module, policy: CheckpointPolicy = True) -> list[str]:
    """Qualified names of the blocks `policy` selects in `model` (see the module docstring).

    Raises:
        ValueError: when ``model.checkpoint_blocks`` names a module that is not in `model`, or
            `policy` is neither a bool nor module classes.
    """
    if policy is False:
        return []
    if policy is True:
        listed = getattr(model, "checkpoint_blocks", None)
        chosen = _listed_blocks(model, listed) if listed is not None else _repeated_children(model)
    else:
        types = tuple(policy)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
            raise ValueError(
                f"activation_checkpointing must be True, False or nn.Module classes, got {policy!r}"
            )
        chosen = {name for name, m in model.named_modules() if name and isinstance(m, types)}
    return _outermost(chosen)


def apply_activation_checkpointing(model: nn.Module, policy: CheckpointPolicy = True) -> list[str]:
    """Checkpoint the blocks of `model` that `policy` selects, in place; returns their names.

    Calling it again is harmless: a block is wrapped once.
    """
    modules = dict(model.named_modules())
    names = find_checkpoint_blocks(model, policy)
    for name in names:
        _wrap(modules[name])
    return names


class ActivationCheckpointing(pl.Callback):
    """Applies `apply_activation_checkpointing` to the LightningModule in ``setup``, before the
    strategy wraps it (DDP / FSDP see the checkpointed forward).

    Args:
        policy: ``True`` or module classes (see the module docstring).
    """

    def __init__(self, policy: CheckpointPolicy = True) -> None:
        self.policy = policy if isinstance(policy, bool) else frozenset(policy)
        self.wrapped: list[str] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.wrapped = apply_activation_checkpointing(pl_module, self.policy)
        if not self.wrapped:
            raise ValueError(
                f"activation checkpointing found no blocks in {type(pl_module).__name__} with "
                f"policy {self.policy!r}: list them as `checkpoint_blocks` on the module or pass "
                "their classes"
            )


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward inside a ``with`` block.

    Each saved tensor is counted once per storage (views and repeated saves of one tensor share
    it), by the storage's size; storages in `exclude` (parameters, alive anyway) are not counted.

    Args:
        exclude: tensors whose storages are not counted (e.g. ``model.parameters()``).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self._seen: dict[tuple[str, int], int] = {}

    @property
    def bytes(self) -> int:
        """Bytes of distinct saved storages seen so far."""
        return sum(self._seen.values())

    @contextlib.contextmanager
    def measure(self) -> Iterator[SavedTensorMeter]:
        """Context in which saved tensors are counted."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._exclude and key[1] != 0:
            self._seen[key] = max(self._seen.get(key, 0), tensor.untyped_storage().nbytes())
        return tensor


# ----------------------------------------------------------------------------- helpers
def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _listed_blocks(model: nn.Module, listed: Iterable[nn.Module | str]) -> set[str]:
    names = {id(m): name for name, m in model.named_modules()}
    chosen = set()
    for block in listed:
        name = block if isinstance(block, str) else names.get(id(block))
        if name is None or (isinstance(block, str) and block not in dict(model.named_modules())):
            raise ValueError(
                f"{type(model).__name__}.checkpoint_blocks lists {block!r}, which is not a "
                "submodule of the model"
            )
        chosen.add(name)
    return chosen


def _repeated_children(model: nn.Module) -> set[str]:
    chosen: set[str] = set()
    for name, container in model.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        by_type: dict[type, list[str]] = {}
        for child_name, child in container.named_children():
            if next(child.children(), None) is not None:  # a composite block, not a single layer
                by_type.setdefault(type(child), []).append(_join(name, child_name))
        chosen.update(n for group in by_type.values() if len(group) >= 2 for n in group)
    return chosen


def _outermost(names: Iterable[str]) -> list[str]:
    ordered = sorted(set(names), key=lambda n: (n.count("."), n))
    kept: list[str] = []
    for name in ordered:
        if not any(name.startswith(k + ".") for k in kept):
            kept.append(name)
    return kept


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _wrap(module: nn.Module) -> None:
    if getattr(module, _MARK, False):
        return
    # An instance attribute shadows the class's forward (nn.Module.__call__ looks it up per call).
    # It holds the module, not a bound method, so the module still pickles (ddp_spawn) and deep-copies.
    inner = module.__dict__.get("forward")  # an instance-level forward set by someone else: keep it
    module.forward = functools.partial(_checkpointed_forward, module, inner)
    setattr(module, _MARK, True)


def _checkpointed_forward(
    module: nn.Module, inner: Callable[..., Any] | None, *args: Any, **kwargs: Any
) -> Any:
    forward = inner if inner is not None else functools.partial(type(module).forward, module)
    if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, skip the machinery
        return forward(*args, **kwargs)
    context_fn = functools.partial(_contexts, module)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _contexts(
    module: nn.Module,
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), _frozen_norm_stats(module)


@contextlib.contextmanager
def _frozen_norm_stats(module: nn.Module) -> Iterator[None]:
    """During the recompute: BatchNorm uses batch statistics as before but does not update its
    running statistics again (momentum 0 keeps them; the batch counter is put back)."""
    norms = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    saved = [(m, m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, count in saved:
            m.momentum = momentum
            m.num_batches_tracked.copy_(count)
