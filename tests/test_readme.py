"""The README's examples run as written.

Every ```python block of the README's "Quick start" runs, in order, in one namespace, from a
temporary project folder whose `../shared/data` points at the real data, after the README's
`fastdata shard` commands have made the shards there. The set-up commands are checked for shape
(exactly two) since CI itself runs them.
"""

from __future__ import annotations

import os
import re
import shlex
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
    for block in _blocks("python", "Quick start"):
        exec(compile(block, str(README), "exec"), namespace)
