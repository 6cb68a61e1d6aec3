"""The documentation site builds with warnings as errors, and its pages cover what they must.

`mkdocs build --strict` (mkdocs.yml: mkdocs-material + mkdocstrings) fails on a broken relative
link or anchor between pages, a nav entry without its page, and every griffe docstring warning of
the API reference; the test also fails on any WARNING line the build prints. This is how CI builds
the site: it runs the test suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.docs_blocks import REPO

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings_handlers.python")

# The packages whose public modules the API reference documents, one page each.
API_PACKAGES = ("lightning", "write", "format", "tune", "train", "remote")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_site_builds_strict_without_warnings(tmp_path):
    """About 35 s on the 2-core CPU (mkdocstrings reads every documented module)."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    command = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*command, "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    log = _ANSI.sub("", done.stdout + done.stderr)
    assert done.returncode == 0, log[-6000:]
    warnings = [line for line in log.splitlines() if re.match(r"\s*WARNING\b", line)]
    assert not warnings, "\n".join(warnings)
    api = (tmp_path / "site" / "api" / "lightning" / "index.html").read_text()
    assert 'id="fastdata.lightning.datamodule.ShardDataModule"' in api  # rendered from docstrings


def test_api_reference_lists_every_public_module():
    """Each public module of the documented packages has its `::: fastdata...` entry."""
    for package in API_PACKAGES:
        page = (REPO / "docs" / "api" / f"{package}.md").read_text()
        documented = set(re.findall(r"^::: (fastdata\.[\w.]+)", page, re.M))
        modules = {
            f"fastdata.{package}.{path.stem}"
            for path in (REPO / "fastdata" / package).glob("*.py")
            if not path.stem.startswith("_")
        }
        assert modules <= documented, f"docs/api/{package}.md lacks {sorted(modules - documented)}"


def test_api_index_names_every_export():
    """The API index links every name `fastdata` exports."""
    import fastdata

    page = (REPO / "docs" / "api" / "index.md").read_text()
    missing = [name for name in fastdata.__all__ if f"`{name}`" not in page]
    assert not missing, f"docs/api/index.md lacks {missing}"


def test_readme_links_resolve():
    """The README's relative links (into docs/, CHANGELOG.md) name files that exist; mkdocs
    checks the links between pages, not the README's."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert relative, "the README links into the docs"
    missing = [link for link in relative if not (REPO / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_is_short():
    """Issue 28: a README of at most ~250 lines; the rest lives in docs/."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 260, len(lines)


def test_the_lightning_page_opens_with_the_public_classes():
    """Issue 38: `ShardDataModule` and its family first; `compat` (FabricLoader,
    datamodule_bases) and the loaders' machinery after an "Internals" heading."""
    page = (REPO / "docs" / "api" / "lightning.md").read_text()
    entries = re.findall(r"^::: (fastdata\.lightning\.\w+)", page, re.M)
    assert entries[:2] == ["fastdata.lightning.datamodule", "fastdata.lightning.family"]
    internals = page.index("## Internals")
    assert page.index("::: fastdata.lightning.compat") > internals
    assert page.index("::: fastdata.lightning.runtime") > internals
