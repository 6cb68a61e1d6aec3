"""How to shard a source: `ShardOptions`, the options of `fastdata.write.writer.write_shards`
(and of `fastdata shard`, whose flags take their defaults from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastdata.write.encode import DEFAULT_MAX_PIXELS

__all__ = ["ShardOptions"]


@dataclass(frozen=True)
class ShardOptions:
    """How to shard a source.

    Args:
        seed: seed of the cross-shard pre-shuffle (same seed and input give byte-identical shards).
        max_count: most samples per shard.
        max_size: most bytes per shard, estimated from the source's bytes (a re-encoded sample can
            differ in size, so a shard may end slightly over). None: no size limit.
        workers: writer processes; None uses the usable cores.
        encoding: "auto", "raw", "png", "jpeg" or "keep" (see `fastdata.write.encode`).
        resize: shrink images so the shorter side is at most this many pixels (re-encodes every
            image; classification sources only: see `max_side`).
        quality: JPEG quality for re-encoding.
        strict: stop at the first bad sample instead of skipping and reporting it (also at an
            input the source itself found unusable: an unpaired segmentation file, a broken
            symlink, before anything is written).
        overwrite: replace shards of a different dataset found in the output folder.
        progress: show a progress bar.
        val_fraction: carve this share of the training split into a "val" split
            (`fastdata.write.carve`, seeded with `seed`), for a source without one; None: no.
        max_bad: most fraction (0..1) of the inputs that may be bad (skipped); one more stops the
            run with `TooManyBadSamplesError` and the first reasons, and writes no manifest.
        max_pixels: most width x height of an image file, checked from its header before it is
            decoded (a bigger one is a bad sample); None: no bound.
        lock_timeout: seconds to wait for another run that writes into the same output folder
            (0: refuse at once; see `fastdata.write.lock`).
        max_side: store images no larger than this on their longer side (FFCV's
            `max_resolution`): a larger one is resized and re-encoded (JPEG at `quality`), its
            mask resized with nearest and its boxes scaled with it; None: as they are.
    """

    seed: int = 0
    max_count: int = 10_000
    max_size: int | None = None
    workers: int | None = None
    encoding: str = "auto"
    resize: int | None = None
    quality: int = 90
    strict: bool = False
    overwrite: bool = False
    progress: bool = True
    val_fraction: float | None = None
    max_bad: float = 0.1
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    lock_timeout: float = 0.0
    max_side: int | None = None

    def __post_init__(self) -> None:
        if self.max_side is not None and self.max_side < 1:
            raise ValueError(f"max_side must be >= 1 or None, got {self.max_side}")
        if not 0.0 <= self.max_bad <= 1.0:
            raise ValueError(f"max_bad must be a fraction from 0 to 1, got {self.max_bad}")
        if self.max_pixels is not None and self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1 or None, got {self.max_pixels}")

    def signature(self) -> dict[str, Any]:
        """The options that change the bytes written (not workers, strict, progress, max_bad)."""
        keys = ("seed", "max_count", "max_size", "encoding", "resize", "quality")
        signature = {k: getattr(self, k) for k in keys}
        if self.val_fraction is not None:  # absent otherwise: older folders keep their identity
            signature["val_fraction"] = self.val_fraction
        if self.max_pixels != DEFAULT_MAX_PIXELS:  # folders written before the option match
            signature["max_pixels"] = self.max_pixels
        if self.max_side is not None:  # absent otherwise: older folders keep their identity
            signature["max_side"] = self.max_side
        return signature
