"""`DaliLoader`: one rank's epochs of a split, read, decoded and augmented by a DALI pipeline.

The epoch length and shuffling rules are in the `fastdata.read.dali` package docstring.
`nvidia.dali` is imported on first use only (``import fastdata`` never needs it).
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastdata.read.base import BatchLoader, LoaderSpec, check_start_batch
from fastdata.read.dali.pipeline import _EXTS, GRAPHS, _graph
from fastdata.read.plan import epoch_order

__all__ = ["DaliLoader", "dali_available", "make_dali_loader", "rank_samples"]

READER_NAME = "Reader"
# The reader's shuffle buffer holds about this many bytes of encoded samples (bounded memory);
# shards are already pre-shuffled at write time and listed in a fresh order every epoch.
_SHUFFLE_BUFFER_BYTES = 64 << 20
_SHUFFLE_BUFFER_SAMPLES = (256, 8192)


def dali_available() -> bool:
    """True when NVIDIA DALI can be imported (and its PyTorch plugin loads)."""
    try:
        _dali()
    except Exception:  # noqa: BLE001 - a DALI built for another CUDA raises OSError, ...
        return False
    return True


def _dali() -> Any:
    """The `nvidia.dali` package, imported on first use (``import fastdata`` never needs it)."""
    try:
        import nvidia.dali
        import nvidia.dali.fn  # noqa: F401 - the operators
        import nvidia.dali.plugin.pytorch  # noqa: F401 - the iterator
    except ImportError as exc:
        raise ImportError(
            "the 'dali' backend needs NVIDIA DALI: `pip install fastdata[dali]` "
            "(or pick backend='cpu' / 'memory')"
        ) from exc
    return nvidia.dali


def rank_samples(total: int, world_size: int) -> int:
    """Samples every rank yields per epoch, padding included: ``ceil(total / world_size)``."""
    return math.ceil(total / world_size)


# ---------------------------------------------------------------------------- setup


@dataclass(frozen=True)
class _Setup:
    """Everything fixed at construction: files, sizes, threads, device."""

    paths: tuple[str, ...]
    index_paths: tuple[str, ...]
    shard_sizes: tuple[int, ...]
    ext: str
    per_rank: int
    total_batches: int
    last_batch: int  # samples in the last batch
    initial_fill: int
    num_threads: int
    device_id: int | None


def _check_files(spec: LoaderSpec) -> tuple[list[str], list[str]]:
    manifest = spec.manifest
    if "://" in manifest.root or manifest.root.startswith("pipe:"):
        raise ValueError(
            f"the dali backend reads local shard folders only, got {manifest.root!r}; "
            "copy the shards to a local disk or use backend='cpu'"
        )
    paths, index_paths = [], []
    for shard in manifest.split(spec.split).shards:
        tar, idx = manifest.shard_url(shard), manifest.index_url(shard)
        if not os.path.exists(tar):
            raise ValueError(
                f"shard {tar} is missing; re-run `fastdata shard` to rewrite the folder"
            )
        if not os.path.exists(idx):
            raise ValueError(
                f"shard {tar} has no DALI index {idx}; re-run `fastdata shard` to rewrite the folder"
            )
        paths.append(tar)
        index_paths.append(idx)
    return paths, index_paths


def _setup(spec: LoaderSpec, gpu: bool) -> _Setup:
    if spec.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {spec.batch_size}")
    if spec.world_size < 1 or not 0 <= spec.rank < spec.world_size:
        raise ValueError(f"need 0 <= rank < world_size, got {spec.rank}, {spec.world_size}")
    if spec.on_error != "raise":
        raise ValueError(
            f"the dali backend cannot skip corrupt samples (on_error={spec.on_error!r}); "
            "use backend='cpu' or 'memory' with on_error='skip'"
        )
    info = spec.manifest.split(spec.split)
    total = info.num_samples
    if total < spec.world_size:
        raise ValueError(
            f"split {spec.split!r} has {total} samples, fewer than the {spec.world_size} ranks"
        )
    paths, index_paths = _check_files(spec)
    per_rank = rank_samples(total, spec.world_size)
    drop = spec.drop_last and spec.train  # eval splits: every sample, no drop (as the others)
    batches = per_rank // spec.batch_size if drop else math.ceil(per_rank / spec.batch_size)
    last = spec.batch_size if drop else per_rank - (batches - 1) * spec.batch_size
    mean_bytes = max(1, sum(s.bytes for s in info.shards) // total)
    low, high = _SHUFFLE_BUFFER_SAMPLES
    fill = min(max(_SHUFFLE_BUFFER_BYTES // mean_bytes, low), high, per_rank)
    threads = spec.num_workers if spec.num_workers > 0 else min(4, os.cpu_count() or 1)
    device_id = None
    if gpu:
        device = torch.device(spec.device)
        device_id = device.index if device.index is not None else torch.cuda.current_device()
    return _Setup(
        tuple(paths),
        tuple(index_paths),
        tuple(s.num_samples for s in info.shards),
        _EXTS[info.encoding],
        per_rank,
        batches,
        last,
        max(1, fill),
        threads,
        device_id,
    )


def _seed(*parts: int) -> int:
    """A non-negative 31-bit seed mixed from integers (DALI seeds are signed 32-bit)."""
    entropy = [p % 2**63 for p in parts]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] & 0x7FFFFFFF)


def _shard_order(setup: _Setup, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's shard order of the CPU plan (`epoch_order`), empty shards left out."""
    order = epoch_order(list(setup.shard_sizes), seed, epoch, shuffle)
    shards, first = np.unique(order[:, 0], return_index=True)
    return [int(s) for s in shards[np.argsort(first)]]


# ---------------------------------------------------------------------------- loader


class DaliLoader:
    """Batches of one split on one rank, read, decoded and augmented by a DALI pipeline.

    Iterating yields `len(self)` batches of (float32 (B, 3, H, W) normalized, int64 (B,)), on the
    training GPU when `spec.device` is CUDA and one is present, else on the CPU. `set_epoch`
    selects the epoch (like `DistributedSampler.set_epoch`); a completed pass clears `start_batch`.
    Each pass builds its own pipeline and deletes it at the end; `close()` also returns DALI's
    pooled memory.

    Args:
        spec: the loader spec (split, batch size, seed, epoch, rank, world size, preset, device).
    """

    augmented = True

    def __init__(self, spec: LoaderSpec) -> None:
        self._dali = _dali()
        self.spec = spec
        self.gpu = spec.device.startswith("cuda") and torch.cuda.is_available()
        self._graph = _graph(spec, self.gpu)
        self._setup = _setup(spec, self.gpu)
        self._active: list[Any] = []  # the pass's [iterator, pipeline], deleted at its end
        self.set_epoch(spec.epoch, spec.start_batch)

    @property
    def total_batches(self) -> int:
        """Batches of a whole epoch on this rank."""
        return self._setup.total_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select epoch `epoch`, skipping its first `start_batch` batches (mid-epoch resume)."""
        self.epoch, self.start_batch = epoch, check_start_batch(start_batch, self.total_batches)

    def __len__(self) -> int:
        """Batches per epoch on this rank: the whole epoch, also when resuming mid-epoch (the
        CPU backend's convention: Lightning counts the restored batches towards the epoch)."""
        return self.total_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        setup, start = self._setup, self.start_batch
        if start >= setup.total_batches:
            self.start_batch = 0
            return
        self._release()  # a pass abandoned midway must not keep its pipeline alive
        iterator = self._build(self.epoch)
        try:
            seen = 0
            for number, outputs in zip(range(setup.total_batches), iterator, strict=False):
                seen = number + 1
                if number < start:
                    continue
                images, labels = outputs[0]["images"], outputs[0]["labels"]
                if seen == setup.total_batches and setup.last_batch < len(labels):
                    images, labels = images[: setup.last_batch], labels[: setup.last_batch]
                yield images, labels
            if seen < setup.total_batches:  # an invariant of the padding rule, not user input
                raise RuntimeError(
                    f"DALI ended the epoch after {seen} batches, expected "
                    f"{setup.total_batches}: reader metadata {self._reader_meta()}"
                )
            self.start_batch = 0
        finally:
            del iterator
            self._release()

    def close(self) -> None:
        """Delete the pipeline and give DALI's unused pooled memory back (host and device)."""
        self._release()
        gc.collect()
        release = getattr(self._dali.backend, "ReleaseUnusedMemory", None)
        if release is not None:  # DALI >= 1.23
            if self.gpu:
                torch.cuda.synchronize()
            release()

    def __enter__(self) -> DaliLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: DALI may already be gone
            pass

    # -------------------------------------------------------------------- internals

    def _build(self, epoch: int) -> Any:
        """Pipeline and iterator of one epoch (the first batch is already in flight)."""
        from nvidia.dali import Pipeline, fn, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        spec, setup, graph = self.spec, self._setup, self._graph
        order = _shard_order(setup, spec.seed, epoch, shuffle=spec.train)
        pipe = Pipeline(
            batch_size=spec.batch_size,
            num_threads=setup.num_threads,
            device_id=setup.device_id,
            seed=_seed(spec.seed, epoch, spec.rank),
            prefetch_queue_depth=max(1, spec.prefetch_factor),
        )
        with pipe:
            data, lid = fn.readers.webdataset(
                paths=[setup.paths[i] for i in order],
                index_paths=[setup.index_paths[i] for i in order],
                ext=[setup.ext, "lid"],
                dtypes=[types.UINT8, types.INT64],
                missing_component_behavior="error",
                shard_id=spec.rank,
                num_shards=spec.world_size,
                random_shuffle=spec.train,
                initial_fill=setup.initial_fill,
                pad_last_batch=True,
                stick_to_shard=False,
                name=READER_NAME,
            )
            images = GRAPHS[graph.preset](data, graph)
            labels = lid[0]  # lid = (int64 label, int64 sample_id)
            pipe.set_outputs(images, labels.gpu() if graph.gpu else labels)
        self._active = [pipe]
        iterator = DALIGenericIterator(
            pipe,
            ["images", "labels"],
            reader_name=READER_NAME,
            last_batch_policy=LastBatchPolicy.FILL,
        )
        self._active.append(iterator)
        return iterator

    def _reader_meta(self) -> dict[str, Any]:
        return self._active[0].reader_meta(READER_NAME) if self._active else {}

    def _release(self) -> None:
        # The iterator holds the pipeline: drop both, iterator first, so DALI shuts it down now.
        while self._active:
            self._active.pop()


def make_dali_loader(spec: LoaderSpec) -> BatchLoader:
    """The DALI loader of `spec.split` on `spec.rank` (see the `fastdata.read.dali` docstring)."""
    return DaliLoader(spec)
