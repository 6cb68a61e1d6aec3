"""`DaliLoader`: one rank's epochs of a split, decoded by one DALI pipeline for the loader's life.

`PipelineLoader` is that life (build once, reset per pass, close), shared with the video loader
(`fastdata.read.backends.dali.video`); `DaliLoader` is the image loader over it.

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

__all__ = ["DaliLoader", "PipelineLoader", "dali_available", "dali_status", "make_dali_loader"]

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


# ---------------------------------------------------------------------------- loaders


class PipelineLoader(PlannedLoader):
    """A planned loader whose batches one DALI pipeline makes for the loader's life.

    The pipeline is built on the first pass (`_build`, whose one external source is
    `_next_inputs`) and reset at each pass's end, so the decoders start once: every later pass
    (epoch, resume, or a pass abandoned midway) finds it reset. A subclass starts each pass's
    inputs with `_start` and runs the pipeline with `_run`. `close()` deletes the pipeline and
    returns DALI's pooled memory.

    Attributes:
        device_id: the GPU DALI runs on (None: CPU operators).
        gpu: whether DALI runs on a GPU (``spec.device`` is CUDA and one is present).
        builds: pipelines built so far (one per loader unless it was closed).

    Args:
        spec: the loader spec.

    Raises:
        ImportError: DALI is not installed (the message says how to install it).
        ValueError: ``on_error="skip"`` or ``verify_samples`` (DALI can do neither).
    """

    def __init__(self, spec: LoaderSpec) -> None:
        self._dali = _dali()
        if spec.on_error != "raise":
            raise ValueError(
                f"the dali backend cannot skip corrupt samples (on_error={spec.on_error!r}); "
                "use backend='cpu' (or, for images, 'memory') with on_error='skip'"
            )
        if spec.verify_samples:
            raise ValueError(
                "the dali backend cannot check per-sample digests (verify_samples=True); "
                "use backend='cpu' (or, for images, 'memory')"
            )
        check_indexes(spec.manifest, spec.split)  # the shards' index files, checked once
        self.gpu = spec.device.startswith("cuda") and torch.cuda.is_available()
        self.device_id = _device_id(spec.device) if self.gpu else None
        self._pipe: Any = None
        self._feed: Iterator[tuple[Any, ...]] = iter(())
        self._clean = True  # no batch of an earlier pass left in the pipeline
        self.builds = 0

    def _build(self, options: dict[str, Any]) -> Any:
        """The built pipeline, with `options` (`Pipeline` arguments) and `_next_inputs` as its
        source."""
        raise NotImplementedError

    def _start(self, feed: Iterator[tuple[Any, ...]]) -> Any:
        """Begin a pass whose pipeline inputs are `feed`; the loader's pipeline, ready."""
        pipe = self._pipeline()
        self._feed, self._clean = feed, False
        return pipe

    def _run(self, number: int, total: int) -> Any:
        """The outputs of the pipeline's next batch (batch `number` of `total` planned)."""
        try:
            return self._pipe.run(self._stream())
        except StopIteration:
            raise RuntimeError(
                f"the dali pipeline of split {self.spec.split!r} ended after {number} of "
                f"{total} batches; this is a bug, please report it"
            ) from None

    def _pipeline(self) -> Any:
        """The loader's pipeline, built on the first pass; a later pass finds it reset."""
        if self._pipe is None:
            spec = self.spec
            self._pipe = self._build(
                {
                    "batch_size": spec.batch_size,
                    "threads": spec.workers.num_workers or min(4, os.cpu_count() or 1),
                    "device_id": self.device_id,
                    "prefetch": max(2, spec.workers.prefetch_factor),
                    "seed": _seed(spec.seed, spec.rank),  # no random operator: draws are fed
                }
            )
            self.builds += 1
            log.info("dali pipeline of split %r built: device_id=%s", spec.split, self.device_id)
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

    def _device(self) -> torch.device:
        """Where the batches are: the GPU DALI runs on, else the CPU."""
        return torch.device("cuda", self.device_id) if self.gpu else torch.device("cpu")

    def _torch(self, output: Any, dtype: torch.dtype) -> torch.Tensor:
        """A copy of one of a run's outputs (a uniform batch) as a torch tensor (DALI reuses its
        buffers)."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = output.as_tensor()
        x = torch.empty(dense.shape(), dtype=dtype, device=self._device())
        feed_ndarray(dense, x, cuda_stream=self._stream())
        return x

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

    def __enter__(self) -> PipelineLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DaliLoader(PipelineLoader):
    """Batches of one split on one rank, decoded (and cropped at decode time) by a DALI pipeline.

    Iterating yields the plan's batches of (uint8 (B, 3, H, W), int64 (B,)), on the training GPU
    when `spec.device` is CUDA and one is present, else on the CPU: the cpu backend's images (the
    same decode-time geometry, windows and flips, `fastdata.read.backends.dali.feed`; up to the
    resize kernels' rounding) with the same `applied_ops`, so the rest of the preset runs on the
    device as for every backend. `set_epoch` selects the epoch and the resume position (the plan
    then starts after the consumed samples; nothing is decoded for them). One pipeline for the
    loader's life (`PipelineLoader`).

    Attributes:
        decoder: the decoder's settings (hardware decoder load, buffer hints).

    Args:
        spec: the loader spec (split, batch size, seed, epoch, rank, world size, preset, device).
    """

    def __init__(self, spec: LoaderSpec) -> None:
        refuse_fields(spec, "dali")
        super().__init__(spec)
        info = spec.manifest.split(spec.split)
        geometry, self.applied_ops = decode_geometry(spec)  # the cpu backend's: ValueError too
        self.decoder = decoder_settings(info)
        self._shape = GraphShape(geometry, info.encoding == "raw", self.gpu, self.decoder)
        self._feeder = PlanFeeder(spec, self._shape)
        self.start_at(spec)

    def _build(self, options: dict[str, Any]) -> Any:
        log.info("dali decoder of split %r: %s", self.spec.split, self.decoder)
        return build_pipeline(self._shape, self._next_inputs, **options)

    def _iterate(self, plan: EpochPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._start(self._feeder.batches(plan))
        # keys=True: DALI yields every planned sample in plan order (on_error='raise' only).
        table = row_keys(self.spec) if self.spec.keys else None
        for number in range(len(plan.rows)):
            outputs = self._run(number, len(plan.rows))
            images = self._torch(outputs[0], torch.uint8)
            labels = self._torch(outputs[1], torch.int64).reshape(-1)
            if table is None:
                yield images, labels
                continue
            rows = plan.rows[number].tolist()
            pads = None if self.spec.train else plan.padding[number].tolist()
            yield images, labels, batch_keys(table, rows, pads)
        self._drain()


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
