"""`DaliLoader`: one rank's epochs of a split, decoded and augmented by a DALI pipeline.

The samples come from the epoch plan (`fastdata.read.plan`), like every backend's: a Python
source reads each planned batch's bytes from the shards (memory-mapped, by the index offsets) and
feeds them to DALI through ``fn.external_source``, so DALI yields exactly the plan's samples in the
plan's order and batch sizes, with its padding rule. `nvidia.dali` is imported on first use only
(``import fastdata`` never needs it).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fastdata.format.integrity import check_indexes
from fastdata.read.backends.dali.pipeline import build_graph
from fastdata.read.base import BatchLoader, LoaderSpec, PlannedLoader
from fastdata.read.decoders.dict_batch import refuse_fields
from fastdata.read.plan import EpochPlan
from fastdata.read.rows import RowReader
from fastdata.read.shardio import ShardReader
from fastdata.read.source_ids import batch_keys, row_keys

__all__ = ["DaliLoader", "dali_available", "dali_status", "make_dali_loader"]


def dali_status() -> tuple[bool, str]:
    """(DALI usable here, reason when not); never raises: a plugin built for another CUDA can
    fail with errors other than ImportError."""
    try:
        _dali()
    except Exception as exc:  # noqa: BLE001 - any failure means "not available", with its reason
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def dali_available() -> bool:
    """True when NVIDIA DALI can be imported and loaded."""
    return dali_status()[0]


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


# ---------------------------------------------------------------------------- loader


class DaliLoader(PlannedLoader):
    """Batches of one split on one rank, decoded and augmented by a DALI pipeline.

    Iterating yields the plan's batches of (uint8 (B, 3, H, W) augmented by every op of the
    preset (``applied_ops``), not normalized, as every backend's; int64 (B,)), on the training GPU
    when `spec.device` is CUDA and one is present, else on the CPU. `set_epoch`
    selects the epoch and the resume position (the plan then starts after the consumed samples;
    nothing is decoded for them). Each pass builds its own pipeline and deletes it at the end;
    `close()` also returns DALI's pooled memory.

    DALI's random augmentation draws come from its own generators, seeded from (seed, epoch, rank,
    consumed); they are not the plan's batch seeds, so the crops differ from the other backends'.

    Args:
        spec: the loader spec (split, batch size, seed, epoch, rank, world size, preset, device).
    """

    def __init__(self, spec: LoaderSpec) -> None:
        refuse_fields(spec, "dali")
        self._dali = _dali()
        if spec.on_error != "raise":
            raise ValueError(
                f"the dali backend cannot skip corrupt samples (on_error={spec.on_error!r}); "
                "use backend='cpu' or 'memory' with on_error='skip'"
            )
        if spec.verify_samples:
            raise ValueError(
                "the dali backend cannot check per-sample digests (verify_samples=True); "
                "use backend='cpu' or 'memory'"
            )
        check_indexes(spec.manifest, spec.split)  # DALI reads the index files unchecked
        self.gpu = spec.device.startswith("cuda") and torch.cuda.is_available()
        self._graph = build_graph(spec, self.gpu)  # ValueError for what DALI cannot fuse
        self.applied_ops = len(spec.preset.ops(spec.train))  # all of them: only normalizing is left
        self._active: list[Any] = []  # the pass's [pipeline, iterator], deleted at its end
        self.start_at(spec)

    def _iterate(self, plan: EpochPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._release()  # a pass abandoned midway must not keep its pipeline alive
        # keys=True: DALI yields every planned sample in plan order (on_error='raise' only).
        table = row_keys(self.spec) if self.spec.keys else None
        iterator = self._build(plan)
        try:
            for number, outputs in enumerate(iterator):
                images, labels = outputs[0]["images"], outputs[0]["labels"].reshape(-1)
                if table is None:
                    yield images, labels
                    continue
                rows = plan.rows[number].tolist()
                pads = None if self.spec.train else plan.padding[number].tolist()
                yield images, labels, batch_keys(table, rows, pads)
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

    def _source(self, plan: EpochPlan) -> Iterator[tuple[list[np.ndarray], list[np.ndarray]]]:
        """The plan's batches as DALI inputs: (sample bytes, int64 labels), one array each."""
        spec, sizes = self.spec, self.spec.shard_sizes
        reader = ShardReader(spec.manifest, spec.split, cache=spec.cache)
        rows = RowReader(reader, sizes, train=spec.train)  # on_error="raise" only
        try:
            for number in range(len(plan.rows)):
                data, labels = [], []
                read = rows.read(plan, number)
                for label, (_, image) in zip(read.labels, read.images, strict=True):
                    data.append(np.frombuffer(image, dtype=np.uint8).copy())
                    labels.append(np.array([label], dtype=np.int64))
                yield data, labels
        finally:
            reader.close()

    def _build(self, plan: EpochPlan) -> Any:
        """Pipeline and iterator of one pass over `plan`."""
        from nvidia.dali import Pipeline, fn, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        spec = self.spec
        threads = spec.workers.num_workers or min(4, os.cpu_count() or 1)
        device_id = None
        if self.gpu:
            device = torch.device(spec.device)
            device_id = device.index if device.index is not None else torch.cuda.current_device()
        pipe = Pipeline(
            batch_size=spec.batch_size,
            num_threads=threads,
            device_id=device_id,
            seed=_seed(spec.seed, plan.epoch, spec.rank, plan.consumed),
            prefetch_queue_depth=max(1, spec.workers.prefetch_factor),
        )
        with pipe:
            data, labels = fn.external_source(
                source=self._source(plan),
                num_outputs=2,
                batch=True,
                dtype=[types.UINT8, types.INT64],
            )
            images = self._graph(data)
            pipe.set_outputs(images, labels.gpu() if self.gpu else labels)
        self._active = [pipe]
        iterator = DALIGenericIterator(pipe, ["images", "labels"])
        self._active.append(iterator)
        return iterator

    def _release(self) -> None:
        # The iterator holds the pipeline: drop both, iterator first, so DALI shuts it down now.
        while self._active:
            self._active.pop()


def _seed(*parts: int) -> int:
    """A non-negative 31-bit seed mixed from integers (DALI seeds are signed 32-bit)."""
    entropy = [p % 2**63 for p in parts]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] & 0x7FFFFFFF)


def make_dali_loader(spec: LoaderSpec) -> BatchLoader:
    """The DALI loader of `spec.split` on `spec.rank` (see the `fastdata.read.backends.dali` docstring)."""
    return DaliLoader(spec)
