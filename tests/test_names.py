"""Every dotted ``fastdata.`` name a reader is pointed at resolves: a name is a promise.

Scanned: the docstrings and comments of the library (`fastdata/`), the Markdown of docs/ and
README.md. A name resolves when its longest importable prefix is a module and the rest are
attributes of it (``fastdata.read.base.PlannedLoader.set_epoch``). A module that moved leaves
its old name in some docstring; this test names the file and line of each such pointer.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Not part of a path or a file name (``OUT/.fastdata.lock``, ``fastdata.egg-info``).
NAME = re.compile(r"(?<![\w./-])fastdata(?:\.[A-Za-z_]\w*)+")
#: Dotted names that are not Python objects, each with what it is (checked where it lives).
NOT_OBJECTS = {"fastdata.pipelines": "the entry-point group of pyproject.toml"}


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    nodes = [tree, *ast.walk(tree)]
    found = []
    for node in nodes:
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    found.append((body[0].lineno, body[0].value.value))
    return found


def _comments(text: str) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]


@cache
def _texts() -> list[tuple[str, str]]:
    """(where, text) of every docstring, comment and Markdown page scanned."""
    texts = []
    for path in sorted((ROOT / "fastdata").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        pieces = _docstrings(ast.parse(source)) + _comments(source)
        texts += [(f"{rel}:{line}", text) for line, text in pieces]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        texts.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")))
    return texts


@cache
def resolves(name: str) -> bool:
    """Whether `name` is an importable module, or attributes of one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_scan_finds_names_and_refuses_a_moved_one():
    found = {m.group(0) for _, text in _texts() for m in NAME.finditer(text)}
    assert "fastdata.read.base.PlannedLoader" in found  # docs/DESIGN.md
    assert len(found) > 50
    assert resolves("fastdata.read.decoders.image.stored_hw")
    assert not resolves("fastdata.read.decoded.stored_hw")  # moved: read/decoders/image.py
    assert not NAME.search("OUT/.fastdata.lock")


def test_the_names_that_are_not_objects_exist_where_they_live():
    assert '[project.entry-points."fastdata.pipelines"]' in (ROOT / "pyproject.toml").read_text()


def test_every_dotted_fastdata_name_resolves():
    stale = sorted(
        {
            f"{where}: {m.group(0)}"
            for where, text in _texts()
            for m in NAME.finditer(text)
            if m.group(0) not in NOT_OBJECTS and not resolves(m.group(0))
        }
    )
    if stale:
        pytest.fail(
            f"{len(stale)} names point at nothing (moved or renamed? fix the text):\n"
            + "\n".join(stale)
        )
