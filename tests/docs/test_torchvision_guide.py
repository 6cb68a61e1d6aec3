"""docs/guides/torchvision.md runs as written beside torchvision (issue 28).

The page's ```python blocks run in order, as one script, in `.venv-tv/bin/python`: the venv
`.ci/install_tv.sh` builds with PyPI's torch + torchvision pair, plain Pillow and fastdata, which
the main `.venv` (Pillow-SIMD, CPU torch 2.13) cannot hold. Without that venv the test skips,
except under CI (env var CI set), where a missing venv is a broken install and fails.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "torchvision.md"
TV_PYTHON = ROOT / ".venv-tv" / "bin" / "python"
TIMEOUT_S = 300  # ~40 s on a 2-core CPU; the bound only stops a hung run

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The page's ```python blocks, in order."""
    return _BLOCK.findall(text)


@pytest.mark.slow
def test_the_guide_runs_beside_torchvision(tmp_path: Path) -> None:
    text = GUIDE.read_text()
    assert text.splitlines()[0] == (
        "<!-- docs-test: covered-by "
        "tests/docs/test_torchvision_guide.py::test_the_guide_runs_beside_torchvision -->"
    ), "the page's first line must name this test (the generic docs test then skips the page)"
    blocks = python_blocks(text)
    assert len(blocks) >= 5, f"{GUIDE}: expected its ```python blocks, found {len(blocks)}"
    if not TV_PYTHON.exists():
        reason = f"{TV_PYTHON} is missing: build it with `bash .ci/install_tv.sh`"
        if os.environ.get("CI"):
            pytest.fail(f"CI must have the torchvision venv: {reason}")
        pytest.skip(reason)
    script = tmp_path / "guide.py"
    script.write_text("\n\n".join(blocks))
    # This checkout's fastdata (not another one's editable install); the page's own temp folder
    # (tempfile.mkdtemp) lands in tmp_path, so nothing is left behind.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    try:
        run = subprocess.run(
            [str(TV_PYTHON), str(script)], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{GUIDE} did not finish in {TIMEOUT_S} s in {TV_PYTHON}: {exc.stderr!r}")
    assert run.returncode == 0, (
        f"{GUIDE}'s python blocks failed in {TV_PYTHON} (script {script}):\n"
        f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    )
    # The first block prints the PIL it runs on: torchvision's plain Pillow, alone.
    first = run.stdout.splitlines()[0]
    assert first.startswith("Pillow ") and ";" not in first, first
