"""`PlannedLoader`: the one base of every backend's loader (epoch, position, length, iteration)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.read import BACKENDS, LoaderSpec
from fastdata.read.base import PlannedLoader
from fastdata.read.plan import EpochPlan


class _Rows(PlannedLoader):
    """A backend in miniature: each batch is the plan's row numbers; records its passes."""

    def __init__(self, spec: LoaderSpec) -> None:
        self.passes = 0
        self.selected: list[tuple[int, int, int]] = []
        self.start_at(spec)

    def _select(self, epoch: int, consumed: int, steps_before: int) -> None:
        self.selected.append((epoch, consumed, steps_before))

    def _iterate(self, plan: EpochPlan) -> Iterator[list[int]]:
        self.passes += 1
        for rows in plan.rows:
            yield rows.tolist()


def _spec(root: Path, **kw) -> LoaderSpec:
    return LoaderSpec(load_manifest(root), "train", train=True, batch_size=32, **kw)


def test_the_base_selects_plans_counts_and_iterates(tiny_shards: Path):
    spec = _spec(tiny_shards, epoch=1, consumed=64, steps_before=2)
    loader = _Rows(spec)
    assert loader.position == (1, 64, 2) and loader.selected == [(1, 64, 2)]
    assert len(loader) == len(spec.plan(1, 64, 2)) == 10  # counts the batches before the resume
    assert list(loader) == [rows.tolist() for rows in spec.plan(1, 64, 2).rows]
    loader.set_epoch(2)
    whole = spec.plan(2)
    spec.plan(5)  # the spec keeps one plan: the loader keeps its own
    assert loader.plan is whole and list(loader) == [rows.tolist() for rows in whole.rows]
    assert loader.selected[-1] == (2, 0, 0) and loader.passes == 2


def test_a_bad_position_is_refused_and_the_selected_one_kept(tiny_shards: Path):
    loader = _Rows(_spec(tiny_shards))
    with pytest.raises(ValueError, match="consumed must be in"):
        loader.set_epoch(0, 301, 10)
    assert loader.position == (0, 0, 0) and loader.selected == [(0, 0, 0)]


def test_an_epoch_resumed_at_its_end_starts_no_pass(tiny_shards: Path):
    loader = _Rows(_spec(tiny_shards, consumed=300, steps_before=10))
    assert len(loader) == 10 and list(loader) == [] and loader.passes == 0


@pytest.mark.parametrize("name", ["cpu", "memory"])
def test_built_in_backends_use_the_base(tiny_shards: Path, name: str, tmp_path: Path):
    spec = _spec(tiny_shards, consumed=300, steps_before=10, decoded_cache_dir=str(tmp_path))
    loader = BACKENDS[name].load()(spec)
    assert isinstance(loader, PlannedLoader)
    assert len(loader) == 10 and list(loader) == []
    loader.set_epoch(1)
    assert sum(len(y) for _, y in loader) == 300  # the whole next epoch


def test_every_backend_loader_derives_from_the_base():
    from fastdata.read.backends.cpu import CpuLoader
    from fastdata.read.backends.dali.loader import DaliLoader
    from fastdata.read.backends.memory import MemoryLoader
    from fastdata.read.backends.memory_dict import ResidentSamples
    from fastdata.read.backends.nvjpeg import NvjpegLoader

    for cls in (CpuLoader, DaliLoader, MemoryLoader, ResidentSamples, NvjpegLoader):
        assert issubclass(cls, PlannedLoader), cls
        for name in ("set_epoch", "__len__", "__iter__"):  # one copy: the base's
            assert getattr(cls, name) is getattr(PlannedLoader, name), (cls, name)
