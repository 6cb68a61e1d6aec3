"""The output folder's lock: a second run refuses at once; a killed run's lock is taken over."""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fastdata
from fastdata.write import FolderLockedError, Part, ShardOptions, write_part, write_shards
from fastdata.write.lock import LOCK_NAME, lock_folder
from fastdata.write.sources import FolderSource

OPTS = ShardOptions(max_count=2, workers=1, progress=False)
_HOLDER = """
import sys
from pathlib import Path
from fastdata.write.lock import lock_folder
with lock_folder(Path(sys.argv[1]), shared=sys.argv[2] == "shared"):
    print("locked", flush=True)
    sys.stdin.read()
"""


def _dataset(root: Path) -> Path:
    for i in range(4):
        path = root / f"c{i % 2}" / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((4, 4, 3), i, np.uint8)).save(path)
    return root


@contextmanager
def _holder(out: Path, mode: str = "exclusive") -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock of `out` until the block ends (or it is killed)."""
    env = {**os.environ, "PYTHONPATH": str(Path(fastdata.__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().strip() == "locked", "the holder did not lock"
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=30)


def test_a_second_run_refuses_at_once_naming_the_lock_and_pid(tmp_path: Path) -> None:
    src = FolderSource(_dataset(tmp_path / "ds"))
    out = tmp_path / "out"
    with _holder(out) as proc:
        with pytest.raises(FolderLockedError) as info:
            write_shards(src, out, OPTS)
        message = str(info.value)
        assert str(out / LOCK_NAME) in message and f"pid {proc.pid}" in message
        assert not list(out.glob("*.tar")) and not (out / "manifest.json").exists()
        with pytest.raises(FolderLockedError, match="after waiting 0.3 s"):
            write_shards(src, out, ShardOptions(**{**OPTS.__dict__, "lock_timeout": 0.3}))
        with pytest.raises(FolderLockedError):  # parts do not run beside a whole run
            write_part(src, out, OPTS, Part(0, 2))
    manifest = write_shards(src, out, OPTS)  # the holder is gone: the run goes ahead
    assert manifest.splits["train"].num_samples == 4
    assert not (out / LOCK_NAME).exists()  # released and removed


def test_a_lock_left_by_a_killed_run_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = FolderSource(_dataset(tmp_path / "ds"))
    out = tmp_path / "out"
    with _holder(out) as proc:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert f"pid {proc.pid}" in (out / LOCK_NAME).read_text()  # left behind by the dead run
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        manifest = write_shards(src, out, OPTS)
    assert manifest.splits["train"].num_samples == 4
    assert f"stale lock (pid {proc.pid}" in caplog.text
    assert not (out / LOCK_NAME).exists()


def test_parts_share_the_lock(tmp_path: Path) -> None:
    src = FolderSource(_dataset(tmp_path / "ds"))
    out = tmp_path / "out"
    with _holder(out, "shared"):
        report = write_part(src, out, OPTS, Part(1, 2))  # another part holds it: fine
        assert report.shards
        with pytest.raises(FolderLockedError):  # but not a whole run
            write_shards(src, out, OPTS)


def test_one_process_cannot_lock_a_folder_twice(tmp_path: Path) -> None:
    src = FolderSource(_dataset(tmp_path / "ds"))
    with lock_folder(tmp_path / "out"):
        with pytest.raises(FolderLockedError, match="held by this process"):
            write_shards(src, tmp_path / "out", OPTS)
    assert write_shards(src, tmp_path / "out", OPTS).splits["train"].num_samples == 4


def test_a_file_system_without_locks_warns_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, mode: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    src = FolderSource(_dataset(tmp_path / "ds"))
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        manifest = write_shards(src, tmp_path / "out", OPTS)
    assert manifest.splits["train"].num_samples == 4
    assert "does not support locks (No locks available)" in caplog.text


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd")
def test_a_forked_child_does_not_keep_the_folder_locked(tmp_path: Path) -> None:
    """A writer worker forked while the lock is held has no descriptor of the lock file (an
    flock lives as long as any copy of its descriptor: `LockFile` closes them in a child)."""
    out = tmp_path / "out"
    with lock_folder(out) as path:
        child = os.fork()
        if child == 0:  # the child: exit 1 if any descriptor of it is the lock file
            fds = Path("/proc/self/fd")
            names = []
            for fd in fds.iterdir():
                try:
                    names.append(os.readlink(fd))
                except OSError:
                    pass
            os._exit(1 if str(path) in names else 0)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child kept the lock's descriptor"
