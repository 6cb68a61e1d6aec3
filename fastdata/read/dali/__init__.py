"""The DALI backend: NVIDIA DALI reads the shards, decodes and augments (GPU, or CPU operators).

With a CUDA training device, JPEG/PNG are decoded by DALI's ``mixed`` decoders (nvJPEG and the
hardware JPEG decoder) and every crop, resize, flip and normalization runs on the GPU, so the
batches come out already augmented (``augmented = True``): float32 NCHW normalized images on the
training device and int64 labels. Without a GPU the same graph is built from DALI's CPU operators
(pipeline ``device_id=None``), which is what the tests exercise.

Presets (the semantics of `fastdata.augment`, computed by DALI operators):

- ``"cifar"``: train = zero-pad 4 pixels, random crop back to the input size at integer offsets
  uniform in [0, 8], horizontal flip p = 0.5, normalize (CIFAR-100 mean/std); eval = normalize.
- ``"photo"``: train = random-resized-crop fused with the decoder (area (0.08, 1), aspect ratio
  (3/4, 4/3)), resize to ``image_size``, flip p = 0.5, normalize (ImageNet); eval = shorter side
  resized to ``floor(image_size * 256 / 224)``, centre crop ``image_size``, normalize.
- ``"none"``: decode (resize to ``image_size`` when given), scale to [0, 1].

Epochs. DALI shards a reader's sample list into `world_size` contiguous parts whose sizes differ by
at most one; with ``pad_last_batch=True`` every part is padded with copies of its last sample to
``ceil(N / world_size)`` (the reader's ``epoch_size_padded / world_size``). The iterator runs with
``LastBatchPolicy.FILL`` and this loader keeps exactly ``ceil(N / world_size)`` samples per rank
(one duplicate on the smaller parts: the "documented padding" of `read/plan.py`), so

    len = ceil(ceil(N / world_size) / batch_size)     (eval, or drop_last=False)
    len = floor(ceil(N / world_size) / batch_size)    (train with drop_last)

on every rank, the same as the CPU and memory backends. ``LastBatchPolicy.PARTIAL`` is not used:
when the smaller part is a multiple of the batch size it yields an *empty* last batch on that rank
(DALI 2.4, checked), and ``DROP`` gives ``floor(floor(N / world_size) / batch_size)``, one batch
fewer than the other backends in some cases.

Shuffling. The pipeline is built afresh for every epoch: the tar files are listed in the shard
order of `read.plan.epoch_order` for (seed, epoch) (the CPU backend's order, so a sample lands on
the same rank's side of the split), and DALI's reader shuffles samples inside a buffer of
`initial_fill` samples (``random_shuffle``) seeded from (seed, epoch, rank). Rebuilding, rather than
DALI's ``shuffle_after_epoch``, makes every epoch a pure function of (seed, epoch, rank, world
size), so a mid-epoch resume (`start_batch`) replays exactly the batches that were not consumed
(skipping costs their decode: DALI cannot seek).

Not supported here: ``on_error="skip"`` (DALI stops at a corrupt sample; shards are fully decoded
once at write time, so a corrupt sample means a damaged file) and remote shard folders.
"""

from __future__ import annotations

from fastdata.read.dali.loader import DaliLoader, dali_available, make_dali_loader, rank_samples

__all__ = ["DaliLoader", "dali_available", "make_dali_loader", "rank_samples"]
