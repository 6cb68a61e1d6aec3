"""`fastdata index`: other tools' WebDataset shards, read in place.

`index_shards(SOURCE, out)` reads every tar of a folder, a URL pattern in webdataset's brace
notation (`http://host/path/shards-{000000..000003}.tar`) or a list file of URLs, once, as a
stream (`fastdata.write.foreign.scan_tar`), and writes beside a new `manifest.json` each tar's
DALI index (`.idx`) and per-sample digests (`.sum`). The tars are never written: when they are
not in OUT, the manifest's `data_root` names where they are (an absolute folder or a URL prefix)
and `Manifest.shard_url` reads them from there. A gzip-compressed tar (`.tar.gz`, `.tgz`) is the
exception: random access needs an uncompressed copy, which is written into OUT (why, and how it
is kept whole: `fastdata.write.locate`); OUT is then the data root, so a SOURCE mixing compressed
and plain tars is indexed in place or not at all.

Images are not decoded: each sample's size is read from its image's header, and the split's
`image_stats` and `raw_shape` (one size for all) are recorded as `fastdata shard` records them,
so the DataModule's defaults (small images keep their size) match own shards. A split without
images (text, arrays, json, labels: precomputed features or captions) is indexed too; the cpu
and memory backends read it as dict batches. `label_order` (in the manifest's `source`, printed
in the summary) measures how ordered a split's labels are within its tars (0: as shuffled, 1:
sorted); above `ORDERED_LABELS` a warning says so, since loaders that read a batch from few
shards then see few classes per batch.

Splits come from the file names (`train-000000.tar` -> `train`, as `fastdata shard` names
them; a single prefix that names no split is `train`) or from `--split NAME=PATTERN`; fields
from the components the samples hold (`fastdata.format.field_inference.infer_fields`); classes from the `cls`
values (0..max) or from a file of names. Everything is written under temporary names and renamed
into place at the end, the manifest last: a failure leaves nothing half-written, and the
temporaries of a run killed outright (SIGKILL) are removed by the next run into OUT
(`fastdata.write.index_output`).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from fastdata._util.procs import run_in_processes
from fastdata._util.version import __version__
from fastdata.format.manifest import MANIFEST_NAME, Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.format.manifest_paths import check_name
from fastdata.write.foreign import ForeignTarError, ScannedTar, scan_tar
from fastdata.write.index_output import remove_stale_temporaries, write_index_files
from fastdata.write.index_splits import ORDERED_LABELS, label_order, split_info, warn_ordered
from fastdata.write.locate import (
    IndexingError,
    Located,
    expand_braces,
    inflate_to,
    is_compressed,
    locate,
    open_tar,
    stored_name,
)

__all__ = ["ORDERED_LABELS", "IndexOptions", "IndexingError", "expand_braces", "index_shards"]

log = logging.getLogger("fastdata")

SOURCE_KIND = "webdataset-index"
_KNOWN_SPLITS = ("train", "val", "validation", "test")


@dataclass(frozen=True)
class IndexOptions:
    """Options of `index_shards`.

    Args:
        splits: split name -> file-name pattern (fnmatch, on the name relative to the data
            root or on its base name); empty: split by file-name prefix.
        classes: class names (label i is classes[i]); None: "0".."max" of the `cls` values.
        storage_options: for URLs, passed to fsspec.
        retry: the retry policy of each tar's download (None: the default).
        timeouts: connect and read timeouts (None: `Timeouts.from_env()`).
        workers: tars read at once (processes for local tars, threads for URLs); None: the
            usable cores.
    """

    splits: dict[str, str] = field(default_factory=dict)
    classes: list[str] | None = None
    storage_options: dict | None = None
    retry: object | None = None
    timeouts: object | None = None
    workers: int | None = None


def _split_of(name: str, patterns: dict[str, str], prefixes: set[str]) -> str | None:
    if patterns:
        base = name.rsplit("/", 1)[-1]
        for split, pattern in patterns.items():
            if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(base, pattern):
                return split
        return None
    prefix = _prefix(name)
    if not prefix or (len(prefixes) == 1 and prefix not in _KNOWN_SPLITS):
        return "train"
    return prefix


def _prefix(name: str) -> str:
    """`train` of `train-000000.tar` (also `train_000000.tar`, `dir/train-0.tar`); "" of
    `000000.tar`."""
    stem = stored_name(name.rsplit("/", 1)[-1]).removesuffix(".tar")
    return re.sub(r"[-_.]?\d+$", "", stem)


def _by_split(names: list[str], patterns: dict[str, str], text: str) -> dict[str, list[str]]:
    """The tars of each split, by `--split` pattern or file-name prefix (`_split_of`).

    Raises:
        IndexingError: a `--split` pattern matches no tar.
    """
    prefixes = {_prefix(n) for n in names}
    by_split: dict[str, list[str]] = {}
    for name in names:
        split = _split_of(name, patterns, prefixes)
        if split is None:
            log.warning("%s matches no --split pattern: left out", name)
            continue
        by_split.setdefault(split, []).append(name)
    for split in patterns:
        if split not in by_split:
            raise IndexingError(
                f"--split {split}={patterns[split]!r} matches none of the {len(names)} "
                f"tars in {text}"
            )
    return by_split


def _scan(
    located: Located, name: str, options: IndexOptions, copy: str | None = None
) -> ScannedTar:
    """Scan one tar; a remote one is streamed again from the start after a transient failure.

    A gzip-compressed tar is scanned decompressed and its uncompressed bytes written to `copy`
    (`fastdata.write.locate.inflate_to`); the result is named by its stored `.tar` name.

    Raises:
        ForeignTarError: the tar cannot be indexed (names it and the member).
        IndexingError: no such file or object (names its path or URL).
        RemoteError: a remote tar still failing after the retries (names the URL).
    """
    remote = located.local_dir is None
    where = located.data_root + name if remote else os.path.join(located.data_root, name)

    def once() -> ScannedTar | ForeignTarError:
        with ExitStack() as stack:
            try:
                stream = open_tar(located, name, options, stack)
                if copy is None:
                    return scan_tar(stream, name, where)
                return inflate_to(
                    stream, copy, where, lambda raw: scan_tar(raw, stored_name(name), where)
                )
            except (ForeignTarError, IndexingError) as exc:  # the tar itself is wrong: no retry
                return exc

    try:
        if remote:
            from fastdata.remote.retry import DEFAULT_RETRY, retry_call

            policy = options.retry or DEFAULT_RETRY
            result = retry_call(once, where, "download", policy)  # type: ignore[arg-type]
        else:
            result = once()
    except FileNotFoundError as exc:
        cause = exc.__cause__ or exc.__context__
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        raise IndexingError(
            f"{where}: no such {'object, or its server did not answer' if remote else 'file'}"
            f"{why}; check the path or URL"
        ) from exc
    if isinstance(result, (ForeignTarError, IndexingError)):
        raise result
    return result


def _scan_all(
    located: Located, names: list[str], options: IndexOptions, copies: dict[str, str]
) -> list[ScannedTar]:
    """`_scan` of every tar, in order: in processes for local tars (tarfile's header parsing
    is the cost; `fastdata._util.procs`), in threads for remote ones (the network is). `copies`: compressed
    tar -> the temporary path of its uncompressed copy."""
    workers = min(options.workers or len(os.sched_getaffinity(0)), len(names))
    jobs = [(located, name, options, copies.get(name)) for name in names]
    if workers <= 1:
        return [_scan(*job) for job in jobs]
    if located.local_dir is None:
        with ThreadPoolExecutor(workers, thread_name_prefix="fastdata-index") as pool:
            return list(pool.map(lambda job: _scan(*job), jobs))
    results: list[ScannedTar | None] = [None] * len(jobs)
    for index, scanned in run_in_processes(_scan_job, None, jobs, workers, describe=_job_tar):
        results[index] = scanned
    return results  # type: ignore[return-value]  # every index was filled


def _scan_job(_shared: None, job: tuple[Located, str, IndexOptions, str | None]) -> ScannedTar:
    return _scan(*job)


def _job_tar(job: tuple[Located, str, IndexOptions, str | None]) -> str:
    return f"indexing {job[1]}"


def index_shards(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    options: IndexOptions | None = None,
) -> Manifest:
    """Index other tools' WebDataset tars in place and write OUT's manifest.

    Args:
        source: a folder of tars (searched recursively), a URL or URL pattern in brace notation,
            or a local list file of URLs.
        out: the folder for the manifest, index and digest files; None: SOURCE itself (a
            writable local folder).
        options: splits, classes, remote settings.

    Returns:
        The manifest, as loaded back from OUT.

    Raises:
        IndexingError: no tars, OUT missing where it is needed, a split without tars, labels
            outside the given classes, samples lacking a field's component.
        ForeignTarError: a tar that cannot be indexed (names the tar and the member).
        RemoteError: a remote tar that cannot be read after the retries (names the URL).
    """
    options = options or IndexOptions()
    text = os.fspath(source)
    located = locate(text, options)
    out_dir = _out_dir(located, out, text)
    in_place = located.local_dir is not None and Path(located.local_dir) == out_dir
    _check_out(out_dir)
    if in_place:
        located = _without_own_copies(located, out_dir)
    for name in located.names:  # what the manifest's loader would refuse, before any read
        check_name(located.data_root, name, f"{text}: tar")
    by_split = _by_split(located.names, options.splits, text)
    order = [name for names in by_split.values() for name in names]
    copies = _copies(located, order, out_dir, in_place, text)
    try:
        found = dict(zip(order, _scan_all(located, order, options, copies), strict=True))
        scanned = {split: [found[name] for name in names] for split, names in by_split.items()}
        manifest = _manifest(scanned, options.classes, out_dir, located, text, copies, in_place)
        tars = [t for tars in scanned.values() for t in tars]
        write_index_files(
            out_dir, tars, manifest, {stored_name(n): Path(c) for n, c in copies.items()}
        )
    finally:  # copies not renamed into place (a failed scan or write) are removed
        for copy in copies.values():
            Path(copy).unlink(missing_ok=True)
    return load_manifest(out_dir)


def _out_dir(located: Located, out: str | os.PathLike[str] | None, text: str) -> Path:
    """OUT, resolved; None: SOURCE itself, when it is a writable local folder.

    Raises:
        IndexingError: no OUT for a URL or a read-only folder.
    """
    if out is None:
        if located.local_dir is None or not os.access(located.local_dir, os.W_OK):
            raise IndexingError(
                f"{text} is {'a URL' if located.local_dir is None else 'read-only'}: pass "
                "--out OUT, a local folder for the manifest and index files"
            )
        out = located.local_dir
    return Path(out).resolve()


def _manifest(
    scanned: dict[str, list[ScannedTar]],
    given: list[str] | None,
    out_dir: Path,
    located: Located,
    text: str,
    copies: dict[str, str],
    in_place: bool,
) -> Manifest:
    """The manifest of the scanned tars (classes, splits, label order; warns of ordered ones)."""
    classes = _classes(scanned, given)
    splits = {split: split_info(split, tars, len(classes)) for split, tars in scanned.items()}
    order_of = {split: label_order(tars) for split, tars in scanned.items()}
    warn_ordered(order_of, scanned)
    return Manifest(
        root=str(out_dir),
        classes=classes,
        splits=splits,
        source={
            "kind": SOURCE_KIND,
            "path": text,
            "tars": sum(len(tars) for tars in scanned.values()),
            "inflated": len(copies),
            "label_order": {k: v for k, v in order_of.items() if v is not None},
        },
        seed=0,
        fastdata_version=__version__,
        data_root=None if in_place or copies else located.data_root.rstrip("/"),
    )


def _copies(
    located: Located, names: list[str], out_dir: Path, in_place: bool, text: str
) -> dict[str, str]:
    """Compressed tar -> the temporary path of its uncompressed copy in OUT.

    Raises:
        IndexingError: compressed and plain tars mixed outside OUT (one data root cannot hold
            both), or two shards that would share one stored name (`x.tar` and `x.tgz`).
    """
    compressed = [n for n in names if is_compressed(n)]
    if compressed and not in_place and len(compressed) != len(names):
        raise IndexingError(
            f"{text} mixes gzip-compressed tars ({compressed[0]}, ...) with plain ones: the "
            "compressed ones are inflated into OUT and the plain ones read where they are, "
            "which one manifest cannot name; index them into their own folder (no --out) or "
            "index each kind on its own"
        )
    stored = [stored_name(n) for n in names]
    twice = sorted({n for n in stored if stored.count(n) > 1})
    if twice:
        raise IndexingError(
            f"{text}: {twice[0]} would be written from two shards (a .tar and its .tar.gz or "
            ".tgz); keep one of them"
        )
    # Before this run writes a temporary of its own: an earlier run's may carry this PID.
    remove_stale_temporaries({out_dir} | {(out_dir / name).parent for name in stored})
    suffix = f".tmp-{os.getpid()}"
    for name in compressed:
        (out_dir / stored_name(name)).parent.mkdir(parents=True, exist_ok=True)
    return {n: str(out_dir / (stored_name(n) + suffix)) for n in compressed}


def _without_own_copies(located: Located, out_dir: Path) -> Located:
    """`located` less the uncompressed copies an earlier in-place run wrote beside their
    `.tgz` (`x.tar` beside `x.tgz`, named by OUT's manifest): they are indexed again from the
    compressed tar, not read as shards of their own."""
    siblings = {stored_name(n) for n in located.names if is_compressed(n)}
    if not siblings or not (out_dir / MANIFEST_NAME).exists():
        return located
    try:
        earlier = load_manifest(out_dir)
    except (ValueError, OSError):
        return located
    if earlier.source.get("kind") != SOURCE_KIND:
        return located
    ours = {s.name for split in earlier.splits.values() for s in split.shards} & siblings
    names = [n for n in located.names if n not in ours]
    return Located(located.data_root, names, located.local_dir)


def _check_out(out_dir: Path) -> None:
    """Refuse an OUT that holds another kind of dataset (re-indexing into OUT is fine)."""
    if not (out_dir / MANIFEST_NAME).exists():
        return
    try:
        kind = load_manifest(out_dir).source.get("kind")
    except (ValueError, OSError):
        kind = None
    if kind != SOURCE_KIND:
        raise IndexingError(
            f"{out_dir} already holds a manifest not written by `fastdata index`; choose "
            "another --out (nothing was written)"
        )


def _classes(scanned: dict[str, list[ScannedTar]], given: list[str] | None) -> list[str]:
    labels = [
        (tar.name, key, label)
        for tars in scanned.values()
        for tar in tars
        for key, label in zip(tar.keys, tar.labels, strict=True)
        if label is not None
    ]
    if given is None:
        top = max((label for _, _, label in labels), default=-1)
        return [str(i) for i in range(top + 1)]
    for name, key, label in labels:
        if label >= len(given):
            raise IndexingError(
                f"{name}: sample {key!r} has 'cls' {label}, outside the {len(given)} classes "
                "of --classes; fix the class file or the tar"
            )
    return list(given)
