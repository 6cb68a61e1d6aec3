"""The package's layers point down and its modules import no cycle (docs/DESIGN.md, "Layers").

`lint-imports` checks the contracts in pyproject's `[tool.importlinter]`; the cycle check is this
file's own (import-linter has no "no cycles" contract): every import in every module, at module
level, inside functions and under `if TYPE_CHECKING:` alike (a type-only cycle is still two
modules that must be read together), gives an edge; a strongly connected component of more than
one module is a cycle.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent))


def module_files(package_dir: Path) -> dict[str, Path | None]:
    """Dotted module name -> its file, for every .py module and C extension source in a package."""
    base = package_dir.parent
    mods: dict[str, Path | None] = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    for source in package_dir.rglob("*.c"):  # fastdata._pixels, fastdata.read._jpeg
        mods.setdefault(".".join(source.relative_to(base).with_suffix("").parts), None)
    return mods


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every import statement, wherever it is)."""
    mods = module_files(package_dir)
    top = package_dir.name

    def known(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets: set[str] = set()
        if path is not None:
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    targets.update(known(a.name) for a in node.names if a.name.split(".")[0] == top)
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                        module = ".".join([*parts, *([node.module] if node.module else [])])
                    else:
                        module = node.module or ""
                    if module.split(".")[0] != top:
                        continue
                    for alias in node.names:  # `from pkg import module` imports the module
                        full = f"{module}.{alias.name}"
                        targets.add(full if full in mods else known(module))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_imports_no_cycle() -> None:
    found = cycles(import_graph(ROOT / "fastdata"))
    assert not found, f"import cycles in fastdata (break each, docs/DESIGN.md 'Layers'): {found}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_the_cycle_check_sees_function_level_type_only_and_relative_imports(tmp_path) -> None:
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from pkg import b\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.c import X\n",
            "sub/__init__.py": "",
            "sub/c.py": "from .. import a\nX = 1\n",
            "d.py": "import pkg.a\n",
        },
    )
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (test extra)")
def test_lint_imports_keeps_the_layer_contracts() -> None:
    done = subprocess.run(
        [LINT_IMPORTS, "--no-cache"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (test extra)")
def test_lint_imports_breaks_on_an_upward_import(tmp_path) -> None:
    # The same contracts over a copy of the package in which the on-disk contract imports the
    # Lightning adapter: the check must fail and name the import.
    shutil.copytree(ROOT / "fastdata", tmp_path / "fastdata", ignore=shutil.ignore_patterns("*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    schema = tmp_path / "fastdata" / "format" / "schema.py"
    schema.write_text(schema.read_text() + "\nimport fastdata.lightning.runtime  # noqa\n")
    done = subprocess.run(
        [LINT_IMPORTS, "--no-cache"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "fastdata.format.schema -> fastdata.lightning.runtime" in done.stdout


def test_no_library_module_imports_a_pipeline_or_a_test_helper() -> None:
    outside = {"fastdata_pipelines", "pipelines", "tests", "benchmarks", "conftest"}
    bad = []
    for path in (ROOT / "fastdata").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in outside]
    assert not bad, bad


def test_the_manifest_classes_meet_what_the_shard_cache_reads_of_them() -> None:
    # remote/ declares the manifest it reads (remote/shards.py) instead of importing format/;
    # a member renamed or dropped on either side must fail here, not in a remote run.
    import inspect

    from fastdata.format.manifest import Manifest, ShardInfo, SplitInfo
    from fastdata.remote.shards import ShardEntry, ShardSource, SplitEntries

    def members(protocol: type) -> set[str]:
        return {n for n, _ in inspect.getmembers(protocol) if not n.startswith("_")}

    def has(cls: type) -> set[str]:
        return set(getattr(cls, "__dataclass_fields__", {})) | set(dir(cls))

    for protocol, cls in (
        (ShardEntry, ShardInfo),
        (SplitEntries, SplitInfo),
        (ShardSource, Manifest),
    ):
        assert members(protocol), protocol
        assert members(protocol) <= has(cls), (cls, members(protocol) - has(cls))
