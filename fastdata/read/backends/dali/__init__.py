"""The DALI backend: NVIDIA DALI reads the shards, decodes and augments (GPU, or CPU operators).

With a CUDA training device, JPEG/PNG are decoded by DALI's ``mixed`` decoders (nvJPEG and the
hardware JPEG decoder) and every crop, resize and flip runs on the GPU, so the batches come out
already augmented (``applied_ops`` = all the preset's ops): uint8 NCHW images on the training
device, normalized there by `ShardDataModule.on_after_batch_transfer` like every backend's, and
int64 labels. Without a GPU the same graph is built from DALI's CPU operators
(pipeline ``device_id=None``), which is what the tests exercise.

Presets: `build_graph` maps the preset's typed ops to a DALI graph (the semantics of
`fastdata.augment`): a `PadCrop` (zero-pad, random crop at integer offsets, flip), a
`RandomResizedCrop` + `Flip` fused with the decoder, a `ResizeCenterCrop`, or no op; a user's
`BatchTransform` cannot run in a DALI graph (ValueError naming the backends that can).

Epochs. The samples come from the epoch plan (`fastdata.read.plan`) through
``fn.external_source``: a Python source reads each planned batch's bytes from the shards by the
index offsets, so DALI yields exactly the plan's samples, order, batch sizes and padding (eval
padding labelled `PAD_LABEL`), the same as the cpu and memory backends; a resumed epoch starts
after the consumed samples without decoding them. DALI's random draws (crop offsets, flips) come
from DALI's generators seeded from (seed, epoch, rank, consumed), not from the plan's batch seeds.

Not supported here: ``on_error="skip"`` (DALI stops at a corrupt sample; shards are fully decoded
once at write time, so a corrupt sample means a damaged file).
"""

from __future__ import annotations

from fastdata.read.backends.dali.loader import (
    DaliLoader,
    dali_available,
    dali_status,
    make_dali_loader,
)

__all__ = ["DaliLoader", "dali_available", "dali_status", "make_dali_loader"]
