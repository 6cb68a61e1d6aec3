"""Video files, in class-per-folder trees or named by a list file, stored as they are.

    fastdata shard video clips/ out/          clips/<class>/**/<video>.mp4 (or train/, val/ ...)
    fastdata shard video list.csv out/        path,label[,split] rows, as for images

The tree and the list are read by the image sources (`FolderSource` with video extensions,
`ListSource`), so classes, splits, labels, source ids, skipped entries and their checks are
theirs. What differs is a sample's encoding, which the writer reads from
`VideoSource.sample_encoding`: the file's bytes unchanged and its clip index
(`fastdata.write.video.encode_video`), never a re-encoded stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastdata.write.sources.base import BadSourceError, SourceItem, source_fields, source_skipped
from fastdata.write.sources.folder import FolderSource
from fastdata.write.sources.listfile import DEFAULT_MAX_CLASSES, ListSource

__all__ = ["DEFAULT_MAX_VIDEO_BYTES", "VIDEO_EXTENSIONS", "VideoSource"]

#: Video files a folder tree contributes (compared lower-cased).
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".webm", ".mkv"})
#: Largest video file accepted (bigger ones are bad samples unless the limit is raised): 4 GiB,
#: about two hours of 1080p H.264 at 4 Mbit/s.
DEFAULT_MAX_VIDEO_BYTES = 4 << 30


class VideoSource:
    """Videos and their labels, from a class-per-folder tree or a CSV/JSONL list.

    Args:
        input: a folder (``root/<class>/<video>`` or ``root/{train,val,test}/<class>/...``) or
            a list file (``.csv``, ``.jsonl``: ``path,label[,split]``).
        root: for a list, the folder its relative paths start from (default: the list's).
        classes: for a list, the class names (see `ListSource`).
        max_classes: for a list, most classes the labels may imply.
        max_video_bytes: largest video file accepted (bigger: a bad sample).

    Raises:
        ValueError: `classes` or `root` given with a folder.
        BadSourceError: the folder or list cannot be read (see `FolderSource`, `ListSource`),
            or the list has columns besides path, label and split (videos carry a label only).
    """

    kind = "video"
    #: Tells the writer to store items with `fastdata.write.video.encode_video`.
    sample_encoding = "video"

    def __init__(
        self,
        input: str | Path,
        root: str | Path | None = None,
        classes: list[str] | None = None,
        max_classes: int = DEFAULT_MAX_CLASSES,
        max_video_bytes: int | None = DEFAULT_MAX_VIDEO_BYTES,
    ) -> None:
        if input is None:
            raise ValueError("VideoSource needs a folder or a list file as input, got None")
        path = Path(input).expanduser()
        self.inner: FolderSource | ListSource
        if path.is_dir():
            if classes is not None or root is not None:
                raise ValueError(
                    f"{path} is a folder: its class folders name the classes; classes and root "
                    "are for a list file"
                )
            self.inner = FolderSource(path, extensions=VIDEO_EXTENSIONS)
        else:
            self.inner = ListSource(path, root=root, classes=classes, max_classes=max_classes)
            extra = [s for s in self.inner.splits() if source_fields(self.inner, s) is not None]
            if extra:
                raise BadSourceError(
                    f"{path}: a video list takes the columns path, label and split only; "
                    f"split {extra[0]!r} has more; drop the other columns"
                )
        self.classes: list[str] = self.inner.classes
        self.skipped = source_skipped(self.inner)
        self.max_video_bytes = max_video_bytes

    def __getattr__(self, name: str) -> Any:
        # The inner source's other hooks (a list's `move_rows` for a cluster engine).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def splits(self) -> dict[str, int]:
        """Split name -> number of videos."""
        return self.inner.splits()

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th video of `split` (a file path and its label)."""
        return self.inner.item(split, index)

    def fingerprint(self) -> dict[str, Any]:
        """The inner source's fingerprint, as a video source's."""
        return {**self.inner.fingerprint(), "kind": self.kind}
