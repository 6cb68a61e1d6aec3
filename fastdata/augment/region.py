"""`Region`: one sample's geometry, the map `fastdata.augment.targets` describes and applies.

Its own module so that the kernels (`fastdata.augment.warp`) and the draws and entry points
(`fastdata.augment.targets`) both import it, and neither imports the other's importer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Box", "Region"]

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Region:
    """One sample's geometry (the map `fastdata.augment.targets`'s docstring defines).

    Args:
        box: ``(x0, y0, x1, y1)`` crop in source pixels; may extend past the image (zero padding).
        flip: mirror left-right after the crop.
        out_hw: output ``(H, W)``.

    Raises:
        ValueError: an empty or non-finite box, or a non-positive output size.
    """

    box: Box
    flip: bool
    out_hw: tuple[int, int]

    def __post_init__(self) -> None:
        x0, y0, x1, y1 = self.box
        if not all(math.isfinite(v) for v in self.box) or x1 <= x0 or y1 <= y0:
            raise ValueError(
                f"region box must be finite (x0, y0, x1, y1) with x1 > x0, y1 > y0, got {self.box}"
            )
        if len(self.out_hw) != 2 or min(self.out_hw) < 1:
            raise ValueError(f"region out_hw must be two positive ints, got {self.out_hw}")

    @property
    def integral(self) -> bool:
        """Whether the box lies on whole pixels (then `warp_sample` uses torch's uint8 resize)."""
        return all(float(v).is_integer() for v in self.box)
