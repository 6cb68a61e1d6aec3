"""The DALI backend: NVIDIA DALI decodes the plan's samples with the cpu backend's crops (GPU, or
CPU operators).

With a CUDA training device, JPEGs are decoded by DALI's ``mixed`` decoders (nvJPEG and the
hardware JPEG decoder) and the crops resized on the GPU, so the batches come out on the training
device: uint8 NCHW images and int64 labels, with the same decode-time geometry as the cpu backend
(`cpu_batches.decode_geometry`: a random-resized crop and flip, a centre crop, or the stored size)
and the same ``applied_ops``; the rest of the preset (a pad-crop, a user callable) and the
normalization run on the device in `ShardDataModule.on_after_batch_transfer`, like every
backend's. Without a GPU the same graph runs on DALI's CPU operators (``device_id=None``), which
is what the tests exercise.

One pipeline per loader (`loader.DaliLoader`), built on the first pass and reset at the end of
each: the decoders start once, not every epoch. Its one ``fn.external_source`` takes each
planned batch as per-batch arrays (`feed.PlanFeeder`): the encoded bytes, int64 labels, and for
each image the window and flip the cpu backend draws for it
(`fastdata.read.decoders.image.draw_crop` seeded by the sample's position in the epoch), which
``fn.decoders.image_slice`` decodes and ``fn.resize`` brings to the output size with Pillow's
filter (`pipeline`). So DALI yields exactly the plan's samples, order, batch sizes, padding (eval
padding labelled `PAD_LABEL`) and crops, up to the resize's rounding (one grey level; the cpu
backend's DCT-scaled decode of a large downscale differs by more), and a resumed epoch gives the
batches the uninterrupted one would have.

The GPU is the training device's index, else the process's local rank (``LOCAL_RANK``), else
the current device. The decoder is told the split's largest image (manifest ``image_stats``) to
preallocate the hardware decoder's buffers, and the hardware decoder's share
(`pipeline.HW_DECODER_LOAD`); both are recorded in `DaliLoader.decoder`.

Not supported here: ``on_error="skip"`` (DALI stops at a corrupt sample; shards are fully decoded
once at write time, so a corrupt sample means a damaged file), per-sample digests, and splits of
more than an image and a label (detection, segmentation).
"""

from __future__ import annotations

from fastdata.read.backends.dali.loader import (
    DaliLoader,
    dali_available,
    dali_status,
    make_dali_loader,
)

__all__ = ["DaliLoader", "dali_available", "dali_status", "make_dali_loader"]
