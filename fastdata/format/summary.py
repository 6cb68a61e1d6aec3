"""The one-screen summary of a shard folder's manifest (`fastdata shard`, `merge`, `inspect`).

Apart from `fastdata.read.verify` (which imports the readers, and so torch), so that the commands that
only write shards start without importing torch.
"""

from __future__ import annotations

from fastdata.format.manifest import Manifest

__all__ = ["summarize"]


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
        if split.fields is not None:
            lines.append(
                "      fields: "
                + ", ".join(
                    f"{n} ({f.kind}: {', '.join(f.components)})" for n, f in split.fields.items()
                )
            )
        for skipped in split.skipped[:10]:
            lines.append(f"      skipped {skipped.origin}: {skipped.reason}")
    return "\n".join(lines)
