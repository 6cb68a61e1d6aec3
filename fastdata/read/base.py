"""The contract every read backend meets (see docs/DESIGN.md, "Reader contract").

A backend turns a `LoaderSpec` into a `BatchLoader`: the batches of one split on one rank, in the
order of the epoch plan (`fastdata.read.plan`), which every backend consumes the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from fastdata.augment import Preset, get_preset
from fastdata.format.carve import Carve
from fastdata.format.manifest import Manifest
from fastdata.read.plan import EpochMix, EpochPlan, PlanConfig, plan_epoch
from fastdata.read.schedule import ScheduledMix
from fastdata.read.shuffle import ShuffleMode, check_shuffle, node_window

__all__ = [
    "DEFAULT_LOADER_TIMEOUT",
    "BatchLoader",
    "LoaderSpec",
    "PlannedLoader",
    "WorkerSettings",
]

# Seconds a loader waits for one worker's batch: far above a batch's time on a slow, busy machine
# (a large remote shard's first download included), and still an error, not a hang, at a stall.
DEFAULT_LOADER_TIMEOUT = 600.0


@runtime_checkable
class BatchLoader(Protocol):
    """Batches of one split on one rank for one epoch.

    Attributes:
        normalized: True when the batches are already augmented and normalized floats (nothing
            is left for `ShardDataModule.on_after_batch_transfer`). The built-in backends never
            are: every one yields uint8 batches, the one rule users see.
        applied_ops: when not `normalized`, how many leading ops of the preset's op list for the
            split the backend applied (fused at decode time); the DataModule applies the rest.
    """

    normalized: bool
    applied_ops: int

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int, consumed: int = 0, steps_before: int = 0) -> None: ...


@dataclass(frozen=True)
class WorkerSettings:
    """How a backend runs its loading work.

    Args:
        num_workers: DataLoader worker processes (cpu backend), or DALI CPU threads.
        prefetch_factor: batches prefetched per worker (ignored when num_workers == 0).
        decode_threads: threads decoding one batch's images inside each worker / process.
            These three may be "auto" where a `ShardDataModule` takes them (`workers=`): it
            measures them (`fastdata.tune`) before building a loader, which gets numbers.
        pin_memory: pin batches for faster host-to-GPU copies; None: when CUDA is available.
        persistent_workers: keep workers between epochs; None: when there are workers.
        timeout: seconds a DataLoader waits for a worker's batch before raising (0: forever;
            default `DEFAULT_LOADER_TIMEOUT`).
        mp_context: worker start method ("fork", "spawn", "forkserver"); None: "spawn" once CUDA
            is initialized in this process (forking it is unsafe), else the platform default.
    """

    num_workers: int | Literal["auto"] = 0
    prefetch_factor: int | Literal["auto"] = 2
    decode_threads: int | Literal["auto"] = 1
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    timeout: float = DEFAULT_LOADER_TIMEOUT
    mp_context: str | None = None


@dataclass(frozen=True)
class LoaderSpec:
    """What a backend needs to build the loader of one split on one rank.

    Args:
        manifest: the shard folder's manifest.
        split: split name ("train", "val", "test").
        train: True for the training split (shuffle, augment, plain padding); False for
            evaluation (row order, padding marked with `plan.PAD_LABEL`).
        batch_size: samples per batch on this rank.
        preset: the augmentation preset (a `Preset`, or a preset name resolved with
            `image_size`); backends read only its typed fields (`decode_crop`, `pad_crop`).
        seed: base seed; every random choice derives from it through the plan.
        epoch: the first epoch iterated (`BatchLoader.set_epoch` selects others).
        consumed: samples of that epoch already consumed by all ranks (resume).
        steps_before: batches each rank already took in that epoch (resume).
        rank: global rank of this process.
        world_size: number of processes.
        image_size: output side of photos; None keeps the stored size (raw data).
        on_error: "raise" (default) or "skip" for corrupt samples at read time.
        device: the training device ("cpu", "cuda:0"); backends that place data there use it.
        drop_last: drop the last short step of a training epoch (every rank alike).
        workers: processes, threads and prefetching (`WorkerSettings`).
        cache: a remote shard cache passed to the shard readers (None: local shards, or the
            default cache for a remote manifest).
        mix: for the training split of a mix of datasets (`fastdata.read.mix`), the rows each
            epoch draws from each dataset (plan rule 0), or a scheduled mix (rule 7); None: every
            row once per epoch.
        carve: read one side of a val split carved from `split` (`fastdata.format.carve`): the
            training rows or the carved val rows; None: every row.
        decoded_cache_dir: where the memory backend caches decoded splits
            (`fastdata.read.stores.decoded_cache.resolve_cache_dir`); None: its default.
        verify_samples: hash every sample read and compare it with its digest written at shard
            time (`fastdata.format.integrity`); cpu and memory backends only.
        ignore_index: dict batches (`fastdata.read.decoders.dict_batch`): the mask value of pixels outside
            the image after a pad-crop and of evaluation padding samples.
        keys: hand each batch's sample keys over with it (`fastdata.read.source_ids`): a dict
            batch's ``key`` list, a classification batch's third element (None: padding).
        shuffle: the training shuffle (plan rule 1, `fastdata.read.shuffle`): "window" (blocks
            spanning many shards), "shard" (shard by shard) or "full" (a permutation).
        window: the "window" shuffle's size in samples; None: sized from this node once, when
            the spec is made (`fastdata.read.shuffle.node_window`). Ranks must agree on it
            (it is part of the epoch order): a `ShardDataModule` gives every rank rank 0's.
    """

    manifest: Manifest
    split: str
    train: bool
    batch_size: int
    preset: Preset | str = "none"
    seed: int = 0
    epoch: int = 0
    consumed: int = 0
    steps_before: int = 0
    rank: int = 0
    world_size: int = 1
    image_size: int | None = None
    on_error: str = "raise"
    device: str = "cpu"
    drop_last: bool = False
    workers: WorkerSettings = field(default_factory=WorkerSettings)
    cache: Any = None
    mix: EpochMix | ScheduledMix | None = None
    carve: Carve | None = None
    decoded_cache_dir: str | None = None
    verify_samples: bool = False
    ignore_index: int = 255
    keys: bool = False
    shuffle: ShuffleMode = "window"
    window: int | None = None

    def __post_init__(self) -> None:
        check_shuffle(self.shuffle)
        if self.window is not None:
            check_shuffle(self.window)
        elif self.train and self.shuffle == "window":
            # Resolved once: workers get this value with the spec, not their own measure.
            window = node_window(self.manifest, self.split, self.cache)
            object.__setattr__(self, "window", window)
        if isinstance(self.preset, str):
            object.__setattr__(self, "preset", get_preset(self.preset, self.image_size))
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"need world_size >= 1 and 0 <= rank < world_size, got {self.rank}, {self.world_size}"
            )
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")

    @property
    def epoch_samples(self) -> int:
        """Samples in one epoch: a training mix's draws, a carve's side, else the split's size."""
        if self.mix is not None and self.train:
            return self.mix.total
        if self.carve is not None:
            return self.carve.count(sum(self.shard_sizes))
        return sum(self.shard_sizes)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Samples per shard of the split, in manifest order."""
        return tuple(s.num_samples for s in self.manifest.split(self.split).shards)

    def plan(self, epoch: int, consumed: int = 0, steps_before: int = 0) -> EpochPlan:
        """This rank's plan of `epoch` from `consumed` samples on (`fastdata.read.plan`).

        The last plan is kept: the DataModule, the backend and `len()` ask for the same one
        several times an epoch, and a large split's plan costs ~0.1 s (a mix's ~0.4 s).
        """
        key = (epoch, consumed, steps_before)
        last = self.__dict__.get("_last_plan")
        if last is not None and last[0] == key:
            return last[1]
        plan = self._plan(epoch, consumed, steps_before)
        object.__setattr__(self, "_last_plan", (key, plan))  # a cache, not a field
        return plan

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_last_plan", None)  # workers started by spawn compute their own
        return state

    def _plan(self, epoch: int, consumed: int, steps_before: int) -> EpochPlan:
        config = PlanConfig(
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            shuffle=self.train,
            drop_last=self.drop_last and self.train,
            mix=self.mix if self.train else None,
            carve=self.carve,
            shuffle_mode=self.shuffle,
            window=self.window,
        )
        return plan_epoch(self.shard_sizes, config, epoch, consumed, steps_before)


class PlannedLoader(ABC):
    """What every backend's loader shares: the selected epoch and position, its plan, the length
    and the opening of an iteration. A backend writes only how it produces a plan's batches.

    A subclass sets `spec` and calls `set_epoch(spec.epoch, spec.consumed, spec.steps_before)`
    in its constructor (`start_at(spec)`), and implements `_iterate`; `_select` is its hook for
    a position its workers must see too (the cpu backend's shared state).

    Attributes:
        spec: the loader spec.
        plan: this rank's plan of the selected epoch from the selected position.
        position: the selected (epoch, consumed, steps before).
        normalized: always False for the built-in backends (uint8 batches).
    """

    normalized = False
    spec: LoaderSpec
    plan: EpochPlan
    position: tuple[int, int, int]

    def start_at(self, spec: LoaderSpec) -> None:
        """Keep `spec` and select the epoch and position it names."""
        self.spec = spec
        self.set_epoch(spec.epoch, spec.consumed, spec.steps_before)

    def set_epoch(self, epoch: int, consumed: int = 0, steps_before: int = 0) -> None:
        """Select epoch `epoch`'s plan from `consumed` samples on (resume).

        Raises:
            ValueError: the position is not one of the epoch's (from the plan).
        """
        # The plan object is kept, not recomputed from the spec's one-entry cache: len() of a
        # training loader asks the spec for other epochs' plans between two iterations.
        self.plan = self.spec.plan(epoch, consumed, steps_before)
        self.position = (epoch, consumed, steps_before)
        self._select(epoch, consumed, steps_before)

    def _select(self, epoch: int, consumed: int, steps_before: int) -> None:  # noqa: B027 - optional hook
        """A subclass's hook: the position was selected (nothing to do by default)."""

    def __len__(self) -> int:
        """Batches per rank this epoch, counting those taken before a resume."""
        return len(self.plan)

    def __iter__(self) -> Iterator[Any]:
        plan = self.plan
        if not plan.rows:  # nothing to produce: start no pipeline, worker or reader
            return iter(())
        return self._iterate(plan)

    @abstractmethod
    def _iterate(self, plan: EpochPlan) -> Iterator[Any]:
        """The batches of `plan` (not empty), in its order."""
