"""CI's default run (pyproject addopts `-m "not heavy"`) stays representative: every test module
keeps at least one test in it.

`heavy` marks a bigger variant of a case another test covers (pyproject markers); marking every
test of a module would drop a whole area from CI unnoticed. The marks are read from the source
with `ast` (decorators, a module's `pytestmark`, and `pytest.param(..., marks=...)` cases), so
this check imports nothing and takes well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MARK = "heavy"


class _Marks:
    """Reads the `heavy` mark in one module, through its module-level names (`CASES = [...]`,
    `_HEAVY = pytest.mark.heavy`, as parameter lists and marks are often written)."""

    def __init__(self, tree: ast.Module) -> None:
        self.names: dict[str, ast.expr] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                if isinstance(node.targets[0], ast.Name):
                    self.names[node.targets[0].id] = node.value

    def resolve(self, node: ast.AST, depth: int = 0) -> ast.AST:
        while isinstance(node, ast.Name) and node.id in self.names and depth < 10:
            node, depth = self.names[node.id], depth + 1
        return node

    def names_mark(self, node: ast.AST) -> bool:
        """`pytest.mark.heavy`, `mark.heavy` or `pytest.mark.heavy(...)`, alone or in a list."""
        node = self.resolve(node)
        if isinstance(node, (ast.List, ast.Tuple)):
            return any(self.names_mark(item) for item in node.elts)
        if isinstance(node, ast.Call):
            node = node.func
        return isinstance(node, ast.Attribute) and node.attr == MARK and _is_mark(node.value)

    def case_marks(self, decorators: list[ast.expr]) -> tuple[int, int] | None:
        """(cases, heavy cases) of a `parametrize` whose cases are `pytest.param(..., marks=)`;
        None where no case carries the mark of its own."""
        for deco in decorators:
            if not (isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize"):
                continue
            cases = self.resolve(deco.args[1]) if len(deco.args) >= 2 else None
            if not isinstance(cases, (ast.List, ast.Tuple)):
                continue
            heavy = sum(
                1
                for case in cases.elts
                if isinstance(case, ast.Call)
                and getattr(case.func, "attr", "") == "param"
                and any(k.arg == "marks" and self.names_mark(k.value) for k in case.keywords)
            )
            if heavy:
                return len(cases.elts), heavy
        return None

    def is_heavy(self, func: ast.FunctionDef | ast.AsyncFunctionDef, inherited: bool) -> bool:
        if inherited or any(self.names_mark(d) for d in func.decorator_list):
            return True
        cases = self.case_marks(func.decorator_list)
        return cases is not None and cases[0] == cases[1]


def _is_mark(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "mark") or (
        isinstance(node, ast.Name) and node.id == "mark"
    )


def module_tests(source: str) -> tuple[int, int]:
    """(tests, heavy tests) of a test module's source: `test_*` functions, and `test_*` methods
    of `Test*` classes (a function counts once, heavy only when all its cases are)."""
    tree = ast.parse(source)
    marks = _Marks(tree)
    module_heavy = "pytestmark" in marks.names and marks.names_mark(marks.names["pytestmark"])
    counts = [0, 0]

    def add(func: ast.AST, inherited: bool) -> None:
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and func.name.startswith(
            "test"
        ):
            counts[0] += 1
            counts[1] += marks.is_heavy(func, inherited)

    for node in tree.body:
        add(node, module_heavy)
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            class_heavy = module_heavy or any(marks.names_mark(d) for d in node.decorator_list)
            for item in node.body:
                add(item, class_heavy)
    return counts[0], counts[1]


def test_every_test_module_keeps_a_test_in_ci() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 50, f"found only {len(modules)} test modules under {TESTS}"
    all_heavy = []
    for path in modules:
        tests, heavy = module_tests(path.read_text())
        if tests and tests == heavy:
            all_heavy.append(f"{path.relative_to(TESTS.parent)} ({tests} tests)")
    assert not all_heavy, (
        "every test of these modules is marked heavy, so CI's default run (-m 'not heavy') skips "
        "them whole: unmark the smallest case of each: " + ", ".join(all_heavy)
    )


def test_the_check_sees_each_way_of_marking() -> None:
    """The reader above finds every form of the mark (else the check could never fail)."""
    assert module_tests("import pytest\n\n@pytest.mark.heavy\ndef test_a(): pass\n") == (1, 1)
    assert module_tests("from pytest import mark\n@mark.heavy()\ndef test_a(): pass\n") == (1, 1)
    assert (
        module_tests("pytestmark = [pytest.mark.slow, pytest.mark.heavy]\ndef test_a(): pass")[1]
        == 1
    )
    whole_class = "@pytest.mark.heavy\nclass TestX:\n    def test_a(self): pass\n"
    assert module_tests(whole_class) == (1, 1)
    assert module_tests("def test_a(): pass\n@pytest.mark.heavy\ndef test_b(): pass") == (2, 1)
    cases = "@pytest.mark.parametrize('n', [1, pytest.param(2, marks=pytest.mark.heavy)])\n"
    assert module_tests(cases + "def test_a(n): pass") == (1, 0)  # case 1 still runs in CI
    all_cases = "@pytest.mark.parametrize('n', [pytest.param(2, marks=[pytest.mark.heavy])])\n"
    assert module_tests(all_cases + "def test_a(n): pass") == (1, 1)
    assert module_tests("@pytest.mark.slow\ndef test_a(): pass\ndef helper(): pass") == (1, 0)
    through_names = "H = [pytest.mark.heavy]\nCASES = [pytest.param(1, marks=H)]\n"
    assert module_tests(
        through_names + "@pytest.mark.parametrize('n', CASES)\ndef test_a(n): 0"
    ) == (
        1,
        1,
    )
