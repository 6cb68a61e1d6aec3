"""Every ```python and ```bash block of README.md and docs/**/*.md runs as written, page by page.

Each page runs in a fresh temporary project folder whose `../shared/data` links to the real data
(FASTDATA_DATA_DIR, else ../shared/data; a page that names `../shared/data` is skipped, with the
reason, where it is absent). A page's bash blocks run first, as one `bash -euo pipefail` script
with this venv's `bin` first on PATH (so `fastdata`, `python` and `moto_server` are this
checkout's); then its python blocks run in order in one namespace. The directives are described in
tests/docs/docs_blocks.py (covered-by, skip, expect).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fastdata_pipelines.env import data_dir

from tests.docs.docs_blocks import REPO, doc_pages, parse_page

# Pages over ~20 s on a 2-core CPU (tests/docs, 2026-12-04 under load ~20: README 103 s, data 88 s,
# remote 74 s, lightning 30 s, family 30 s; every other page under 4 s).
SLOW = {"README.md", "docs/guides/lightning.md", "docs/guides/data.md", "docs/guides/remote.md",
        "docs/guides/family.md"}  # fmt: skip
SCRIPT_TIMEOUT_S = 300


def _params():
    for path in doc_pages():
        name = path.relative_to(REPO).as_posix()
        marks = [pytest.mark.slow] if name in SLOW else []
        if parse_page(path).needs_real_data:
            marks.append(pytest.mark.realdata)
        yield pytest.param(path, id=name, marks=marks)


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (tmp_path / "shared").mkdir()
    real = data_dir()
    if real.is_dir():
        (tmp_path / "shared" / "data").symlink_to(real.resolve(), target_is_directory=True)
    return project


def _script_env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _run_bash(script: str, cwd: Path) -> str:
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=_script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a server a failed block left is killed
    )
    try:
        out, _ = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the page's bash blocks ran over {SCRIPT_TIMEOUT_S} s:\n{out[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"the page's bash blocks failed:\n{out[-4000:]}"
    return out


def _covered(test: str) -> None:
    path, name = test.split("::")
    source = REPO / path
    assert source.is_file(), f"covered-by names {path}, which does not exist"
    assert re.search(rf"^\s*(async )?def {name}\(", source.read_text(), re.M), (
        f"covered-by names {test}, but {path} has no test {name}"
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page_path", list(_params()))
def test_page_examples_run_as_written(page_path, tmp_path, monkeypatch, capsys):
    page = parse_page(page_path)
    if page.covered_by:
        _covered(page.covered_by)
        pytest.skip(f"{page.name}: run by {page.covered_by}")
    bash, python = page.runnable("bash"), page.runnable("python")
    if not bash and not python:
        assert not page.expects, f"{page.name} expects output but runs no block"
        pytest.skip(f"{page.name} has no python or bash block to run")
    real = data_dir()
    have_data = (real / "cifar-100-python.tar.gz").exists() and (real / "clothing-small").is_dir()
    if page.needs_real_data and not have_data:
        pytest.skip(f"{page.name} uses ../shared/data, not found at {real} (FASTDATA_DATA_DIR)")
    project = _project(tmp_path)
    output = ""
    if bash:
        output += _run_bash("\n".join(block.code for block in bash), project)
    monkeypatch.chdir(project)
    namespace: dict = {"__name__": "__docs__"}
    for block in python:
        exec(compile(block.code, f"{page.name}:{block.line}", "exec"), namespace)
    output += capsys.readouterr().out
    missing = [text for text in page.expects if text not in output]
    assert not missing, f"{page.name}: output lacks {missing}:\n{output[-4000:]}"


def test_index_runs_the_readmes_blocks():
    """docs/index.md repeats the README's set-up and Quick start: its blocks are the README's,
    block for block, so the README's run (above) runs them."""
    readme, index = parse_page(REPO / "README.md"), parse_page(REPO / "docs" / "index.md")
    runnable = [
        (b.lang, b.code, b.skip_reason) for b in index.blocks if b.lang in ("python", "bash")
    ]
    assert runnable, "docs/index.md has no code block"
    assert runnable == [
        (b.lang, b.code, b.skip_reason) for b in readme.blocks if b.lang in ("python", "bash")
    ]


def _setup_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    start = text.index("## Set-up")
    end = text.find("\n## ", start + 3)
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end], flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_setup_is_exactly_two_commands():
    """CI runs the README's set-up: exactly two commands, install (and train), then the tests."""
    commands = _setup_commands()
    assert len(commands) == 2, commands
    assert "install" in commands[0] and "pytest" in commands[1]
