"""fastdata names no PIL distribution, reports the one it runs on, and says what to install."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

import PIL
import pytest
import tomllib

import fastdata
from fastdata._util import pil as _pil

ROOT = Path(__file__).resolve().parents[2]
PIL_NAMES = {"pillow", "pillow-simd"}


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string."""
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_no_dependency_names_a_pil_distribution_and_the_extras_offer_both():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not {_name(r) for r in project["dependencies"]} & PIL_NAMES
    for extra, requirements in extras.items():
        if extra not in ("pillow", "simd"):
            assert not {_name(r) for r in requirements} & PIL_NAMES, extra
    assert [_name(r) for r in extras["pillow"]] == ["pillow"]
    assert [_name(r) for r in extras["simd"]] == ["pillow-simd"]


def test_pil_info_names_the_distribution_this_environment_imports():
    info = fastdata.pil_info()
    owners = {_pil._normalize(d.metadata["Name"]) for d in md.distributions()} & PIL_NAMES
    assert info.distribution in owners
    assert info.version == PIL.__version__
    assert info.simd == (info.distribution == "pillow-simd")
    assert Path(info.location) == Path(PIL.__file__).parent
    assert info.problem is None, info.problem
    assert (
        info.describe().startswith(("Pillow ", "Pillow-SIMD ")) and info.version in info.describe()
    )
    assert info.as_dict()["distributions"] == [info.distribution]


def test_two_distributions_in_one_pil_folder_are_reported_with_the_fix(monkeypatch):
    monkeypatch.setattr(
        md, "packages_distributions", lambda: {"PIL": ["Pillow", "pillow-simd"], "x": ["x"]}
    )
    info = _pil.pil_info()
    assert info.distributions == ("pillow", "pillow-simd")
    assert info.problem is not None
    assert "pip uninstall -y pillow pillow-simd" in info.problem
    assert info.problem in info.describe()


def test_import_without_pil_says_what_to_install():
    code = "import sys; sys.modules['PIL'] = None\nimport fastdata"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fastdata needs PIL"), done.stderr
    assert "pip install 'fastdata[pillow]'" in last and "fastdata[simd]" in last


def test_the_benchmark_environment_records_the_pil() -> None:
    from benchmarks.common import environment

    record = environment()
    assert record["pil"] == fastdata.pil_info().as_dict()
    installed = record["versions"][record["pil"]["distribution"]]
    assert installed == md.version(record["pil"]["distribution"])


@pytest.mark.parametrize("name", ["Pillow", "pillow_simd", "Pillow-SIMD"])
def test_distribution_names_normalize(name):
    assert _pil._normalize(name) in PIL_NAMES
