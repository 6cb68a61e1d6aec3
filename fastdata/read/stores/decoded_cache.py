"""Decode a split once into one uint8 tensor, cached on disk (the store of the memory backend).

Stored geometry (the size of every decoded image, a pure function of the split and `image_size`):

- raw (`rgb`) samples keep their own size (the split's `raw_shape`); `image_size` is ignored, the
  device preset crops or resizes.
- encoded samples (`jpg` / `png`) without `image_size` keep their size when the split has one
  common `raw_shape`; photos of varying size need an `image_size`.
- encoded samples with `image_size` S: shorter side resized to floor(S * 256 / 224), centre-cropped
  to that square (256 for 224): `fastdata.read.decoders.image.stored_hw` and the decoder's "cover"
  geometry (the one CPU decoder, `fastdata.read.decoders.image`). The device random-resized crop then has
  a 12.5 % margin, and the eval centre crop of S matches the standard evaluation geometry.

Cache: the decoded split is written once to `<cache dir>/<split>-<key>.npy` (images, NCHW),
`.meta.npy` (int64 label, sample_id, ok per row) and `.json` (header, written last: its presence
marks a complete entry). Every file is written under a temporary name and renamed. The key hashes the
split's shard sha256s, the stored size and the format versions, so a rewritten shard folder or a
different size never hits a stale entry. Cache dir (`resolve_cache_dir`): the `cache_dir` argument
(`ShardDataModule(decoded_cache_dir=...)`), else $FASTDATA_CACHE_DIR, else
`$XDG_CACHE_HOME/fastdata/decoded` (`~/.cache/fastdata/decoded`): never the dataset's own folder
unless asked, since shard folders are often read-only or shared. Ranks that decode the same split
at once each write their own temporary files; the renames are atomic and the contents identical.

Decoding runs in threads that write their rows straight into the memory-mapped cache file. A raw
shard is read whole: its index parsed in one pass, every sample's pixels and label gathered by
offset (CIFAR-100 train, one thread: 0.4 s of CPU instead of 1.3 s sample by sample); a shard that
does not fit that layout is read sample by sample, which names any bad sample. Encoded samples are
decoded 64 at a time per job, so a one-shard split still uses every thread. Large splits show a
progress bar (`decode_split`'s `progress`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fastdata.format import schema
from fastdata.format.manifest import FORMAT_VERSION, Manifest, SplitInfo
from fastdata.read.decoders.image import Geometry, decode_image, decode_raw, stored_hw
from fastdata.read.raw_shard import read_raw_shard
from fastdata.read.rows import RowReader
from fastdata.read.shardio import ShardReader, ShardReadError

__all__ = [
    "CACHE_DIR_ENV",
    "PROGRESS_MIN_SAMPLES",
    "DecodedSplit",
    "ImageSize",
    "cache_key",
    "decode_split",
    "decoded_nbytes",
    "resolve_cache_dir",
]

CACHE_DIR_ENV = "FASTDATA_CACHE_DIR"
# Bump when the cache layout or the decode geometry changes: old entries then miss.
_CACHE_LAYOUT = 1
_CACHE_FOLDER = "decoded"  # under $XDG_CACHE_HOME/fastdata
_NO_DRAWS = np.random.default_rng(0)  # the "cover" geometry draws nothing
_CHUNK = 64  # encoded samples per decode job
# Splits from this many samples get a progress bar (`decode_split`): a raw sample costs ~1 us
# to copy, an encoded photo some ms to decode.
PROGRESS_MIN_SAMPLES = {"raw": 500_000, "encoded": 2_000}

_log = logging.getLogger("fastdata")
ImageSize = int | tuple[int, int] | None
DecodedSplit = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------- geometry


def decoded_nbytes(info: SplitInfo, image_size: ImageSize, margin: bool = True) -> int:
    """Bytes of the decoded split as uint8 (N, 3, H, W) at its stored size (`stored_hw`)."""
    h, w = stored_hw(info, image_size, margin)
    return info.num_samples * 3 * h * w


# ---------------------------------------------------------------- cache


def resolve_cache_dir(manifest: Manifest, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The decoded-split cache folder, created if missing.

    `cache_dir`, else $FASTDATA_CACHE_DIR, else `$XDG_CACHE_HOME/fastdata/decoded` (default
    `~/.cache/fastdata/decoded`). The shard folder (`manifest.root`) is never written to unless
    it is passed as `cache_dir`: it may be read-only or shared. Entries are keyed by the shards'
    sha256 (`cache_key`), so one cache folder serves any number of datasets.

    Raises:
        OSError: the folder cannot be created or written (names it and what to set instead).
    """
    chosen = cache_dir or os.environ.get(CACHE_DIR_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        how = "the decoded_cache_dir argument" if cache_dir else f"${CACHE_DIR_ENV}"
    else:
        home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(home) / "fastdata" / _CACHE_FOLDER
        how = "the default"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(
            f"cannot create the decoded cache folder {path} ({how}) for {manifest.root}: {exc}; "
            f"set ${CACHE_DIR_ENV} or pass decoded_cache_dir= a writable folder"
        ) from exc
    if not os.access(path, os.W_OK):
        raise OSError(
            f"the decoded cache folder {path} ({how}) for {manifest.root} is not writable; "
            f"set ${CACHE_DIR_ENV} or pass decoded_cache_dir= a writable folder"
        )
    return path


def cache_key(manifest: Manifest, split: str, hw: tuple[int, int]) -> str:
    """The cache entry's name: a hash of the split's shard checksums, stored size and versions."""
    ident = {
        "format_version": FORMAT_VERSION,
        "layout": _CACHE_LAYOUT,
        "split": split,
        "shards": [s.sha256 for s in manifest.split(split).shards],
        "stored_hw": list(hw),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def _paths(stem: Path, tag: str = "") -> dict[str, Path]:
    """The entry's files; the header (".json") is written last and marks the entry complete."""
    return {part: Path(f"{stem}{tag}{part}") for part in (".npy", ".meta.npy", ".json")}


def _load_cached(stem: Path) -> tuple[np.ndarray, np.ndarray, dict] | None:
    paths = _paths(stem)
    if not all(path.exists() for path in paths.values()):
        return None
    # "c" (copy-on-write) maps without copying yet gives writable arrays, so torch.from_numpy stays
    # silent; ranks on one host share the page cache.
    images = np.load(paths[".npy"], mmap_mode="c")
    return images, np.load(paths[".meta.npy"]), json.loads(paths[".json"].read_text())


def decode_split(
    manifest: Manifest,
    split: str,
    image_size: ImageSize = None,
    workers: int | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    on_error: str = "raise",
    progress: bool | None = None,
    margin: bool = True,
    verify_samples: bool = False,
) -> DecodedSplit:
    """Decode every sample of a split once (or load it from the cache).

    Args:
        manifest: the shard folder's manifest.
        split: split name.
        image_size: output size of variable-size photos (see `stored_hw`).
        workers: decoding threads; default: the CPU count.
        cache_dir: cache folder (see `resolve_cache_dir`).
        on_error: "raise" on a corrupt sample, or "skip" it (its row is marked not ok).
        progress: a progress bar on stderr while decoding. None: only for a split of at least
            `PROGRESS_MIN_SAMPLES` samples (by encoding) and only when stderr is a terminal;
            True: always; False: never.
        margin: photos with `image_size` are stored with room around it (see `stored_hw`).
        verify_samples: check every sample against its digest written at shard time while
            decoding (a cache entry decoded without that check is decoded again).

    Returns:
        (images uint8 (N, 3, H, W), labels int64 (N,), sample_ids int64 (N,), ok bool (N,)), CPU
        tensors backed by the cache file (memory-mapped, copy-on-write), one row per sample in
        row order (`fastdata.read.plan`); a skipped corrupt sample keeps its row, with ok False.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    hw = stored_hw(manifest.split(split), image_size, margin)
    stem = resolve_cache_dir(manifest, cache_dir) / f"{split}-{cache_key(manifest, split, hw)}"
    cached = _load_cached(stem)
    if cached is None or (verify_samples and not cached[2].get("verified")):
        options = _DecodeOptions(workers, on_error, progress, verify_samples)
        _build_cache(manifest, split, hw, stem, options)
        cached = _load_cached(stem)
        assert cached is not None, f"cache entry {stem} vanished right after it was written"
    images, meta, header = cached
    _report_skipped(header["skipped"], f"split {split!r} of {manifest.root}", on_error)
    ok = torch.from_numpy(meta[:, 2].astype(bool))
    return torch.from_numpy(images), torch.from_numpy(meta[:, 0]), torch.from_numpy(meta[:, 1]), ok


def _report_skipped(skipped: list[str], where: str, on_error: str) -> None:
    """Raise for the corrupt samples a cache entry skipped, or (on_error="skip") log them."""
    if not skipped:
        return
    if on_error == "raise":
        raise ValueError(
            f"{len(skipped)} corrupt samples in {where} (first: {skipped[0]}); "
            "pass on_error='skip' or re-write the shards"
        )
    shown = "".join(f"\n  {s}" for s in skipped[:20])
    more = f"\n  ... and {len(skipped) - 20} more" if len(skipped) > 20 else ""
    _log.warning(
        "skipped %d bad sample(s) of %s (on_error='skip'):%s%s", len(skipped), where, shown, more
    )


@dataclass(frozen=True)
class _DecodeOptions:
    workers: int | None
    on_error: str
    progress: bool | None
    verify_samples: bool = False


def _build_cache(
    manifest: Manifest, split: str, hw: tuple[int, int], stem: Path, options: _DecodeOptions
) -> None:
    info = manifest.split(split)
    n = info.num_samples
    if n == 0:
        raise ValueError(f"split {split!r} of {manifest.root} has no samples")
    need, free = n * 3 * hw[0] * hw[1], shutil.disk_usage(stem.parent).free
    if need > free:
        raise OSError(
            f"decoding split {split!r} needs {need / 2**30:.2f} GiB in {stem.parent}, which has "
            f"{free / 2**30:.2f} GiB free; set ${CACHE_DIR_ENV} to a folder on a bigger disk"
        )
    t0 = time.perf_counter()
    tmp, final = _paths(stem, f".tmp-{os.getpid()}"), _paths(stem)
    try:
        # Every row is written straight into the memory-mapped cache file: no second copy.
        images = np.lib.format.open_memmap(
            tmp[".npy"], mode="w+", dtype=np.uint8, shape=(n, 3, *hw)
        )
        meta = np.zeros((n, 3), dtype=np.int64)  # label, sample_id, ok
        with _progress_bar(info, f"decoding {split} of {manifest.root}", options.progress) as bar:
            skipped = _decode_all(manifest, split, images, meta, options, bar)
        images.flush()
        del images
        np.save(tmp[".meta.npy"], meta)
        header = dict(
            split=split,
            root=manifest.root,
            num_samples=n,
            stored_hw=hw,
            skipped=skipped,
            verified=options.verify_samples,
        )
        tmp[".json"].write_text(json.dumps(header, indent=1) + "\n")
        for part in (".npy", ".meta.npy", ".json"):  # the header last: marks the entry complete
            os.replace(tmp[part], final[part])
    except BaseException:
        for part in tmp.values():  # a failed decode leaves no partial cache file behind
            part.unlink(missing_ok=True)
        raise
    elapsed = time.perf_counter() - t0
    _log.info("decoded split %r: %d samples at %s in %.1f s -> %s", split, n, hw, elapsed, stem)


def _progress_bar(info: SplitInfo, desc: str, progress: bool | None) -> tqdm:
    """The decode progress bar (see `decode_split`); a disabled bar when it is not shown."""
    if progress is None:
        threshold = PROGRESS_MIN_SAMPLES["raw" if info.encoding == "raw" else "encoded"]
        disable = None if info.num_samples >= threshold else True  # None: on a terminal only
    else:
        disable = not progress
    return tqdm(total=info.num_samples, unit="img", desc=desc, disable=disable)


# ---------------------------------------------------------------- decoding


def _decode_all(
    manifest: Manifest,
    split: str,
    images: np.ndarray,
    meta: np.ndarray,
    options: _DecodeOptions,
    bar: tqdm,
) -> list[str]:
    """Decode the split into `images` / `meta` in threads; returns the skipped samples.

    Threads, not processes: numpy's copies, file reads and Pillow's decoding and resizing release
    the GIL, and every thread writes its rows straight into the one memory-mapped file. A job is
    a whole raw shard (a few array operations) or `_CHUNK` encoded samples, so a split of one
    shard still keeps every thread busy.
    """
    info = manifest.split(split)
    jobs = _jobs(info)
    local, lock, readers = threading.local(), threading.Lock(), []

    def run(job: tuple[int, int, int, int]) -> list[str]:
        reader = getattr(local, "reader", None)
        if reader is None:  # one per thread: readers are not shared
            reader = local.reader = ShardReader(
                manifest, split, max_open=2, verify_samples=options.verify_samples
            )
            with lock:
                readers.append(reader)
        skipped = _decode_rows(manifest, reader, info, job, images, meta, options)
        with lock:
            bar.update(job[3] - job[2])
        return skipped

    pool = ThreadPoolExecutor(max(1, min(options.workers or os.cpu_count() or 1, len(jobs))))
    try:
        return [key for keys in pool.map(run, jobs) for key in keys]
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # a failure stops the jobs not started
        raise
    finally:
        pool.shutdown()
        for reader in readers:
            # A traceback in flight may still hold views into a mapping; it is then closed by GC.
            with contextlib.suppress(BufferError):
                reader.close()


def _jobs(info: SplitInfo) -> list[tuple[int, int, int, int]]:
    """(shard, first row of the shard, first sample, end sample) of every decode job."""
    jobs, row = [], 0
    for shard, entry in enumerate(info.shards):
        step = max(1, entry.num_samples if info.encoding == "raw" else _CHUNK)
        jobs += [
            (shard, row, start, min(start + step, entry.num_samples))
            for start in range(0, entry.num_samples, step)
        ]
        row += entry.num_samples
    return jobs


def _decode_rows(
    manifest: Manifest,
    reader: ShardReader,
    info: SplitInfo,
    job: tuple[int, int, int, int],
    images: np.ndarray,
    meta: np.ndarray,
    options: _DecodeOptions,
) -> list[str]:
    """Decode samples [start, end) of a shard into their rows; returns the skipped samples."""
    shard, row, start, end = job
    on_error = options.on_error
    whole = (start, end) == (0, info.shards[shard].num_samples)
    if info.encoding == "raw" and whole and not options.verify_samples:
        if read_raw_shard(manifest, info, shard, row, images, meta):
            return []
    geometry = Geometry("cover", hw=tuple(images.shape[2:]))
    rows = RowReader(reader, (), train=True, on_error=on_error)
    skipped: list[str] = []
    for i in range(start, end):
        try:
            _decode_into(reader, info, geometry, (shard, i), images, meta, row + i)
        except (ShardReadError, ValueError) as exc:
            if isinstance(exc, ShardReadError) and exc.key is None:
                raise  # the whole shard is unreadable: never a per-sample skip
            error = rows.error(shard, i, exc)  # names the shard and the key
            if on_error == "raise":
                raise error from exc
            skipped.append(str(error))
    return skipped


def _decode_into(
    reader: ShardReader,
    info: SplitInfo,
    geometry: Geometry,
    ref: tuple[int, int],
    images: np.ndarray,
    meta: np.ndarray,
    row: int,
) -> None:
    """Decode sample `ref` into `images[row]` / `meta[row]` (its views die on return)."""
    shard, i = ref
    parts = reader.sample(shard, i)
    label, sample_id = schema.label_and_id(reader.key(shard, i), parts)
    ext, data = schema.image_component(parts)
    if ext == schema.RAW_EXT:
        if info.raw_shape is None:
            raise ValueError("rgb sample in a split without raw_shape; re-run `fastdata shard`")
        pixels = decode_raw(data, tuple(info.raw_shape))
    else:
        pixels = decode_image(data, geometry, _NO_DRAWS)
    images[row] = pixels.transpose(2, 0, 1)
    meta[row] = (label, sample_id, 1)
