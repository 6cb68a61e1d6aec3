"""`fastdata inspect` and `fastdata verify`: look at a shard folder, and check every byte of it.

`verify` reads each sample as the loaders do: through the split's fields (`SplitInfo.field_specs`,
the image + label of a classification split included) and the loaders' row reader
(`fastdata.read.rows.RowReader`, `fastdata.read.decoders.dict_batch.decode_fields`), so a folder any loader
reads (own shards, or other tools' tars indexed by `fastdata index`) is checked by the same rules,
not by a list of components of its own.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from fastdata.augment.presets import get_preset
from fastdata.format.fields import is_classification
from fastdata.format.integrity import IntegrityError, open_regular
from fastdata.format.manifest import Manifest, ManifestError, ShardInfo, SplitInfo
from fastdata.format.manifest_io import load_manifest
from fastdata.format.schema import VIDEO_ENCODING
from fastdata.format.summary import summarize
from fastdata.read.decoders.dict_batch import SampleSpec, decode_fields
from fastdata.read.decoders.image import Geometry, decode_image, decode_raw
from fastdata.read.decoders.video import check_video
from fastdata.read.rows import RowReader
from fastdata.read.shard_index import check_index_count, read_index_file
from fastdata.read.shardio import ShardReader, ShardReadError, _close, _open_bytes

__all__ = ["VerifyReport", "inspect_findings", "summarize", "verify"]


@dataclass
class VerifyReport:
    """What `verify` found: a manifest that cannot be read, shards whose bytes or index changed,
    and samples that cannot be read."""

    shards_checked: int = 0
    samples_checked: int = 0
    bad_shards: list[str] = field(default_factory=list)
    bad_samples: list[str] = field(default_factory=list)
    bad_manifest: str | None = None

    @property
    def ok(self) -> bool:
        return not self.bad_shards and not self.bad_samples and self.bad_manifest is None

    def __str__(self) -> str:
        if self.bad_manifest is not None:
            return f"bad manifest: {self.bad_manifest}"
        head = f"checked {self.shards_checked} shards, {self.samples_checked:,} samples: " + (
            "OK"
            if self.ok
            else f"{len(self.bad_shards)} bad shards, {len(self.bad_samples)} bad samples"
        )
        return "\n".join(
            [
                head,
                *(f"  bad shard  {s}" for s in self.bad_shards),
                *(f"  bad sample {s}" for s in self.bad_samples),
            ]
        )


def inspect_findings(manifest: Manifest) -> list[str]:
    """Cheap checks of a local shard folder (what `fastdata inspect` adds to the summary): each
    tar is a regular file of the manifest's size, each index matches its sha256, parses, and
    lists the manifest's sample count. Remote datasets: nothing is fetched (use `verify`)."""
    findings: list[str] = []
    if "://" in manifest.root:
        return findings
    for split in manifest.splits.values():
        for shard in split.shards:
            try:
                fd = open_regular(manifest.shard_url(shard))
                size = os.fstat(fd).st_size
                os.close(fd)
                if size != shard.bytes:
                    findings.append(f"{shard.name}: {size} bytes, the manifest says {shard.bytes}")
                _read_index(manifest, shard)
            except (OSError, IntegrityError, ShardReadError) as exc:
                reason = exc.reason if isinstance(exc, ShardReadError) else str(exc)
                findings.append(f"{shard.name}: {reason}")
    return findings


def verify(root: str | os.PathLike[str], progress: bool = True) -> VerifyReport:
    """Re-hash every shard and index against the manifest and read every sample (tar header,
    label, per-sample digest when the shard has one) and decode every field of it as the
    loaders do; list what is bad.

    A manifest that cannot be loaded is reported (`VerifyReport.bad_manifest`), not raised.
    """
    report = VerifyReport()
    try:
        manifest = load_manifest(root)
    except ManifestError as exc:
        report.bad_manifest = str(exc)
        return report
    total = sum(split.num_samples for split in manifest.splits.values())
    bar = tqdm(total=total, unit="img", desc=f"verifying {root}", disable=not progress)
    for split_name, split in manifest.splits.items():
        reader = ShardReader(manifest, split_name, max_open=1, verify_samples=True)
        sizes = tuple(shard.num_samples for shard in split.shards)
        rows = RowReader(
            reader, sizes, train=False, classification=is_classification(split.field_specs)
        )
        spec = _sample_spec(manifest, split)
        shape = tuple(split.raw_shape) if split.encoding == "raw" and split.raw_shape else None
        for number, shard in enumerate(split.shards):
            report.shards_checked += 1
            try:
                _check_shard(manifest, shard, report, reader, number)
                video = split.encoding == VIDEO_ENCODING
                _check_samples(rows, number, shard.num_samples, spec, shape, report, video)
            except (ShardReadError, OSError, IntegrityError) as exc:
                reason = exc.reason if isinstance(exc, ShardReadError) else str(exc)
                report.bad_shards.append(f"{shard.name}: {reason}")
            bar.update(shard.num_samples)
        reader.close()
    bar.close()
    return report


def _check_shard(
    manifest: Manifest, shard: ShardInfo, report: VerifyReport, reader: ShardReader, number: int
) -> None:
    """The whole tar's sha256 and size, and the index's sha256 (a finding each).

    A remote shard is fetched once, as the store serves it now (not through the node's cache,
    which may hold an older copy): `reader` then reads its samples from the same bytes.
    """
    url = manifest.shard_url(shard)
    data = _open_bytes(url, shard.name)  # local (memory-mapped) or remote (fetched whole)
    digest = hashlib.sha256(data).hexdigest()
    size = len(data)
    if "://" in url:
        reader.use_bytes(number, data)
    else:
        _close(data)
    if digest != shard.sha256 or size != shard.bytes:
        report.bad_shards.append(
            f"{shard.name}: sha256/size differ from the manifest (file changed or truncated)"
        )
    try:
        _read_index(manifest, shard)
    except ShardReadError as exc:
        report.bad_shards.append(f"{shard.name}: {exc.reason}")


def _read_index(manifest: Manifest, shard: ShardInfo) -> None:
    """Load, check and parse the shard's index (FileNotFoundError is fine: the tar is scanned)."""
    try:
        index = read_index_file(manifest.index_url(shard), shard)
    except FileNotFoundError:
        return
    check_index_count(index, shard)


def _index_readable(reader: ShardReader, shard: int, report: VerifyReport) -> bool:
    """False (the shard reported once as bad) when the shard's index cannot be read."""
    name = reader.shards[shard].name
    try:
        reader.key(shard, 0)
    except ShardReadError as exc:
        if not any(b.startswith(f"{name}: ") for b in report.bad_shards):
            report.bad_shards.append(f"{name}: {exc.reason}")
        return False
    return True


def _sample_spec(manifest: Manifest, split: SplitInfo) -> SampleSpec | None:
    """What the loaders decode a dict split's samples with (`fastdata.read.decoders.dict_batch.sample_spec`), at the
    stored size; None for a classification split (read as the loaders read its `(x, y)`)."""
    fields = split.field_specs  # the manifest's fields, or the image + label of older ones
    if is_classification(fields):
        return None
    return SampleSpec(
        fields=dict(fields),
        preset=get_preset("none"),
        train=False,
        out_hw=None,
        raw_shape=tuple(split.raw_shape) if split.encoding == "raw" and split.raw_shape else None,
        num_classes=manifest.num_classes,
    )


def _check_samples(
    rows: RowReader,
    shard: int,
    count: int,
    spec: SampleSpec | None,
    shape: tuple[int, ...] | None,
    report: VerifyReport,
    video: bool = False,
) -> None:
    """Read and decode every sample of one shard through the loaders' row reader (a finding per
    bad sample, naming the shard, the key and, for a dict split, the field).

    A classification sample is its label (from `lid`, or a foreign shard's `cls`) and its image
    (`jpg`/`png`/`rgb`); a dict sample is every field of the split (`decode_fields`); a video
    sample is its label, its clip index and its first and last frames (`check_video`).
    """
    rng = np.random.default_rng(0)
    name = rows.reader.shards[shard].name
    if not _index_readable(rows.reader, shard, report):
        return
    for index in range(count):
        report.samples_checked += 1
        key = rows.reader.key(shard, index)
        try:
            if video:
                check_video(rows.reader.sample(shard, index))
                continue
            sample = rows.sample(shard, index)
            if spec is not None:
                decode_fields(rows, sample, spec)  # raises ShardReadError (on_error="raise")
                continue
            ext, image = sample.image
            if ext == "rgb" and shape is not None:
                decode_raw(image, shape)
            else:
                decode_image(image, Geometry("none"), rng)
        except (ShardReadError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, ShardReadError) else str(exc)
            report.bad_samples.append(f"{name} {key}: {reason}")
