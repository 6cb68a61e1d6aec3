"""Every test a document names (`tests/...py::test_name`, as the resume table does) exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_test_a_document_names_exists():
    named = 0
    for doc in _documents():
        for path, name in NAME.findall(doc.read_text()):
            named += 1
            file = ROOT / path
            assert file.is_file(), f"{doc.relative_to(ROOT)} names {path}, which does not exist"
            functions = {
                node.name
                for node in ast.walk(ast.parse(file.read_text()))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
            assert name in functions, f"{doc.relative_to(ROOT)} names {path}::{name}: no such test"
    assert named >= 16  # the resume table's rows at least
