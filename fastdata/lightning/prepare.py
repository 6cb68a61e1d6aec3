"""Sharding in `prepare_data`: a DataModule given a source writes its own shard folder.

Lightning's convention for "convert the data once" is `LightningDataModule.prepare_data` (run by
local rank 0 of each node, or by global rank 0 alone with ``prepare_data_per_node = False``),
as torchvision's ``download=True`` is for a dataset::

    dm = ShardDataModule(
        "shards/clothing",
        source=ShardSource("folder", "data/clothing-small", options=ShardOptions(max_count=500)),
    )
    trainer.fit(model, datamodule=dm)  # prepare_data shards once; later runs find the shards

What each step does, and why it is safe to run from every node:

1. `prepare_shards` (prepare_data) opens the source and computes the identity the writer
   records (`fastdata.write.writer.dataset_identity`: kind, the source's fingerprint, the
   options that change the bytes). A complete manifest of that identity: nothing is written,
   not even the lock file. A manifest or an unfinished run of another identity: a
   `SourceMismatchError` naming both. Else `write_shards`, which holds the folder's lock
   (`fastdata.write.lock`: another node sharding into a shared folder waits for it, up to
   `ShardSource.timeout`, then finds the manifest and writes nothing) and resumes the shards
   a killed run finished. Its progress bar shows on global rank 0 only.
2. `await_shards` (setup, on every rank) waits, bounded by `ShardSource.timeout`, for the
   manifest a writing rank is making: with ``prepare_data_per_node = False`` the other nodes
   never shard and need the writer's folder (on a shared file system). Past the timeout:
   `ShardsNotReadyError`, naming the folder and the timeout.
3. `check_recorded` (setup, every rank) compares the manifest's recorded kind and options
   with the source's, without opening the source (a node-local folder left by another run).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastdata.format.manifest import MANIFEST_NAME, Manifest, ManifestError
from fastdata.format.manifest_io import load_manifest
from fastdata.write import ShardingError, ShardOptions, write_shards
from fastdata.write.carve import carve_source
from fastdata.write.outdir import WORK_DIR, same_identity
from fastdata.write.sources import REGISTRY, BadSourceError, open_source
from fastdata.write.writer import dataset_identity

__all__ = [
    "ShardSource",
    "ShardsNotReadyError",
    "SourceMismatchError",
    "await_shards",
    "check_recorded",
    "check_source",
    "load_prepared",
    "prepare_shards",
]

log = logging.getLogger("fastdata")
_POLL_S = 0.2
_PATH_KEYS = ("root", "path", "images", "annotations")  # where fingerprints name their input


class SourceMismatchError(ShardingError):
    """The shard folder holds shards of another source or other options than the one given."""


class ShardsNotReadyError(TimeoutError):
    """No manifest appeared in the shard folder within the wait (the writing rank's)."""


@dataclass(frozen=True)
class ShardSource:
    """A dataset for a `ShardDataModule` to shard in `prepare_data` (see the module doc).

    Args:
        kind: a source kind of `fastdata.write.sources.REGISTRY` ("folder", "cifar100",
            "list", "coco", "segmentation", "parquet", ...), as `fastdata shard KIND` takes.
        path: its input (folder, archive, list or Parquet file), or a list of inputs for a kind
            that takes several (coco: images and annotations; segmentation: images and masks);
            None only for CIFAR with ``args={"download": True}``.
        options: how to shard it (`fastdata.write.ShardOptions`); `progress` shows on global
            rank 0 only.
        args: the source's own keyword options (`fastdata.write.sources.open_source`), e.g.
            ``{"label": "coarse"}`` or ``{"root": "images/"}``.
        timeout: seconds a rank waits for another one's sharding: for the folder's lock in
            `prepare_data` (another node sharding into a shared folder) and for the manifest
            in `setup` (``prepare_data_per_node = False``). Past it, an error says what to do.

    Raises:
        ValueError: an unknown kind, or a timeout that is not > 0.
    """

    kind: str
    path: str | list[str] | None = None
    options: ShardOptions = field(default_factory=ShardOptions)
    args: Mapping[str, Any] | None = None
    timeout: float = 1800.0

    def __post_init__(self) -> None:
        if self.kind not in REGISTRY:
            raise ValueError(
                f"unknown source kind {self.kind!r}; expected one of {', '.join(REGISTRY)}"
            )
        if not self.timeout > 0:
            raise ValueError(f"ShardSource timeout must be > 0 seconds, got {self.timeout!r}")
        # Paths as strings: plain data in a checkpoint (`save_hyperparameters`, weights_only).
        if isinstance(self.path, (list, tuple)):
            object.__setattr__(self, "path", [os.fspath(p) for p in self.path])
        elif self.path is not None:
            object.__setattr__(self, "path", os.fspath(self.path))
        if self.args:
            plain = {
                k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in self.args.items()
            }
            object.__setattr__(self, "args", plain)

    def inputs(self) -> list[str | None]:
        """The positional inputs of `open_source`, as paths (a None input stays None)."""
        if isinstance(self.path, list):
            return list(self.path)
        return [self.path]

    def describe(self) -> str:
        """How messages name it: kind and inputs."""
        shown = " + ".join(str(p) for p in self.inputs())
        return f"{self.kind} source {shown}"


def check_source(spec: object, roots: list[str], mixed: bool) -> None:
    """Refuse a `source=` that is not a `ShardSource`, or one given with a mix or a URL.

    Raises:
        TypeError: not a `ShardSource`.
        ValueError: a mix of roots, or a remote root (names it).
    """
    if not isinstance(spec, ShardSource):
        raise TypeError(f"source must be a ShardSource(kind, path, ...), got {spec!r}")
    if mixed:
        raise ValueError(
            f"source= shards one folder, but root is a mix of {', '.join(roots)}: give each "
            "dataset its own ShardDataModule(root, source=...) and call prepare_data() on each, "
            "or shard them with `fastdata shard`, then mix the folders"
        )
    if "://" in roots[0]:
        raise ValueError(
            f"source= writes a local shard folder, but root {roots[0]!r} is a URL: shard to it "
            f"with `fastdata shard KIND INPUT {roots[0]}` (written locally, then uploaded), "
            "or give a local root"
        )


def prepare_shards(spec: ShardSource, root: str | os.PathLike[str], progress: bool) -> Manifest:
    """Shard `spec` into `root` unless it holds them already (rule 1 of the module doc).

    Args:
        spec: the source and options.
        root: the shard folder.
        progress: show the writer's progress bar (global rank 0), if `spec.options` does.

    Returns:
        The folder's manifest (found or written).

    Raises:
        SourceMismatchError: `root` holds shards, finished or not, of another source or options.
        fastdata.write.FolderLockedError: another run held the folder past `spec.timeout`.
        fastdata.write.sources.BadSourceError: the source cannot be read, and `root` holds no
            manifest (with one, its recorded kind and options are checked and it is used).
    """
    out = Path(root)
    try:
        source = open_source(spec.kind, *spec.inputs(), **dict(spec.args or {}))
    except (BadSourceError, OSError) as exc:
        if not (out / MANIFEST_NAME).exists():
            raise
        # A node (or a run) that has the shards but not the raw data: the manifest's recorded
        # kind and options are checked, its fingerprint cannot be.
        manifest = load_manifest(out)
        check_recorded(spec, manifest, out)
        log.warning(
            "%s: the source cannot be read (%s); using the shards already there, written with "
            "this kind and these options (their input could not be compared)",
            out, exc,
        )  # fmt: skip
        return manifest
    options = spec.options
    identity = dataset_identity(carve_source(source, options.val_fraction, options.seed), options)
    recorded, finished = _recorded_identity(out)
    if recorded is not None and same_identity(recorded, identity) and finished:
        log.info("%s already holds the shards of %s; nothing to write", out, spec.describe())
        return load_manifest(out)
    if recorded is not None and not same_identity(recorded, identity) and not options.overwrite:
        raise SourceMismatchError(_mismatch_message(out, recorded, identity, finished))
    writing = replace(
        options,
        progress=options.progress and progress,
        lock_timeout=max(options.lock_timeout, spec.timeout),
        # Only over another dataset seen here: shards another node finished (or left to resume)
        # while this one waited for the folder's lock are this dataset's, not written again.
        overwrite=options.overwrite
        and recorded is not None
        and not same_identity(recorded, identity),
    )
    return write_shards(source, out, writing)


def await_shards(spec: ShardSource, root: str | os.PathLike[str]) -> None:
    """Wait up to `spec.timeout` for `root`'s manifest (rule 2 of the module doc).

    Raises:
        ShardsNotReadyError: no manifest within the timeout (names the folder and the timeout).
    """
    path = Path(root) / MANIFEST_NAME
    deadline = time.monotonic() + spec.timeout
    waited = False
    while not path.exists():
        if time.monotonic() >= deadline:
            raise ShardsNotReadyError(
                f"{path} did not appear within {spec.timeout:g} s: no rank finished sharding "
                f"{spec.describe()} into {path.parent}. The rank that runs prepare_data() "
                "writes it: with prepare_data_per_node=False only global rank 0 does, so the "
                "folder must be on a file system every node reaches; otherwise set "
                "prepare_data_per_node=True (each node shards its own copy). For a long "
                "sharding raise ShardSource(timeout=...); without a Trainer (Fabric, your own "
                "loop) call dm.prepare_data() on one rank per node before dm.setup()."
            )
        if not waited:
            log.info("%s: waiting up to %g s for its manifest", path.parent, spec.timeout)
            waited = True
        time.sleep(_POLL_S)


def check_recorded(spec: ShardSource, manifest: Manifest, root: str | os.PathLike[str]) -> None:
    """Refuse a manifest whose recorded kind or options are not `spec`'s (rule 3).

    The source is not opened: its fingerprint is `prepare_shards`' check, on the writing rank.

    Raises:
        SourceMismatchError: another kind, or other byte options (names both).
    """
    recorded = manifest.source
    wanted = spec.options.signature()
    options = dict(recorded.get("options") or {})
    if spec.options.encoding == "auto":  # recorded resolved ("raw", "keep", ...)
        options.pop("encoding", None)
        wanted.pop("encoding", None)
    if recorded.get("kind") == spec.kind and options == wanted:
        return
    given = " + ".join(str(p) for p in spec.inputs())
    asked = {"kind": spec.kind, "fingerprint": {"path": given}, "options": wanted}
    raise SourceMismatchError(_mismatch_message(Path(root), recorded, asked, True, False))


def load_prepared(spec: ShardSource, root: str | os.PathLike[str]) -> Manifest:
    """`root`'s manifest; before `prepare_data` wrote it, an error that says to call it.

    Raises:
        fastdata.format.manifest.ManifestError: no manifest yet (or an unreadable one).
    """
    if not (Path(root) / MANIFEST_NAME).exists():
        raise ManifestError(
            f"no {MANIFEST_NAME} in {root} yet: prepare_data() writes it from "
            f"{spec.describe()} (Trainer.fit calls it first); call dm.prepare_data() before "
            "reading num_classes, classes or image_shape"
        )
    return load_manifest(root)


def _recorded_identity(out: Path) -> tuple[dict[str, Any] | None, bool]:
    """(the identity recorded in `out`, whether its sharding finished): the manifest's source,
    else an unfinished run's plan (`fastdata.write.outdir`), else (None, False)."""
    if (out / MANIFEST_NAME).exists():
        return dict(load_manifest(out).source), True
    plan = out / WORK_DIR / "plan.json"
    if plan.exists():
        return json.loads(plan.read_text()), False
    return None, False


def _mismatch_message(
    out: Path,
    recorded: Mapping[str, Any],
    identity: Mapping[str, Any],
    finished: bool,
    fingerprints: bool = True,
) -> str:
    state = "shards" if finished else "an unfinished sharding"
    differ = ", ".join(_differences(recorded, identity, fingerprints))
    return (
        f"{out} holds {state} of {_describe(recorded)}, but this DataModule's source is "
        f"{_describe(identity)} (they differ in {differ}). "
        "Point the DataModule at another folder, or pass ShardOptions(overwrite=True) to "
        f"replace what {out} holds (its shard files, index files and manifest are removed)."
    )


def _describe(identity: Mapping[str, Any]) -> str:
    fingerprint = identity.get("fingerprint") or {}
    paths = [str(fingerprint[k]) for k in _PATH_KEYS if fingerprint.get(k) is not None]
    shown = " + ".join(paths) or "(path not recorded)"
    return f"{identity.get('kind')!r} {shown} with options {identity.get('options')}"


def _differences(
    recorded: Mapping[str, Any], identity: Mapping[str, Any], fingerprints: bool
) -> list[str]:
    """The fields that differ: 'kind', 'options.<name>', 'source <fingerprint key>' (the
    input's path, files, bytes, times: a source changed since it was sharded)."""
    found = ["kind"] if recorded.get("kind") != identity.get("kind") else []
    mine, theirs = dict(identity.get("options") or {}), dict(recorded.get("options") or {})
    keys = sorted(mine.keys() | theirs.keys())
    found += [f"options.{k}" for k in keys if mine.get(k) != theirs.get(k)]
    if fingerprints:
        old, new = dict(recorded.get("fingerprint") or {}), dict(identity.get("fingerprint") or {})
        found += [f"source {k}" for k in sorted(old.keys() & new.keys()) if old[k] != new[k]]
    return found or ["format version"]
