"""The output folder of a sharding: what may be in it, and how a run makes it ready.

A run writes only into an empty folder, a folder holding an unfinished sharding of the same
input and options (resumed), or, with `overwrite`, a folder whose shard files, index files and
manifest it may remove. The lock file (`fastdata.write.lock`) is neither ours to remove nor
foreign.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from fastdata.format.manifest import MANIFEST_NAME, Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.write.errors import ShardingError
from fastdata.write.lock import LOCK_NAME

__all__ = ["CACHE_DIR", "WORK_DIR", "atomic_write", "prepare_out", "same_identity"]

WORK_DIR = ".fastdata-work"


def prepare_out(out_dir: Path, identity: dict[str, Any], overwrite: bool) -> Manifest | None:
    """Check `out_dir`: the same finished dataset (returned), a resumable one, empty, or refused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / WORK_DIR
    plan_file = work / "plan.json"
    manifest_file = out_dir / MANIFEST_NAME
    if manifest_file.exists():
        manifest = load_manifest(out_dir)
        if same_identity(manifest.source, identity) and not overwrite:
            return manifest
        if not overwrite:
            raise ShardingError(
                f"{out_dir} already holds a different dataset (manifest source "
                f"{manifest.source.get('kind')!r}, options {manifest.source.get('options')}); "
                "pass --overwrite to replace it, or choose another output folder"
            )
        _clear_ours(out_dir)
    elif plan_file.exists():
        previous = json.loads(plan_file.read_text())
        if not same_identity(previous, identity):
            if not overwrite:
                raise ShardingError(
                    f"{out_dir} holds an unfinished sharding of a different input or options; "
                    "pass --overwrite to discard it"
                )
            _clear_ours(out_dir)
    else:
        present = [p for p in out_dir.iterdir() if p.name != LOCK_NAME]
        foreign = [p.name for p in present if not _is_ours(p)]
        ours = [p.name for p in present if _is_ours(p)]
        if (foreign or ours) and not overwrite:
            shown = ", ".join(sorted(foreign + ours)[:5])
            raise ShardingError(
                f"{out_dir} is not empty ({shown}...); choose an empty folder or pass --overwrite "
                "(which removes only shard files, index files and the manifest)"
            )
        _clear_ours(out_dir)
    work.mkdir(exist_ok=True)
    # Partial files of a killed run: never under a final name, removed before resuming.
    for tmp in [*out_dir.glob("*.tmp-*"), *work.glob("*.tmp-*")]:
        tmp.unlink()
    atomic_write(plan_file, json.dumps(identity, sort_keys=True))
    return None


def same_identity(recorded: dict[str, Any], identity: dict[str, Any]) -> bool:
    keys = ("kind", "fingerprint", "options", "format_version")
    return all(recorded.get(k) == identity.get(k) for k in keys)


CACHE_DIR = (
    ".fastdata-cache"  # decoded splits of the memory backend (fastdata.read.backends.memory)
)


def _is_ours(path: Path) -> bool:
    return (
        path.name in (MANIFEST_NAME, WORK_DIR, CACHE_DIR)
        or path.suffix in (".tar", ".idx", ".sum")  # .sum: per-sample digests (read/integrity)
        or ".tmp-" in path.name
    )


def _clear_ours(out_dir: Path) -> None:
    for path in out_dir.iterdir():
        if path.name in (WORK_DIR, CACHE_DIR):
            shutil.rmtree(path)
        elif _is_ours(path):
            path.unlink()


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` under a temporary name, then rename it into place."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
