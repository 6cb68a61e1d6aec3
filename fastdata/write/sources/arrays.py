"""In-memory arrays as a source: the smallest way to make shards (tests, synthetic data)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from fastdata.write.sources.base import SourceItem

__all__ = ["ArraySource"]


class ArraySource:
    """A source over uint8 NHWC pixel arrays and integer labels, one pair per split.

    Args:
        splits: split name -> (pixels uint8 (N, H, W, 3), labels int (N,)).
        classes: class names; labels index into it.
        kind: name recorded in the manifest's `source`.
    """

    def __init__(
        self,
        splits: dict[str, tuple[np.ndarray, np.ndarray]],
        classes: list[str],
        kind: str = "arrays",
    ) -> None:
        for name, (pixels, labels) in splits.items():
            if pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[-1] != 3:
                raise ValueError(
                    f"split {name!r}: pixels must be uint8 (N, H, W, 3), got {pixels.dtype} {pixels.shape}"
                )
            if len(labels) != len(pixels):
                raise ValueError(f"split {name!r}: {len(pixels)} images but {len(labels)} labels")
            if len(labels) and (labels.min() < 0 or labels.max() >= len(classes)):
                raise ValueError(
                    f"split {name!r}: labels must lie in [0, {len(classes)}), got "
                    f"[{labels.min()}, {labels.max()}]"
                )
        self.kind = kind
        self.classes = list(classes)
        self._splits = {k: (np.ascontiguousarray(p), np.asarray(y)) for k, (p, y) in splits.items()}

    def splits(self) -> dict[str, int]:
        return {name: len(labels) for name, (_, labels) in self._splits.items()}

    def item(self, split: str, index: int) -> SourceItem:
        pixels, labels = self._splits[split]
        return SourceItem(
            sample_id=index,
            label=int(labels[index]),
            origin=f"{self.kind}:{split}[{index}]",
            pixels=pixels[index],
        )

    def fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256()
        for name in sorted(self._splits):
            pixels, labels = self._splits[name]
            digest.update(name.encode())
            digest.update(pixels.tobytes())
            digest.update(np.asarray(labels, dtype=np.int64).tobytes())
        return {"kind": self.kind, "sha256": digest.hexdigest(), "splits": self.splits()}
