"""The README's examples run as written.

Every ```python block of the README's "Quick start" and "In your Lightning code" runs, in order,
in one namespace, from a temporary project folder whose `../shared/data` points at the real data,
after the README's `fastdata shard` commands have made the shards there. The set-up commands are checked for shape
(exactly two) since CI itself runs them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(lang: str, section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 3)
    body = text[start : end if end != -1 else len(text)]
    return re.findall(rf"```{lang}\n(.*?)```", body, flags=re.S)


def _script_env() -> dict[str, str]:
    """The environment of a README shell block: this venv's fastdata, moto_server and python
    first on PATH, the checkout importable."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(README.parent)
    return env


def test_setup_is_exactly_two_commands():
    commands = [
        line for block in _blocks("bash", "Set-up") for line in block.splitlines() if line.strip()
    ]
    assert len(commands) == 2, commands
    assert "install" in commands[0] and "pytest" in commands[1]


@pytest.mark.realdata
@pytest.mark.slow
def test_quick_start_runs_as_written(real_data, tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(real_data, target_is_directory=True)
    monkeypatch.chdir(project)
    fastdata = [sys.executable, "-m", "fastdata"]
    for block in _blocks("bash", "Quick start"):
        for line in block.splitlines():
            if line.startswith("fastdata shard"):
                args = shlex.split(line)[1:] + ["--no-progress"]
                subprocess.run(
                    fastdata + args,
                    check=True,
                    env={**os.environ, "PYTHONPATH": str(README.parent)},
                )
    namespace: dict = {"__name__": "__readme__"}
    for block in _blocks("python", "Quick start") + _blocks("python", "In your Lightning code"):
        exec(compile(block, str(README), "exec"), namespace)


@pytest.mark.realdata
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_data_where_you_keep_it_runs_as_written(real_data, tmp_path):
    """The section's shell blocks, in order, as one script: formats, HTTP, S3 (moto), mixing,
    parts."""
    project = tmp_path / "project"
    project.mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(real_data, target_is_directory=True)
    # The Quick start's photo shards, which the HTTP example serves.
    subprocess.run(
        [sys.executable, "-m", "fastdata", "shard", "folder", "../shared/data/clothing-small"]
        + ["shards/clothing", "--no-progress"],
        check=True,
        cwd=project,
    )
    script = "\n".join(_blocks("bash", "Data where you keep it"))
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=project,
        env=_script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a server a failed block left is killed
    )
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "empty.jpg: empty file" in out and "not an image: starts with" in out
    assert "samples over HTTP through a 30 MB cache" in out
    assert "s3://demo/photos: folder shards" in out
    assert "epoch 0: [300, 100] samples" in out and "epoch 1: [300, 100] samples" in out
    assert "3 parts + merge: byte-identical to one run" in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_beyond_classification_runs_as_written(tmp_path, monkeypatch):
    """The section's shell blocks as one script, then its python blocks in one namespace, from an
    empty folder (the section makes its own small datasets)."""
    section = "Beyond classification"
    project = tmp_path / "project"
    project.mkdir()
    script = "\n".join(_blocks("bash", section))
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=project,
        env=_script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "fields: image (image" in done.stdout and "boxes (boxes" in done.stdout
    monkeypatch.chdir(project)
    namespace: dict = {"__name__": "__readme__"}
    for block in _blocks("python", section):
        exec(compile(block, str(README), "exec"), namespace)
