"""Per-channel pixel statistics of a split, accumulated while its shards are written.

Streaming (one pass, no second read of the data): each shard keeps the per-channel sum, sum of
squares and pixel count of its stored images; the manifest combines the shards' figures into the
split's mean and standard deviation (0..255 scale), the DataModule's default normalization.
Encoded photos are measured at a reduced resolution (JPEG draft mode, about 1/8 of each side):
a mean over a 50x67 rendition of a 400x533 photo differs from the full one by well under one
grey level, at a fraction of the decode cost.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from fastdata.format import schema

__all__ = ["PixelStats"]

_RUN = 256  # float32 sums of squares stay exact over 256 values (256 * 255**2 < 2**24)
_DRAFT_SIDE = 64  # encoded images are measured at about this many pixels a side (draft mode)


class PixelStats:
    """Running per-channel sums of RGB pixels (float64)."""

    def __init__(self) -> None:
        self.sums = np.zeros(3)
        self.squares = np.zeros(3)
        self.count = 0

    def add(self, ext: str, data: bytes, height: int, width: int) -> None:
        """Account for one stored image (its component extension and bytes)."""
        if ext == schema.RAW_EXT:
            pixels = np.frombuffer(data, dtype=np.uint8).reshape(height, width, -1)[..., :3]
        else:
            with Image.open(io.BytesIO(data)) as image:
                image.draft("RGB", (max(1, width // 8), max(1, height // 8)))
                rgb = image.convert("RGB")
                if max(rgb.size) > 4 * _DRAFT_SIDE:  # PNGs have no draft mode
                    rgb.thumbnail((_DRAFT_SIDE * 2, _DRAFT_SIDE * 2))
                pixels = np.asarray(rgb)
        flat = pixels.reshape(-1, 3)
        self.sums += flat.sum(axis=0, dtype=np.uint64)
        wide = flat.astype(np.uint32)
        self.squares += np.einsum("ij,ij->j", wide, wide, dtype=np.uint64)
        self.count += len(flat)

    def add_block(
        self,
        pixels: np.ndarray,
        planes: np.ndarray | None = None,
        moments: np.ndarray | None = None,
    ) -> None:
        """Account for a stack of raw RGB images at once, as `add` on each would.

        Args:
            pixels: (N, H, W, 3) uint8.
            planes: the same pixels channel-first, (N, 3, H * W), when the caller has them:
                contiguous channels sum about 3x faster than interleaved ones.
            moments: (6,) uint64 per-channel sums then sums of squares of `pixels`, already
                counted (`PixelBlock.moments`): taken as they are.

        The figures equal `add`'s: every partial sum is an integer that its type holds exactly
        (float32 below 2**24: runs of `_RUN` values of at most 255**2; float64 below 2**53),
        whatever order they are added in. No BLAS call: its threads slow a busy machine down.
        """
        chunk = 512
        count = int(pixels.shape[0] * pixels.shape[1] * pixels.shape[2])
        if moments is not None:
            self.sums += moments[:3].astype(np.float64)
            self.squares += moments[3:].astype(np.float64)
            self.count += count
            return
        if planes is not None and planes.shape[2] % _RUN == 0:
            runs = planes.shape[2] // _RUN
            for start in range(0, len(planes), chunk):
                part = planes[start : start + chunk].astype(np.float32).reshape(-1, 3, runs, _RUN)
                self.sums += np.einsum("kcri->kcr", part).sum(axis=(0, 2), dtype=np.float64)
                squares = np.einsum("kcri,kcri->kcr", part, part)
                self.squares += squares.sum(axis=(0, 2), dtype=np.float64)
            self.count += count
            return
        if planes is None:
            planes = pixels.reshape(len(pixels), -1, 3)  # (N, H * W, 3): sums over axes 0 and 1
            spec, axes = "kic,kic->c", (0, 1)
        else:
            spec, axes = "kci,kci->c", (0, 2)
        for start in range(0, len(planes), chunk):
            part = planes[start : start + chunk].astype(np.float64)
            self.sums += part.sum(axis=axes)
            self.squares += np.einsum(spec, part, part)
        self.count += count

    def to_list(self) -> list[float]:
        """[3 sums, 3 sums of squares, count]: the shard's record in its `done` file."""
        return [*self.sums.tolist(), *self.squares.tolist(), float(self.count)]

    @staticmethod
    def combine(records: list[list[float]]) -> tuple[list[float], list[float]] | None:
        """(mean, std) per channel of the shards' records; None when there are none."""
        rows = np.array([r for r in records if r and r[6] > 0], dtype=np.float64)
        if not len(rows):
            return None
        total = rows.sum(axis=0)
        mean = total[:3] / total[6]
        var = np.maximum(total[3:6] / total[6] - np.square(mean), 0.0)
        return [round(float(v), 4) for v in mean], [round(float(v), 4) for v in np.sqrt(var)]
