"""`fastdata index` killed outright (SIGKILL) in its write phase: its temporaries are removed by
the next run into the same folder, and only they (a live process's or a user's file stays)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fastdata.write.index import index_shards

# Runs `index_shards` in a child that SIGKILLs itself at its first rename: every `.idx` / `.sum`
# is written under its temporary name by then, and no `finally` runs.
_KILLED_RUN = """
import os, signal, sys
from fastdata.write.index import index_shards
os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
index_shards(sys.argv[1], sys.argv[2])
"""


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp-" in p.name)


def run_killed_index(src: Path, out: Path) -> None:
    """`fastdata index SRC OUT` in a child that SIGKILLs itself at its first rename."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(src), str(out)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()


def test_the_next_run_removes_a_killed_runs_temporaries(cls_shards: Path, tmp_path: Path):
    out = tmp_path / "out"
    run_killed_index(cls_shards, out)
    left = _temporaries(out)
    assert len(left) == 10, left  # 5 tars: an .idx and a .sum each
    assert len({_pid_of(name) for name in left}) == 1  # the killed child's PID
    assert not (out / "manifest.json").exists()
    live = out / "test-000000.idx.tmp-1"  # PID 1 is running: another run's file, kept
    live.write_text("another run's")
    mine = out / "notes.tmp-12345"  # not a name fastdata writes: kept
    mine.write_text("a user's")
    manifest = index_shards(cls_shards, out)
    assert manifest.split("train").num_samples == 20
    assert _temporaries(out) == sorted([live.name, mine.name])


def _pid_of(name: str) -> str:
    return name.rsplit(".tmp-", 1)[1]
