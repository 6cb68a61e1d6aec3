"""`fastdata index`'s output: files written under temporary names, then renamed into place.

Nothing is half-written after a failure: every index and digest file (and an inflated tar's
copy) is written as `<file>.tmp-<pid>` and renamed when all are written, the manifest last. A
run killed outright (SIGKILL runs no `finally`) leaves its temporaries; the next run into the
same folder removes them (`remove_stale_temporaries`), and only those: fastdata's own names,
of a PID that is no running process.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from fastdata.format.manifest import Manifest
from fastdata.write.foreign import ScannedTar

__all__ = ["remove_stale_temporaries", "write_index_files"]

log = logging.getLogger("fastdata")


def write_index_files(
    out_dir: Path, tars: list[ScannedTar], manifest: Manifest, copies: dict[str, Path]
) -> None:
    """Every index and digest file under a temporary name, then renamed with the inflated
    tars' copies (`copies`: stored name -> temporary path); the manifest last."""
    suffix = f".tmp-{os.getpid()}"
    pending: list[tuple[Path, Path]] = [(tmp, out_dir / name) for name, tmp in copies.items()]
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for tar in tars:
            stem = tar.name.removesuffix(".tar")
            for ext, text in ((".idx", tar.index_text), (".sum", tar.sums_text)):
                final = out_dir / (stem + ext)
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp = final.with_name(final.name + suffix)
                tmp.write_text(text)
                pending.append((tmp, final))
        for tmp, final in pending:
            os.replace(tmp, final)
        manifest.save(out_dir)
    finally:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)


# What `write_index_files` and `Manifest.save` name their temporaries: `<file>.tmp-<pid>`.
_TEMPORARY = re.compile(r"(?:.+\.idx|.+\.sum|.+\.tar|manifest\.json)\.tmp-([0-9]{1,10})")


def remove_stale_temporaries(folders: Iterable[Path]) -> None:
    """Remove the temporaries of an earlier run killed while writing (a SIGKILL runs no `finally`).

    Only fastdata's own names (`<tar>.idx.tmp-PID`, `<tar>.sum.tmp-PID`, `<tar>.tar.tmp-PID` (an
    inflated copy), `manifest.json.tmp-PID`)
    whose PID is no running process: another run writing into OUT now keeps its files, and a
    user's file of any other name is never touched.
    """
    removed = []
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:  # not there yet, or unreadable: nothing of ours to find
            continue
        for entry in entries:
            match = _TEMPORARY.fullmatch(entry.name)
            if match is None or _running(int(match.group(1))):
                continue
            if entry.is_file(follow_symlinks=False):
                Path(entry.path).unlink(missing_ok=True)
                removed.append(entry.name)
    if removed:
        log.info("removed %d temporary files of an interrupted run: %s", len(removed), removed[:3])


def _running(pid: int) -> bool:
    """Whether `pid` may be a running process (an unknown answer counts as running)."""
    if pid == os.getpid():  # an earlier run's PID, now ours: this run has written nothing yet
        return False
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)  # POSIX: a probe, no signal sent
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or a PID the OS cannot hold
        return True
    return True
