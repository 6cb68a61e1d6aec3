"""Mixing datasets: several shard folders read as one split, each epoch drawing by weight.

    dm = ShardDataModule([ShardSet("shards/photos", weight=3), ShardSet("shards/extra")])

A mix is one *virtual* manifest (`mix_manifests`): each split holds every dataset's shards of
that split end to end, in the order the roots are given, each shard named by its full path or
URL, so every backend reads it as it reads one folder (`rows_to_refs`, `ShardReader`). What
makes it a mix:

- Epochs (training split only): `epoch_mix` gives the epoch plan the rows each epoch draws from
  each dataset (plan rule 0). Epoch size: `epoch_samples`, else the sum of the datasets'
  training sizes; dataset i gets ``n_i`` of it, shares rounded by largest remainder (ties to the
  earlier dataset) so that ``sum(n_i)`` is the epoch size and each ``n_i / size`` is within
  ``1 / size`` of ``w_i / sum(w)``. ``n_i`` below the dataset's size draws a fresh seeded
  subset each epoch (down-sampling); above it, whole copies plus a seeded subset (up-sampling).
- Evaluation splits (val / test): the concatenation, every sample once, no weights.
- Classes merged by name, in first-seen order: the first dataset's classes keep their labels,
  each later dataset's new classes follow in its own order. Every shard carries its dataset's
  label lookup (`ShardInfo.label_map`), which the backends apply wherever they read a label.
  A dataset without class names cannot be mixed (refused).
- A split is in the mix when every dataset has it (same name); pass ``splits=`` to name others.
- Images: all raw with one shape, or all encoded (JPEG/PNG: "mixed" when they differ); raw and
  encoded datasets are refused. Videos mix with videos only (`VideoDataModule` reads such a mix
  as clips: `fastdata.read.clips.clip_mix`); a video dataset with an image one is refused. Pixel
  statistics are combined weighted by each dataset's samples in the split.
- Resume: the training fingerprint covers each dataset's fingerprint, the weights and the epoch
  size (`fastdata.read.resume.dataset_fingerprint`), so a state from another mix is refused.
- Schedules: a weight may change with the global sample position (a `Schedule` table or a
  function, `fastdata.read.schedule`: plan rule 7, exact counts per batch). Such a mix resumes
  with another schedule (a warning names the position); between fixed and scheduled weights it
  does not (a state of one is refused by the other: start with a constant `Schedule` to keep
  the choice open).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from fastdata.format.manifest import Manifest, ManifestError, ShardInfo, SplitInfo
from fastdata.format.manifest_io import load_manifest
from fastdata.format.schema import VIDEO_ENCODING
from fastdata.read.plan import EpochMix
from fastdata.read.schedule import (
    MixResume,
    MixWeights,
    ScheduledMix,
    Weight,
    check_weight,
    share_counts,
)

__all__ = [
    "MIX_KIND",
    "epoch_mix",
    "epoch_size",
    "is_scheduled",
    "load_mix",
    "map_row_labels",
    "merge_classes",
    "mix_manifests",
    "mix_roots",
    "share_counts",
    "validate_weights",
]

#: `Manifest.source["kind"]` of a virtual manifest made by `mix_manifests`.
MIX_KIND = "mix"


def validate_weights(
    roots: Sequence[str], weights: Sequence[Weight] | None, epoch_samples: int | None = None
) -> tuple[Weight, ...]:
    """The mix's weights (default: all 1), checked against the roots.

    A fixed weight becomes a float; a `Schedule` or a function (`fastdata.read.schedule`) is kept.

    Raises:
        ValueError: wrong count, a fixed weight that is not a finite number > 0 (names its
            root), or `epoch_samples` < 1.
    """
    if not roots:
        raise ValueError("a mix needs at least one root")
    if weights is None:
        weights = [1.0] * len(roots)
    if len(weights) != len(roots):
        raise ValueError(
            f"got {len(weights)} weights for {len(roots)} roots ({list(roots)}): pass one weight "
            "per root"
        )
    checked = tuple(
        check_weight(f"the weight of {root}", w) for root, w in zip(roots, weights, strict=True)
    )
    if epoch_samples is not None and (isinstance(epoch_samples, bool) or epoch_samples < 1):
        raise ValueError(f"epoch_samples must be an int >= 1, got {epoch_samples!r}")
    return checked


def is_scheduled(weights: Sequence[Weight]) -> bool:
    """Whether any weight is a `Schedule` or a function (a scheduled mix: plan rule 7)."""
    return any(not isinstance(w, (int, float)) for w in weights)


def merge_classes(manifests: Sequence[Manifest]) -> tuple[list[str], list[tuple[int, ...]]]:
    """(the union of class names in first-seen order, each dataset's label -> merged label).

    Raises:
        ValueError: a dataset has no class names, or one name twice (names its root).
    """
    merged: dict[str, int] = {}
    maps = []
    for manifest in manifests:
        if not manifest.classes:
            raise ValueError(
                f"{manifest.root} has no class names: a mix merges classes by name, so every "
                "dataset needs them (re-shard it from a source with named classes)"
            )
        if len(set(manifest.classes)) != len(manifest.classes):
            twice = sorted({c for c in manifest.classes if manifest.classes.count(c) > 1})
            raise ValueError(f"{manifest.root} names classes more than once: {twice[:5]}")
        maps.append(tuple(merged.setdefault(name, len(merged)) for name in manifest.classes))
    return list(merged), maps


def mix_manifests(
    manifests: Sequence[Manifest],
    weights: Sequence[Weight] | None = None,
    epoch_samples: int | None = None,
) -> Manifest:
    """The virtual manifest of a mix (see the module docstring); never saved.

    Args:
        manifests: the datasets, in mix order (each loaded with `load_manifest`).
        weights: one weight per dataset (default: equal): a number > 0, or a `Schedule` or
            function of the global sample position (`fastdata.read.schedule`).
        epoch_samples: samples per training epoch (default: the datasets' training sizes).

    Raises:
        ValueError: bad weights, datasets without class names, raw and encoded datasets mixed,
            or raw datasets of different shapes.
    """
    roots = [m.root for m in manifests]
    weights = validate_weights(roots, weights, epoch_samples)
    classes, maps = merge_classes(manifests)
    common = [name for name in manifests[0].splits if all(name in m.splits for m in manifests)]
    splits = {
        name: _merge_split([m.split(name) for m in manifests], manifests, maps, len(classes))
        for name in common
    }
    from fastdata.read.resume import dataset_fingerprint  # resume imports the manifest only

    datasets = [
        {
            "root": m.root,
            "weight": w,
            "fingerprints": {name: dataset_fingerprint(m, name) for name in common},
            "shards": {name: len(m.split(name).shards) for name in common},
            "samples": {name: m.split(name).num_samples for name in common},
        }
        for m, w in zip(manifests, weights, strict=True)
    ]
    return Manifest(
        root=manifests[0].root,  # the decoded cache of the mix goes with the first dataset
        classes=classes,
        splits=splits,
        source={"kind": MIX_KIND, "datasets": datasets, "epoch_samples": epoch_samples},
        seed=manifests[0].seed,
        fastdata_version=manifests[0].fastdata_version,
    )


def load_mix(
    roots: Sequence[str | os.PathLike[str]],
    weights: Sequence[Weight] | None = None,
    epoch_samples: int | None = None,
) -> Manifest:
    """Load every root's manifest and mix them (`mix_manifests`); weights are checked first."""
    names = [os.fspath(r) for r in roots]
    validate_weights(names, weights, epoch_samples)
    return mix_manifests([load_manifest(r) for r in names], weights, epoch_samples)


def epoch_mix(
    manifest: Manifest, split: str, resume: MixResume | None = None
) -> EpochMix | ScheduledMix | None:
    """The rows each training epoch of `split` draws from each dataset; None outside a mix.

    A mix with a scheduled weight gives a `ScheduledMix` (plan rule 7), with the block and
    splice a resume kept (`fastdata.read.schedule.resume_schedule`); fixed weights an `EpochMix`
    (rule 0).
    """
    if manifest.source.get("kind") != MIX_KIND:
        return None
    datasets = manifest.source["datasets"]
    held = [d["samples"][split] for d in datasets]
    total = int(manifest.source.get("epoch_samples") or sum(held))
    shards = tuple(d["shards"][split] for d in datasets)
    weights = [d["weight"] for d in datasets]
    if is_scheduled(weights):
        roots = tuple(d["root"] for d in datasets)
        mix = ScheduledMix(shards, total, MixWeights(roots, tuple(weights)))
        if resume is not None:
            mix = ScheduledMix(shards, total, mix.weights, resume.block, resume.splice)
        return mix
    counts = share_counts(total, [float(w) for w in weights])
    for n, wanted, dataset in zip(held, counts, datasets, strict=True):
        if wanted and not n:
            raise ValueError(f"split {split!r} of {dataset['root']} is empty: it cannot be mixed")
    return EpochMix(shards, counts)


def epoch_size(manifest: Manifest, split: str) -> int:
    """Samples in a training epoch of `split`: a mix's draws, else the split's size."""
    mix = epoch_mix(manifest, split)
    return mix.total if mix is not None else manifest.split(split).num_samples


def mix_roots(
    root: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    weights: Sequence[Weight] | None = None,
    epoch_samples: int | None = None,
) -> tuple[list[str], bool]:
    """(the roots, whether they are a mix): a list of roots is a mix, even of one dataset.

    Raises:
        ValueError: `weights` or `epoch_samples` with a single (non-list) root, or bad weights.
    """
    if isinstance(root, (str, os.PathLike)):
        if weights is not None or epoch_samples is not None:
            raise ValueError(
                f"weights= and epoch_samples= describe a mix: pass root as a list, e.g. [{root!r}]"
            )
        return [os.fspath(root)], False
    roots = [os.fspath(r) for r in root]
    validate_weights(roots, weights, epoch_samples)
    return roots, True


def map_row_labels(info: SplitInfo, labels: torch.Tensor) -> torch.Tensor:
    """A split's labels in row order, with each shard's `label_map` applied (unchanged outside a
    mix). Rows of a skipped (corrupt) sample may hold any label: they are never read.

    Raises:
        ValueError: a stored label outside its dataset's classes (names the shard).
    """
    if all(shard.label_map is None for shard in info.shards):
        return labels
    out, start = labels.clone(), 0
    for shard in info.shards:
        rows = slice(start, start + shard.num_samples)
        start += shard.num_samples
        if shard.label_map is None:
            continue
        lookup = torch.tensor(shard.label_map, dtype=labels.dtype, device=labels.device)
        stored = labels[rows]
        if len(stored) and (int(stored.min()) < 0 or int(stored.max()) >= len(lookup)):
            raise ValueError(
                f"{shard.name} holds labels outside its dataset's {len(lookup)} classes; run "
                "`fastdata verify` on its shard folder"
            )
        out[rows] = lookup[stored]
    return out


# ---------------------------------------------------------------- internals


def _merge_split(
    infos: list[SplitInfo],
    manifests: Sequence[Manifest],
    maps: list[tuple[int, ...]],
    num_classes: int,
) -> SplitInfo:
    shards, counts = [], [0] * num_classes
    for info, manifest, label_map in zip(infos, manifests, maps, strict=True):
        masks = [n for n, f in info.field_specs.items() if f.kind == "mask"]
        if masks and tuple(label_map) != tuple(range(len(label_map))):
            raise ManifestError(
                f"{manifest.root}: its masks ({', '.join(masks)}) hold its own class indices, "
                "but its classes are not the first ones of the mix in the same order, and mask "
                "pixels are not remapped; give every dataset of a segmentation mix the same class "
                "list (the first dataset's, in order)"
            )
        for shard in info.shards:
            name = _absolute(manifest.shard_url(shard))
            index = _absolute(manifest.index_url(shard))
            sums = manifest.sums_url(shard)
            shards.append(
                ShardInfo(
                    name,
                    index,
                    shard.num_samples,
                    shard.bytes,
                    shard.sha256,
                    label_map,
                    shard.index_sha256,
                    _absolute(sums) if sums else None,
                    shard.sums_sha256,
                )
            )
        for label, count in enumerate(info.class_counts):
            counts[label_map[label]] += count
    encoding, raw_shape = _merge_encoding(infos, manifests)
    mean, std = _merge_pixels(infos)
    return SplitInfo(
        shards=shards,
        class_counts=counts,
        encoding=encoding,
        raw_shape=raw_shape,
        image_stats=_merge_stats(infos),
        skipped=[s for info in infos for s in info.skipped],
        pixel_mean=mean,
        pixel_std=std,
        fields=_merge_fields(infos, manifests),
    )


def _merge_fields(infos: list[SplitInfo], manifests: Sequence[Manifest]) -> dict | None:
    """The fields of a mix's split: every dataset's must be the same (None: classification)."""
    first = infos[0].fields
    for info, manifest in zip(infos, manifests, strict=True):
        if info.fields != first:  # classification splits (None) may differ in image encoding
            raise ValueError(
                f"a mix needs the same fields in every dataset: {manifests[0].root} holds "
                f"{sorted(infos[0].field_specs)}, {manifest.root} {sorted(info.field_specs)}"
            )
    return first


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


def _merge_encoding(
    infos: list[SplitInfo], manifests: Sequence[Manifest]
) -> tuple[str, list[int] | None]:
    def each(value: str) -> str:  # "root: value, ..." of every dataset, for messages
        return ", ".join(
            f"{m.root}: {getattr(i, value)}" for m, i in zip(manifests, infos, strict=True)
        )

    video = [info.encoding == VIDEO_ENCODING for info in infos]
    if any(video) and not all(video):
        raise ValueError(
            f"cannot mix video and image datasets ({each('encoding')}): a mix reads one kind of "
            "sample; mix only videos (VideoDataModule) or only images (ShardDataModule)"
        )
    raw = [info.encoding == "raw" for info in infos]
    if any(raw) and not all(raw):
        raise ValueError(
            f"cannot mix raw-pixel and encoded datasets ({each('encoding')}): re-shard one of "
            "them with `fastdata shard --encoding` to match the other"
        )
    shapes = {tuple(i.raw_shape) if i.raw_shape else None for i in infos}
    if all(raw) and len(shapes) > 1:
        raise ValueError(f"cannot mix raw datasets of different image shapes ({each('raw_shape')})")
    encodings = {info.encoding for info in infos}
    encoding = encodings.pop() if len(encodings) == 1 else "mixed"
    shape = shapes.pop() if len(shapes) == 1 else None
    return encoding, list(shape) if shape is not None else None


def _merge_stats(infos: list[SplitInfo]) -> dict[str, float]:
    if not all(info.image_stats for info in infos):
        return {}
    n = [info.num_samples for info in infos]
    out: dict[str, float] = {}
    for side in ("height", "width"):
        out[f"min_{side}"] = min(i.image_stats[f"min_{side}"] for i in infos)
        out[f"max_{side}"] = max(i.image_stats[f"max_{side}"] for i in infos)
        mean = sum(i.image_stats[f"mean_{side}"] * k for i, k in zip(infos, n, strict=True))
        out[f"mean_{side}"] = round(mean / max(1, sum(n)), 2)
    return out


def _merge_pixels(infos: list[SplitInfo]) -> tuple[list[float] | None, list[float] | None]:
    """Per-channel mean and std of the concatenated splits (weighted by samples)."""
    if any(i.pixel_mean is None or i.pixel_std is None for i in infos):
        return None, None
    n = [i.num_samples for i in infos]
    total = max(1, sum(n))
    mean = [
        sum(i.pixel_mean[c] * k for i, k in zip(infos, n, strict=True)) / total for c in range(3)
    ]
    square = [
        sum((i.pixel_std[c] ** 2 + i.pixel_mean[c] ** 2) * k for i, k in zip(infos, n, strict=True))
        / total
        for c in range(3)
    ]
    std = [math.sqrt(max(0.0, s - m * m)) for s, m in zip(square, mean, strict=True)]
    return mean, std
