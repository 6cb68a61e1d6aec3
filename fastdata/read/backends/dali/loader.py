"""`DaliLoader`: one rank's epochs of a split, decoded by one DALI pipeline for the loader's life.

The samples come from the epoch plan (`fastdata.read.plan`), like every backend's: the pipeline's
one ``fn.external_source`` calls the loader for each batch's inputs, which `PlanFeeder` reads from
the shards (memory-mapped, by the index offsets) with the crop windows and flips the cpu backend
draws for those samples, so DALI yields exactly the plan's samples, order, batch sizes, padding
and crops. The pipeline is built once and reset at each pass's end. `nvidia.dali` is imported on
first use only (``import fastdata`` never needs it).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fastdata.format.integrity import check_indexes
from fastdata.read.backends.cpu_batches import decode_geometry
from fastdata.read.backends.dali.feed import PlanFeeder
from fastdata.read.backends.dali.pipeline import GraphShape, build_pipeline, decoder_settings
from fastdata.read.base import BatchLoader, LoaderSpec, PlannedLoader
from fastdata.read.decoders.dict_batch import refuse_fields
from fastdata.read.plan import EpochPlan
from fastdata.read.source_ids import batch_keys, row_keys

__all__ = ["DaliLoader", "dali_available", "dali_status", "make_dali_loader"]

log = logging.getLogger("fastdata")


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
    """Batches of one split on one rank, decoded (and cropped at decode time) by a DALI pipeline.

    Iterating yields the plan's batches of (uint8 (B, 3, H, W), int64 (B,)), on the training GPU
    when `spec.device` is CUDA and one is present, else on the CPU: the cpu backend's images (the
    same decode-time geometry, windows and flips, `fastdata.read.backends.dali.feed`; up to the
    resize kernels' rounding) with the same `applied_ops`, so the rest of the preset runs on the
    device as for every backend. `set_epoch` selects the epoch and the resume position (the plan
    then starts after the consumed samples; nothing is decoded for them).

    The pipeline is built on the first pass and kept for the loader's life: every later pass
    (epoch, resume, or a pass abandoned midway) resets it, so the decoders start once. `close()`
    deletes it and returns DALI's pooled memory.

    Attributes:
        decoder: the decoder's settings (hardware decoder load, buffer hints).
        device_id: the GPU DALI runs on (None: CPU operators).
        builds: pipelines built so far (one per loader unless it was closed).

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
        check_indexes(spec.manifest, spec.split)  # the shards' index files, checked once
        info = spec.manifest.split(spec.split)
        geometry, self.applied_ops = decode_geometry(spec)  # the cpu backend's: ValueError too
        self.gpu = spec.device.startswith("cuda") and torch.cuda.is_available()
        self.device_id = _device_id(spec.device) if self.gpu else None
        self.decoder = decoder_settings(info)
        self._shape = GraphShape(geometry, info.encoding == "raw", self.gpu, self.decoder)
        self._feeder = PlanFeeder(spec, self._shape)
        self._pipe: Any = None
        self._feed: Iterator[tuple[Any, ...]] = iter(())
        self._clean = True  # no batch of an earlier pass left in the pipeline
        self.builds = 0
        self.start_at(spec)

    def _iterate(self, plan: EpochPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        pipe = self._pipeline()
        # keys=True: DALI yields every planned sample in plan order (on_error='raise' only).
        table = row_keys(self.spec) if self.spec.keys else None
        self._feed, self._clean = self._feeder.batches(plan), False
        stream = self._stream()
        for number in range(len(plan.rows)):
            try:
                outputs = pipe.run(stream)
            except StopIteration:
                raise RuntimeError(
                    f"the dali pipeline of split {self.spec.split!r} ended after {number} of "
                    f"{len(plan.rows)} batches; this is a bug, please report it"
                ) from None
            images, labels = self._tensors(outputs, stream)
            if table is None:
                yield images, labels
                continue
            rows = plan.rows[number].tolist()
            pads = None if self.spec.train else plan.padding[number].tolist()
            yield images, labels, batch_keys(table, rows, pads)
        self._drain()

    def _pipeline(self) -> Any:
        """The loader's pipeline, built on the first pass; a later pass finds it reset."""
        if self._pipe is None:
            spec = self.spec
            self._pipe = build_pipeline(
                self._shape,
                self._next_inputs,
                batch_size=spec.batch_size,
                threads=spec.workers.num_workers or min(4, os.cpu_count() or 1),
                device_id=self.device_id,
                prefetch=max(2, spec.workers.prefetch_factor),
                seed=_seed(spec.seed, spec.rank),  # no random operator: the draws are fed
            )
            self.builds += 1
            log.info(
                "dali pipeline of split %r built: device_id=%s, decoder %s",
                spec.split, self.device_id, self.decoder,
            )  # fmt: skip
        else:
            self._drain()
        return self._pipe

    def _next_inputs(self) -> tuple[Any, ...]:
        """The pipeline's source: the next batch's inputs (StopIteration: the pass's end)."""
        return next(self._feed)

    def _drain(self) -> None:
        """End the current pass: batches already scheduled are dropped, the pipeline reset."""
        if self._clean or self._pipe is None:
            return
        self._feed = iter(())  # the source ends the epoch at its next call
        while True:
            try:
                self._pipe.run()
            except StopIteration:
                break
        self._pipe.reset()
        self._clean = True

    def _stream(self) -> Any:
        """The training device's current CUDA stream (None on the CPU): DALI's outputs are
        bound to it, so the copies below need no host synchronization."""
        return torch.cuda.current_stream(self.device_id) if self.gpu else None

    def _tensors(self, outputs: Any, stream: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a run's outputs as torch tensors (DALI reuses its buffers)."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        images, labels = outputs[0].as_tensor(), outputs[1].as_tensor()
        device = torch.device("cuda", self.device_id) if self.gpu else torch.device("cpu")
        x = torch.empty(images.shape(), dtype=torch.uint8, device=device)
        y = torch.empty(labels.shape(), dtype=torch.int64, device=device)
        feed_ndarray(images, x, cuda_stream=stream)
        feed_ndarray(labels, y, cuda_stream=stream)
        return x, y.reshape(-1)

    def close(self) -> None:
        """Delete the pipeline and give DALI's unused pooled memory back (host and device); a
        later pass builds a new one."""
        self._pipe, self._feed, self._clean = None, iter(()), True
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


def _device_id(device: str) -> int:
    """The GPU of a CUDA `device`: its index, else this process's local rank (``LOCAL_RANK``, set
    by Lightning and torchrun for each process of a node), else the current device."""
    index = torch.device(device).index
    if index is not None:
        return index
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.strip().isdigit():
        return int(local) % max(1, torch.cuda.device_count())
    return torch.cuda.current_device()


def _seed(*parts: int) -> int:
    """A non-negative 31-bit seed mixed from integers (DALI seeds are signed 32-bit)."""
    entropy = [p % 2**63 for p in parts]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] & 0x7FFFFFFF)


def make_dali_loader(spec: LoaderSpec) -> BatchLoader:
    """The DALI loader of `spec.split` on `spec.rank` (see the `fastdata.read.backends.dali` docstring)."""
    return DaliLoader(spec)
