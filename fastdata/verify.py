"""`fastdata inspect` and `fastdata verify`: look at a shard folder, and check every byte of it."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from fastdata.manifest import Manifest, load_manifest
from fastdata.read.decode import Geometry, decode_image, decode_raw
from fastdata.read.shardio import ShardReader, ShardReadError, _close, _open_bytes

__all__ = ["VerifyReport", "summarize", "verify"]


def summarize(manifest: Manifest) -> str:
    """A human-readable summary of a manifest (what `fastdata inspect` prints)."""
    lines = [
        f"{manifest.root}: {manifest.source.get('kind')} shards, fastdata {manifest.fastdata_version}, "
        f"format v{manifest.format_version}, seed {manifest.seed}",
        f"classes: {manifest.num_classes} ({', '.join(manifest.classes[:5])}"
        f"{', ...' if manifest.num_classes > 5 else ''})",
    ]
    for name, split in manifest.splits.items():
        total_bytes = sum(s.bytes for s in split.shards)
        counts = [c for c in split.class_counts]
        stats = split.image_stats
        size = (
            f"{stats.get('min_height')}-{stats.get('max_height')} x {stats.get('min_width')}-{stats.get('max_width')}"
            if stats
            else "-"
        )
        lines.append(
            f"  {name:<11} {split.num_samples:>9,} samples in {len(split.shards):>4} shards, "
            f"{total_bytes / 2**20:9.1f} MiB, encoding {split.encoding}, HxW {size}, "
            f"per class {min(counts) if counts else 0}-{max(counts) if counts else 0}, "
            f"skipped {len(split.skipped)}"
        )
        for skipped in split.skipped[:10]:
            lines.append(f"      skipped {skipped.origin}: {skipped.reason}")
    return "\n".join(lines)


@dataclass
class VerifyReport:
    """What `verify` found: shards whose bytes changed, and samples that cannot be read."""

    shards_checked: int = 0
    samples_checked: int = 0
    bad_shards: list[str] = field(default_factory=list)
    bad_samples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_shards and not self.bad_samples

    def __str__(self) -> str:
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


def verify(root: str | os.PathLike[str], progress: bool = True) -> VerifyReport:
    """Re-hash every shard against the manifest and decode every sample; list what is bad."""
    manifest = load_manifest(root)
    report = VerifyReport()
    total = sum(split.num_samples for split in manifest.splits.values())
    bar = tqdm(total=total, unit="img", desc=f"verifying {root}", disable=not progress)
    for split_name, split in manifest.splits.items():
        reader = ShardReader(manifest, split_name, max_open=1)
        shape = tuple(split.raw_shape) if split.encoding == "raw" and split.raw_shape else None
        for number, shard in enumerate(split.shards):
            report.shards_checked += 1
            try:
                data = _open_bytes(manifest.shard_url(shard), shard.name)  # local or remote
            except ShardReadError as exc:
                report.bad_shards.append(f"{shard.name}: {exc.reason}")
                bar.update(shard.num_samples)
                continue
            digest = hashlib.sha256(data).hexdigest()
            size = len(data)
            _close(data)
            if digest != shard.sha256 or size != shard.bytes:
                report.bad_shards.append(
                    f"{shard.name}: sha256/size differ from the manifest (file changed or truncated)"
                )
            _check_samples(reader, number, shard.num_samples, shape, report)
            bar.update(shard.num_samples)
        reader.close()
    bar.close()
    return report


def _check_samples(
    reader: ShardReader, shard: int, count: int, shape, report: VerifyReport
) -> None:
    rng = np.random.default_rng(0)
    name = reader.shards[shard].name
    try:
        reader.key(shard, 0)
    except ShardReadError as exc:
        report.bad_shards.append(f"{name}: {exc.reason}")
        return
    for index in range(count):
        report.samples_checked += 1
        key = reader.key(shard, index)
        try:
            components = reader.sample(shard, index)
            image = next((components[e] for e in ("rgb", "jpg", "png") if e in components), None)
            if image is None or "lid" not in components:
                raise ValueError(f"missing components (has {sorted(components)})")
            if shape is not None:
                decode_raw(image, shape)
            else:
                decode_image(image, Geometry("none"), rng)
        except (ShardReadError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, ShardReadError) else str(exc)
            report.bad_samples.append(f"{name} {key}: {reason}")
