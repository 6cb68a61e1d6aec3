"""`ShardDataModule(shuffle=)` on the cpu backend over class-ordered tars webdataset's ShardWriter
wrote and `fastdata index` indexed: the default window mixes classes as a full permutation does,
and a resume reuses the recorded window although the node's free memory changed. (~15 s)"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import ShardDataModule, WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.read import shuffle as shuffle_module
from fastdata.read.resume import ResumeError
from fastdata.write.index import index_shards

wds = pytest.importorskip("webdataset", reason="the shards are written by webdataset's ShardWriter")

CPU = torch.device("cpu")
CLASSES, PER_CLASS, PER_TAR, BATCH = 10, 20, 25, 20


@pytest.fixture(scope="module")
def ordered(tmp_path_factory) -> Path:
    """200 PNG + cls samples in 8 tars of 25, written in class order (as a ShardWriter loop
    over sorted class folders writes them), then indexed."""
    src = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    with wds.ShardWriter(str(src / "train-%06d.tar"), maxcount=PER_TAR, verbose=0) as sink:
        for i in range(CLASSES * PER_CLASS):
            out = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(out, "PNG")
            sink.write({"__key__": f"s{i:04d}", "png": out.getvalue(), "cls": str(i // PER_CLASS)})
    out = tmp_path_factory.mktemp("indexed")
    index_shards(src, out)
    return out


def _dm(root: Path, **kw) -> ShardDataModule:
    options = dict(
        batch_size=BATCH, backend="cpu", image_size=None, keys=True,
        workers=WorkerSettings(num_workers=0),
    )  # fmt: skip
    return ShardDataModule(root, **(options | kw))


def _batches(dm: ShardDataModule, stop: int | None = None) -> list[tuple[list[int], list[str]]]:
    """(labels, keys) of each training batch, each counted as trained (the Trainer-less way)."""
    out = []
    for step, batch in enumerate(dm.train_dataloader(), start=1):
        _, labels, info = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, CPU, 0), 0)
        out.append((labels.tolist(), list(info["key"])))
        if step == stop:
            break
    return out


def _distinct(batches) -> float:
    return float(np.mean([len(set(labels)) for labels, _ in batches]))


def test_default_window_mixes_class_ordered_tars_like_a_full_permutation(ordered):
    per = {}
    for shuffle in ("shard", "window", "full"):
        dm = _dm(ordered, shuffle=shuffle)
        per[shuffle] = np.mean([_distinct(_batches(dm)) for _ in range(3)])  # epochs 0-2
        dm.teardown()
    # The split fits this node many times over: the default window is the whole split.
    assert per["window"] >= 0.95 * per["full"]
    assert per["shard"] < 0.4 * per["full"]  # today's order: one or two classes per batch


def test_resume_reuses_the_recorded_window_when_free_memory_changed(ordered, monkeypatch):
    shards = load_manifest(ordered).split("train").shards
    per_sample = max(1.0, sum(s.bytes for s in shards) / (CLASSES * PER_CLASS))

    def memory(available: float) -> None:
        fake = SimpleNamespace(available=int(available))
        monkeypatch.setattr(shuffle_module.psutil, "virtual_memory", lambda: fake)

    memory(60 * per_sample / shuffle_module.WINDOW_SHARE)  # about 60 samples: blocks of ~2 tars
    whole = _dm(ordered)
    epoch = _batches(whole)
    window = int(whole.state_dict()["shuffle"].split(":")[1])
    assert PER_TAR <= window < CLASSES * PER_CLASS  # sized from the (patched) free memory
    run = _dm(ordered)
    assert _batches(run, stop=3) == epoch[:3]
    state = run.state_dict()
    assert state["shuffle"] == f"window:{window}" and state["consumed"] == 3 * BATCH
    memory(1e12)  # the node now holds the whole split: a fresh module would size it so
    assert _dm(ordered).state_dict()["shuffle"] == f"window:{CLASSES * PER_CLASS}"
    resumed = _dm(ordered)
    resumed.load_state_dict(state)
    rest = _batches(resumed)
    assert rest == epoch[3:]  # the same order: the recorded window, not a new one
    keys = [k for _, ks in epoch[:3] + rest for k in ks]
    assert sorted(keys) == [f"s{i:04d}" for i in range(CLASSES * PER_CLASS)]
    with pytest.raises(ResumeError, match="shuffle"):
        _dm(ordered, shuffle="shard").load_state_dict(state)
    with pytest.raises(ResumeError, match="shuffle"):
        _dm(ordered, shuffle=window + 1).load_state_dict(state)
    explicit = _dm(ordered, shuffle=window)
    explicit.load_state_dict(state)
    assert _batches(explicit) == epoch[3:]


def test_bad_shuffle_is_refused(ordered):
    with pytest.raises(ValueError, match="shuffle must be one of"):
        _dm(ordered, shuffle="random")
