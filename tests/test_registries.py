"""The registries are the single source: every list of backends or fields in the code, the CLI's
help and the README agrees with `fastdata.read.BACKENDS` and `fastdata.format.fields.FIELD_KINDS`, and a
backend registered at run time appears wherever backends are offered (CLI choices, `auto`)."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

import fastdata.read as read
from fastdata.augment import get_preset
from fastdata.cli import build_parser
from fastdata.format.field_inference import infer_fields
from fastdata.format.fields import FIELD_KINDS
from fastdata.format.manifest import Manifest, ShardInfo, SplitInfo
from fastdata.lightning.runtime import check_options
from fastdata.read import BACKENDS, Backend, WorkerSettings, backend_choices, field_backends
from fastdata.read.backends.auto import choose_backend

REPO = Path(__file__).resolve().parents[1]
FAKE = Backend(
    "fake",
    "fastdata.read.backends.cpu:make_cpu_loader",
    "fastdata.read:_always",
    uses_workers=False,
    decodes_on_gpu=True,
)


@pytest.fixture
def fake_backend(monkeypatch) -> Backend:
    """A GPU-decoding backend registered first (auto tries GPU decoders in registry order)."""
    monkeypatch.setattr(read, "BACKENDS", {"fake": FAKE, **BACKENDS})
    # Modules that imported the dict itself see the same (patched) object only if they look it
    # up through the package; patch their names as well so the test exercises the lookup.
    import fastdata.read.backends.auto as auto

    monkeypatch.setattr(auto, "BACKENDS", read.BACKENDS)
    return FAKE


def _choices(parser: argparse.ArgumentParser, *path: str, flag: str = "--backend") -> list[str]:
    """The `choices` of `flag` in the (sub)parser reached by the subcommand names `path`."""
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    action = next(a for a in parser._actions if flag in a.option_strings)
    return list(action.choices)


def _pipeline_parser() -> argparse.ArgumentParser:
    from pipelines.cifar100.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _manifest(fields=None) -> Manifest:
    shard = ShardInfo("train-000000.tar", "train-000000.idx", 1000, 1, "0" * 64)
    split = SplitInfo([shard], [1000], "raw", [32, 32, 3], {}, fields=fields)
    return Manifest("/nowhere", ["a"], {"train": split}, {}, 0, "0")


def _auto(manifest: Manifest, available) -> tuple[str, str]:
    """auto on a GPU where the memory store does not fit: a GPU decoder or cpu."""
    return choose_backend(
        manifest,
        "train",
        "cuda:0",
        None,
        preset=get_preset("none"),
        available=available,
        free_memory=lambda device: 0,
    )


# ------------------------------------------------------------------ the registry itself


def test_backends_say_which_carry_every_field():
    assert {name: b.carries_fields for name, b in BACKENDS.items()} == {
        "memory": True,
        "dali": False,
        "nvjpeg": False,
        "cpu": True,
    }
    assert field_backends() == ["memory", "cpu"]
    assert backend_choices() == ["auto", *BACKENDS]
    assert backend_choices(auto=False) == list(BACKENDS)


# ------------------------------------------------------------------ a new backend shows up


def test_a_registered_backend_appears_in_every_cli_choice(fake_backend):
    parser = build_parser()
    assert "fake" in _choices(parser, "tune")
    assert "fake" in _choices(_pipeline_parser())
    assert "fake" in _pipeline_parser().format_help()
    check_options_namespace = argparse.Namespace(
        batch_size=1,
        on_error="raise",
        backend="fake",
        rank=None,
        world_size=None,
        ignore_index=255,
        workers=WorkerSettings(num_workers=0, timeout=1.0),
    )
    check_options(check_options_namespace)  # a registered name is a valid `backend=`


def test_a_registered_backend_is_one_of_autos_candidates(fake_backend):
    name, reason = _auto(_manifest(), lambda n: (n == "fake", "not here"))
    assert name == "fake" and "fake decodes on the GPU" in reason
    # Unavailable, it is named among the reasons, and auto goes on down the registry.
    name, reason = _auto(_manifest(), lambda n: (False, "not here"))
    assert name == "cpu" and "fake: not here" in reason


def test_auto_picks_only_backends_that_carry_the_split_fields(fake_backend):
    fields = infer_fields(["png", "mask.png"])
    name, reason = _auto(_manifest(fields), lambda n: (True, ""))
    assert name == "cpu"
    for backend in ("fake", "dali", "nvjpeg"):
        assert f"{backend}: carries only an image and a label" in reason
    carrying = replace(FAKE, carries_fields=True)
    read.BACKENDS["fake"] = carrying
    assert _auto(_manifest(fields), lambda n: (True, ""))[0] == "fake"
    # A classification split still takes the first GPU decoder.
    read.BACKENDS["fake"] = FAKE
    assert _auto(_manifest(), lambda n: (n == "dali", ""))[0] == "dali"


# ------------------------------------------------------------------ every literal list agrees


def test_cli_backend_choices_are_the_registry():
    assert _choices(build_parser(), "tune") == list(BACKENDS)
    assert _choices(_pipeline_parser()) == ["auto", *BACKENDS]


def test_gpu_check_runs_every_registered_backend(fake_backend):
    from benchmarks.gpu_check import parse_args

    default = parse_args([]).backends.split(",")
    assert sorted(default) == sorted(read.BACKENDS) and "fake" in default
    assert default[0] == "cpu" and default[-1] == "memory"  # the baseline first, resident last


def test_no_hand_written_backend_list_in_the_code():
    """No module spells out two or more backend names as a list, tuple or set literal: each such
    list reads `BACKENDS` instead (tests and benchmark suites that pick backends on purpose are
    outside this rule)."""
    names = "|".join(map(re.escape, BACKENDS))
    literal = re.compile(rf"[\[({{]\s*(\"({names})\"\s*,\s*)+\"({names})\"")
    files = [*(REPO / "fastdata").rglob("*.py"), *(REPO / "pipelines").rglob("*.py")]
    files.append(REPO / "benchmarks" / "gpu_check.py")
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not found, "backend lists written by hand:\n" + "\n".join(found)


def _docs_text() -> str:
    """README.md and every docs page (issue 28 moved the README's sections into docs/)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return "\n".join(page.read_text() for page in pages)


def _readme_section(title: str) -> str:
    text = _docs_text()
    start = re.search(rf"\n##+ {re.escape(title)}\n", text).start()
    end = text.find("\n#", start + 1)
    return text[start:end]


def test_readme_lists_every_registered_backend():
    bullets = re.findall(r"^- `([a-z]+)`", _readme_section("Backends"), re.MULTILINE)
    assert set(bullets) == {*BACKENDS, "auto"}, "README's Backends section"
    readme = _docs_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `fastdata/read/` |"))
    listed = set(re.findall(r"`([a-z]+)`", row))
    assert set(BACKENDS) <= listed, f"README's module table: {row}"
    rules = re.findall(r"on every backend \(([^)]*)\)", readme)
    assert set(BACKENDS) in [set(re.findall(r"`([a-z]+)`", rule)) for rule in rules]


def test_the_field_table_is_the_registry():
    """The table in `fastdata.format.fields`' docstring lists each kind with its components."""
    import fastdata.format.fields as fields

    rows = re.findall(r"^\| `([a-z]+)` +\| ([^|]*)\|", fields.__doc__, re.MULTILINE)
    table = {kind: set(re.findall(r"`([a-z_.]+)`", cells)) for kind, cells in rows}
    assert table.keys() == FIELD_KINDS.keys()
    for kind, spec in FIELD_KINDS.items():
        assert table[kind] == set(spec.components) or (
            kind == "image" and table[kind] == {"jpg/png/rgb"} | set(spec.components)
        ), kind


def test_verify_reads_the_split_fields(tiny_shards):
    """`verify` checks the components its split's fields name (not a fixed image list): a split
    that declares a caption its samples lack is reported, sample by sample, naming the field."""
    from fastdata.read.verify import verify

    assert verify(tiny_shards, progress=False).ok
    path = tiny_shards / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["splits"]["test"]["fields"] = {
        "image": {"kind": "image", "components": ["rgb"]},
        "label": {"kind": "label", "components": ["lid", "cls"]},
        "caption": {"kind": "text", "components": ["txt"]},
    }
    path.write_text(json.dumps(manifest))
    report = verify(tiny_shards, progress=False)
    assert not report.ok and len(report.bad_samples) == 50
    assert all("field 'caption'" in bad and "test-" in bad for bad in report.bad_samples)
