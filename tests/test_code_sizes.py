"""Function and module sizes of the library, counted with `ast` (issue 38).

A function (or method, or nested function) is at most `MAX_FUNCTION_LINES` lines from its `def`
to its last line, a module at most `MAX_MODULE_LINES` lines, except those listed in `FUNCTIONS`
and `MODULES` below: the one table of allowed exceptions, each with its reason and a cap it may
not grow past. docs/DESIGN.md's "Sizes" note gives the reasons in prose and must name every
module and function listed here (checked below), so the two cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fastdata"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400

#: Allowed long functions, "path:qualified name" -> (cap in lines, why). At most 3.
FUNCTIONS: dict[str, tuple[int, str]] = {}

#: Allowed long modules, path -> (cap in lines, why). At most 4.
MODULES: dict[str, tuple[int, str]] = {
    "fastdata/lightning/datamodule.py": (
        700,
        "one LightningDataModule: ~150 lines are the documented options users read; its hooks "
        "each call the modules beside it, and mixins would spread one object's state",
    ),
    "fastdata/format/fields.py": (
        530,
        "one registry (kinds, codecs, FieldSpec) raising one FieldError; apart needs a cycle",
    ),
    "fastdata/read/decoders/dict_batch.py": (
        430,
        "one concept, the dict batch: the collate's rules are the other face of the decode",
    ),
    "fastdata/read/schedule.py": (
        420,
        "weights over positions, rule 7's draw and what a resume records of it: the resume "
        "part needs the draw and the draw the weights; apart needs a cycle or moves Schedule",
    ),
}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    """`path` as the tables name it: relative to the repository (a path outside: as given)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def _function_sizes(path: Path) -> dict[str, int]:
    """`path:qualified name` -> lines of every function, method and nested function."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                qualname = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                    sizes[f"{_name(path)}:{qualname}"] = lines
                visit(child, f"{qualname}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return sizes


def _long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in _modules():
        found.update(_function_sizes(path))
    return {name: n for name, n in found.items() if n > MAX_FUNCTION_LINES}


def _long_modules() -> dict[str, int]:
    sizes = {_name(p): len(p.read_text(encoding="utf-8").splitlines()) for p in _modules()}
    return {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}


def test_counting_sees_functions_methods_and_nested_ones(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "def f():\n    def g():\n        pass\n    return g\n\n"
        "class C:\n    async def m(self):\n        return 1\n"
    )
    sizes = {name.split(":")[1]: n for name, n in _function_sizes(source).items()}
    assert sizes == {"f": 4, "f.g": 2, "C.m": 2}


def test_the_exception_table_is_short():
    assert len(FUNCTIONS) <= 3, "at most 3 functions over the limit: split one before adding one"
    assert len(MODULES) <= 4, "at most 4 modules over the limit: split one before adding one"


def _check(
    long: dict[str, int], allowed: dict[str, tuple[int, str]], limit: int, what: str
) -> None:
    """Fail on a new long `what`, an allowed one grown past its cap, or a stale exception."""
    table = "FUNCTIONS" if what == "functions" else "MODULES"
    new = {name: n for name, n in long.items() if name not in allowed}
    assert not new, (
        f"{what} over {limit} lines: {new}. Split each along a seam (a helper or module that "
        f"holds one named thing); an exception goes in {table} here and DESIGN.md's Sizes note"
    )
    grown = {name: n for name, n in long.items() if name in allowed and n > allowed[name][0]}
    assert not grown, f"allowed long {what} grew past their caps: {grown}"
    stale = sorted(set(allowed) - set(long))
    assert not stale, f"no longer over {limit} lines (or gone): remove {stale} from {table}"


def test_functions_are_at_most_60_lines():
    _check(_long_functions(), FUNCTIONS, MAX_FUNCTION_LINES, "functions")


def test_modules_are_at_most_400_lines():
    _check(_long_modules(), MODULES, MAX_MODULE_LINES, "modules")


def test_design_sizes_note_names_every_exception():
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    note = re.search(r"^### Sizes\n(.*?)(?=^### )", design, re.S | re.M)
    assert note is not None, "docs/DESIGN.md lost its '### Sizes' note"
    text = note.group(1)
    for path in MODULES:
        short = path.removeprefix("fastdata/")
        assert f"`{short}`" in text, f"DESIGN.md's Sizes note does not give {short}'s reason"
    for name in FUNCTIONS:
        path, function = name.split(":")
        short = f"{path.removeprefix('fastdata/')}:{function}"
        assert f"`{short}`" in text, f"DESIGN.md's Sizes note does not give {short}'s reason"
