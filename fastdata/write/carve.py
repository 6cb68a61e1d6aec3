"""`fastdata shard --val-fraction F`: a val split carved out of a source's training split.

`CarvedSource` wraps a source that has no validation split and presents its training split as
two: "train" (the samples not carved) and "val" (a seeded `F` share of them, `fastdata.format.carve`
over the source's sample ids, so the same seed and input carve the same samples on every run and
every `--part`). Each side's samples are numbered from 0 in source order; `origin` still names the
source file or array row.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from fastdata.format.carve import carve_ids, check_fraction
from fastdata.format.manifest import VAL_SPLITS
from fastdata.write.sources.base import Source, SourceItem, source_fields, source_skipped

__all__ = ["CarvedSource", "carve_source"]


class CarvedSource:
    """A source whose training split is cut into "train" and a carved "val" split.

    Args:
        source: the source; it must have a "train" split and no "val"/"validation" split.
        fraction: the share of the training samples carved out, in (0, 1).
        seed: the carve's seed (`fastdata shard --seed`).

    Raises:
        ValueError: a fraction outside (0, 1), no "train" split, a source that already has a
            validation split, or a training split too small to cut in two.
    """

    def __init__(self, source: Source, fraction: float, seed: int) -> None:
        fraction = check_fraction(fraction, "--val-fraction")
        splits = source.splits()
        if "train" not in splits:
            raise ValueError(
                f"--val-fraction carves the training split, but this {source.kind} source has "
                f"none (splits: {sorted(splits)})"
            )
        present = [name for name in VAL_SPLITS if name in splits]
        if present:
            raise ValueError(
                f"this {source.kind} source already has a {present[0]!r} split "
                f"({splits[present[0]]} samples): drop --val-fraction to keep it"
            )
        self.source, self.fraction, self.seed = source, fraction, seed
        self.kind, self.classes = source.kind, source.classes
        self.class_ids = getattr(source, "class_ids", None)  # COCO: the category ids
        # A video source's: how the writer stores its items, and its file size bound.
        self.sample_encoding = getattr(source, "sample_encoding", None)
        self.max_video_bytes = getattr(source, "max_video_bytes", None)
        kept, carved = carve_ids(splits["train"], fraction, seed)
        self._ids = {"train": kept, "val": carved}

    def splits(self) -> dict[str, int]:
        """The source's splits, "train" cut in two and "val" added."""
        out = dict(self.source.splits())
        out.update({side: len(ids) for side, ids in self._ids.items()})
        return out

    @property
    def skipped(self) -> dict[str, list[tuple[str, str]]]:
        """The wrapped source's unusable entries (`source_skipped`), under its own split names."""
        return source_skipped(self.source)

    def sample_fields(self, split: str) -> dict[str, Any] | None:
        """The source's fields of `split` ("train" and "val" both have the training split's)."""
        return source_fields(self.source, "train" if split in self._ids else split)

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th sample of `split`; "train"/"val" map onto the source's training split."""
        if split not in self._ids:
            return self.source.item(split, index)
        ids = self._ids[split]
        if not 0 <= index < len(ids):
            raise IndexError(f"{split}[{index}] is out of range: the split has {len(ids)} samples")
        return replace(self.source.item("train", int(ids[index])), sample_id=index)

    def move_rows(self, folder: Path) -> None:
        """The wrapped source's `move_rows`, where it has one (a list's rows on disk)."""
        if (move := getattr(self.source, "move_rows", None)) is not None:
            move(folder)

    def fingerprint(self) -> dict[str, Any]:
        """The source's (the carve is in the shard options' signature)."""
        return self.source.fingerprint()


def carve_source(source: Source, fraction: float | None, seed: int) -> Source:
    """`source` itself when `fraction` is None, else a `CarvedSource` of it."""
    return source if fraction is None else CarvedSource(source, fraction, seed)
