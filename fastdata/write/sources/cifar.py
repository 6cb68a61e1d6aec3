"""CIFAR-10 / CIFAR-100 from the official "python version" archives.

The pickles are read straight from the tar stream into memory: nothing is extracted to disk, so
no member name can place a file anywhere, and every member is checked anyway (`safe_tar`). The
pickles are loaded with `safe_pickle`, which runs nothing but numpy's array reconstruction.

The whole dataset (180 MB for CIFAR-100) is held as uint8 arrays: the shard writer forks its
workers after opening the source, so they share the arrays copy-on-write.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fastdata._util import native
from fastdata.write.sources.base import BadSourceError, PixelBlock, SourceItem, describe_path
from fastdata.write.sources.download import download as download_file
from fastdata.write.sources.download import file_md5
from fastdata.write.sources.safe_pickle import safe_load
from fastdata.write.sources.safe_tar import iter_members

__all__ = ["DEFAULT_CACHE_DIR", "DOWNLOADS", "LAYOUTS", "CifarLayout", "CifarSource"]

DEFAULT_CACHE_DIR = Path("~/.cache/fastdata")

# kind -> (official URL, MD5 of the official file). Looked up at call time, so tests and mirrors
# can override an entry (or pass `url=` / `md5=` to CifarSource).
DOWNLOADS: dict[str, tuple[str, str]] = {
    "cifar100": (
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        "eb9058c3a382ffc7106e4002c42a8d85",
    ),
    "cifar10": (
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "c58f30108f718f92721af3b95e74349a",
    ),
}

_SIDE = 32
# Python-2 str objects (the pixel bytes, and keys) stay bytes: numpy takes the pixel bytes as they
# are, where "latin1" would decode 150 MB to str and numpy encode it back (1.4 s of 3.5 s). Keys
# and class names are decoded by `_str_keys` / `_class_names`.
_ENCODING = "bytes"
_ROW = 3 * _SIDE * _SIDE


@dataclass(frozen=True)
class CifarLayout:
    """Where a CIFAR variant keeps its data in the official archive.

    Args:
        archive: the official archive's file name.
        folder: the top folder inside the archive (and the extracted folder's name).
        splits: split -> member files whose rows are concatenated, in order.
        meta: the member holding the class names.
        label_keys: label mode ("fine" / "coarse") -> key of the label list in a batch.
        name_keys: label mode -> key of the class-name list in `meta`.
    """

    archive: str
    folder: str
    splits: Mapping[str, tuple[str, ...]]
    meta: str
    label_keys: Mapping[str, str]
    name_keys: Mapping[str, str]


LAYOUTS: dict[str, CifarLayout] = {
    "cifar100": CifarLayout(
        archive="cifar-100-python.tar.gz",
        folder="cifar-100-python",
        splits={"train": ("train",), "test": ("test",)},
        meta="meta",
        label_keys={"fine": "fine_labels", "coarse": "coarse_labels"},
        name_keys={"fine": "fine_label_names", "coarse": "coarse_label_names"},
    ),
    "cifar10": CifarLayout(
        archive="cifar-10-python.tar.gz",
        folder="cifar-10-batches-py",
        splits={"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
        meta="batches.meta",
        label_keys={"fine": "labels"},
        name_keys={"fine": "label_names"},
    ),
}


class CifarSource:
    """CIFAR-10 or CIFAR-100 read from the official archive or its extracted folder.

    Args:
        input: the archive (`cifar-100-python.tar.gz` / `cifar-10-python.tar.gz`, any tar
            compression) or its extracted folder (`cifar-100-python/` with train/test/meta,
            `cifar-10-batches-py/` with data_batch_1..5/test_batch/batches.meta), or the folder
            that contains it. A local file is trusted as given: no checksum is demanded. None
            with `download=True`: use or fetch the archive in `cache_dir`.
        kind: "cifar100" or "cifar10".
        download: when `input` is None, download the archive into `cache_dir` unless a file with
            the right MD5 is already there. Ignored when `input` is given.
        cache_dir: where downloads go (default ~/.cache/fastdata).
        label: "fine" (100 classes) or "coarse" (20 superclasses); CIFAR-10 has only "fine".
        url: download URL (default: the official one, `DOWNLOADS[kind]`).
        md5: expected MD5 of the download (default: the official file's).
        progress: show a progress bar while downloading.

    Raises:
        ValueError: an unknown `kind` / `label`, or neither `input` nor `download`.
        BadSourceError: the input is missing, unsafe, or not in the official layout.
    """

    def __init__(
        self,
        input: str | Path | None = None,
        kind: Literal["cifar100", "cifar10"] = "cifar100",
        download: bool = False,
        cache_dir: str | Path | None = None,
        label: Literal["fine", "coarse"] = "fine",
        url: str | None = None,
        md5: str | None = None,
        progress: bool = True,
    ) -> None:
        if kind not in LAYOUTS:
            raise ValueError(f"unknown CIFAR kind {kind!r}; expected one of {sorted(LAYOUTS)}")
        layout = LAYOUTS[kind]
        if label not in layout.label_keys:
            raise ValueError(
                f"{kind} has no {label!r} labels; expected one of {sorted(layout.label_keys)}"
            )
        self.kind: str = kind
        self.label = label
        self.path = _resolve_input(input, kind, download, cache_dir, url, md5, progress)
        self._layout = layout
        # Resolved once: item() builds origins from it for every sample.
        self._folder = _member_folder(self.path, layout) if self.path.is_dir() else None
        members = _load_members(self.path, layout)
        self.classes: list[str] = _class_names(
            members[layout.meta], layout.name_keys[label], self._member_label(layout.meta)
        )
        self._pixels: dict[str, np.ndarray] = {}
        self._labels: dict[str, np.ndarray] = {}
        self._starts: dict[str, list[int]] = {}
        for split, names in layout.splits.items():
            batches = [self._check_batch(members[n], n) for n in names]
            self._starts[split] = np.cumsum([0] + [len(b[1]) for b in batches])[:-1].tolist()
            data = batches[0][0] if len(batches) == 1 else np.concatenate([b[0] for b in batches])
            # Rows are 1024 R, 1024 G, 1024 B: a free reshape to NCHW. Converting the whole split
            # to HWC here would be a 3 s strided copy; item() converts one image instead.
            self._pixels[split] = data.reshape(-1, 3, _SIDE, _SIDE)
            self._labels[split] = np.concatenate([b[1] for b in batches])

    def splits(self) -> dict[str, int]:
        """{"train": 50000, "test": 10000} for the official archives."""
        return {split: len(labels) for split, labels in self._labels.items()}

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th image of `split` as a C-contiguous (32, 32, 3) uint8 array."""
        if split not in self._pixels:
            raise ValueError(f"unknown split {split!r}; {self.kind} has {sorted(self._pixels)}")
        count = len(self._labels[split])
        if not 0 <= index < count:
            raise IndexError(f"{split}[{index}] is out of range: the split has {count} samples")
        member_no = bisect.bisect_right(self._starts[split], index) - 1
        member = self._layout.splits[split][member_no]
        local = index - self._starts[split][member_no]
        return SourceItem(
            sample_id=index,
            label=int(self._labels[split][index]),
            origin=f"{self._member_label(member)}[{local}]",
            # Contiguous so that the writer may hand it to any buffer API (file.write, memoryview);
            # the 3 KB transposing copy is what tobytes() would do anyway.
            pixels=np.ascontiguousarray(self._pixels[split][index].transpose(1, 2, 0)),
        )

    def pixel_block(self, split: str, indices: Sequence[int]) -> PixelBlock:
        """The images, labels and ids of `item(split, i)` for every i in `indices`, stacked
        (one gather and one NCHW -> NHWC copy, for the writer's fast path)."""
        if split not in self._pixels:
            raise ValueError(f"unknown split {split!r}; {self.kind} has {sorted(self._pixels)}")
        ids = np.array(indices, dtype=np.int64)  # a copy: the C gather reads it without the GIL
        count = len(self._labels[split])
        if len(ids) and (ids.min() < 0 or ids.max() >= count):
            bad = int(ids[(ids < 0) | (ids >= count)][0])
            raise IndexError(f"{split}[{bad}] is out of range: the split has {count} samples")
        pixels = np.empty((len(ids), _SIDE, _SIDE, 3), dtype=np.uint8)
        if native.pixels is not None:  # gather, transpose and count moments in one pass
            moments = np.zeros(6, dtype=np.uint64)
            source = self._pixels[split]
            native.pixels.planes_to_pixels(source, ids, pixels, _SIDE * _SIDE, moments)
            return PixelBlock(pixels, self._labels[split][ids], ids, moments=moments)
        planes = self._pixels[split][ids].reshape(len(ids), 3, _SIDE * _SIDE)
        interleaved = pixels.reshape(len(ids), _SIDE * _SIDE, 3)
        for channel in range(3):  # three strided copies: faster than one transposing copy
            interleaved[:, :, channel] = planes[:, channel]
        return PixelBlock(pixels, self._labels[split][ids], ids, planes)

    def fingerprint(self) -> dict[str, Any]:
        """Kind, label mode, resolved path, and the file's size and mtime (a folder: member sizes)."""
        info: dict[str, Any] = {
            "kind": self.kind,
            "label": self.label,
            "path": describe_path(self.path),
        }
        if self._folder is not None:
            names = [
                *(n for names in self._layout.splits.values() for n in names),
                self._layout.meta,
            ]
            info["members"] = {n: (self._folder / n).stat().st_size for n in names}
        else:
            stat = self.path.stat()
            info["bytes"] = stat.st_size
            info["mtime_ns"] = stat.st_mtime_ns
        return info

    def _member_label(self, name: str) -> str:
        """How a member is named in messages and origins."""
        if self._folder is not None:
            return str(self._folder / name)
        return f"{self.path.name}:{self._layout.folder}/{name}"

    def _check_batch(self, batch: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(data (N, 3072) uint8, labels (N,) int64) of one batch pickle, validated."""
        where = self._member_label(name)
        batch = _str_keys(batch, where)
        label_key = self._layout.label_keys[self.label]
        data, labels = batch.get("data"), batch.get(label_key)
        if (
            not isinstance(data, np.ndarray)
            or data.dtype != np.uint8
            or data.ndim != 2
            or data.shape[1] != _ROW
        ):
            got = f"{type(data).__name__} {getattr(data, 'dtype', '')} {getattr(data, 'shape', '')}"
            raise BadSourceError(
                f"{where}: 'data' must be a uint8 array of shape (N, {_ROW}), "
                f"got {got}; this is not an official CIFAR batch."
            )
        if labels is None:
            raise BadSourceError(
                f"{where}: no {label_key!r} list; this is not an official "
                f"{self.kind} batch (keys: {sorted(batch)})."
            )
        labels = np.asarray(labels, dtype=np.int64)
        if labels.shape != (len(data),):
            raise BadSourceError(f"{where}: {len(data)} images but {labels.shape} labels.")
        if len(labels) and (labels.min() < 0 or labels.max() >= len(self.classes)):
            raise BadSourceError(
                f"{where}: labels span {labels.min()}..{labels.max()} but there "
                f"are {len(self.classes)} classes."
            )
        return data, labels


def _resolve_input(
    input: str | Path | None,
    kind: str,
    download: bool,
    cache_dir: str | Path | None,
    url: str | None,
    md5: str | None,
    progress: bool,
) -> Path:
    """The local archive or folder to read, downloading it first where asked."""
    layout = LAYOUTS[kind]
    cache = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if input is not None:
        path = Path(input).expanduser()
        if not path.exists():
            raise BadSourceError(
                f"{describe_path(path)}: no such file or folder. Pass the {kind} archive "
                f"({layout.archive}) or its extracted folder ({layout.folder}/), or input=None "
                f"with download=True to fetch it into {cache}."
            )
        return path
    if not download:
        raise ValueError(
            f"{kind}: pass the archive ({layout.archive}) or its extracted folder "
            "as input, or download=True to fetch it."
        )
    default_url, default_md5 = DOWNLOADS[kind]
    url, md5 = url or default_url, md5 or default_md5
    dest = cache / layout.archive
    if dest.is_file() and file_md5(dest) == md5.lower():
        return dest
    return download_file(url, dest, md5, progress=progress)


def _member_folder(path: Path, layout: CifarLayout) -> Path:
    """The extracted folder: `path` itself or `path/<layout.folder>`."""
    return path if (path / layout.meta).exists() else path / layout.folder


def _load_members(path: Path, layout: CifarLayout) -> dict[str, Any]:
    """Every member the layout needs, unpickled, keyed by its name (e.g. "train")."""
    names = [layout.meta, *(n for split in layout.splits.values() for n in split)]
    loaded: dict[str, Any] = {}
    if path.is_dir():
        folder = _member_folder(path, layout)
        for name in names:
            if (folder / name).is_file():
                with open(folder / name, "rb") as f:
                    loaded[name] = safe_load(f, encoding=_ENCODING, name=str(folder / name))
    else:
        wanted = {f"{layout.folder}/{n}": n for n in names}
        for member, fileobj in iter_members(path, wanted):
            loaded[wanted[member]] = safe_load(
                fileobj, encoding=_ENCODING, name=f"{path.name}:{member}"
            )
    missing = [n for n in names if n not in loaded]
    if missing:
        raise BadSourceError(
            f"{describe_path(path)}: missing {', '.join(f'{layout.folder}/{n}' for n in missing)}."
            f" Expected the official layout: {layout.folder}/{{{', '.join(names)}}} in "
            f"{layout.archive} or an extracted folder."
        )
    return loaded


def _str_keys(obj: Any, where: str) -> dict[str, Any]:
    """A pickled dict with bytes keys (Python-3 writers) turned into str keys."""
    if not isinstance(obj, dict):
        raise BadSourceError(
            f"{where}: expected a dict, got {type(obj).__name__}; this is not an "
            "official CIFAR pickle."
        )
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _class_names(meta: Any, key: str, where: str) -> list[str]:
    """The class names stored under `key` in the meta pickle."""
    names = _str_keys(meta, where).get(key)
    if not isinstance(names, list) or not names:
        raise BadSourceError(f"{where}: no {key!r} list of class names.")
    return [n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names]
