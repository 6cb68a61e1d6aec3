"""The library does not import its applications; the wheel claims no generic top-level name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_building_the_command_line_imports_no_pipeline():
    code = (
        "import sys, fastdata, fastdata.cli\n"
        "fastdata.cli.build_parser()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('pipelines', 'fastdata_pipelines')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "tests")


def test_packages_list_matches_the_tree_and_pipelines_install_under_our_name():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    tree = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fastdata").rglob("__init__.py")
    }
    assert {p for p in listed if p.startswith("fastdata.") or p == "fastdata"} == tree
    assert config["package-dir"] == {"fastdata_pipelines": "pipelines"}
    assert not any(p == "pipelines" or p.startswith("pipelines.") for p in listed)
    from fastdata.cli.train import available_pipelines

    assert available_pipelines()["cifar100"] == "fastdata_pipelines.cifar100.train"


def test_fastdata_tune_is_always_the_package():
    """A top-level `tune` function would be replaced by the subpackage once it is imported."""
    code = (
        "import fastdata, fastdata.tune.monitor, types; "
        "assert isinstance(fastdata.tune, types.ModuleType); "
        "assert 'tune' not in fastdata.__all__; "
        "from fastdata.tune import tune; assert callable(tune)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
