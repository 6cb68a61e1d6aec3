"""`backend="auto"`: the choice between memory, dali and cpu, with mocked probes."""

from __future__ import annotations

import logging

import pytest

from fastdata import WorkerSettings
from fastdata.augment import get_preset
from fastdata.format.manifest import Manifest, ShardInfo, SplitInfo
from fastdata.read.backends.auto import backend_available, choose_backend, free_device_memory

MiB = 1 << 20


def _manifest(n: int, encoding: str = "raw", raw_shape: list[int] | None = None) -> Manifest:
    shard = ShardInfo("train-000000.tar", "train-000000.idx", n, 1, "0" * 64)
    split = SplitInfo([shard], [n], encoding, raw_shape, {"min_height": 300, "max_height": 500})
    return Manifest("/nowhere", ["a"], {"train": split}, {}, 0, "0")


CIFAR_LIKE = _manifest(1000, raw_shape=[32, 32, 3])  # 1000 x 3 x 32 x 32 = 3,072,000 bytes


def _choose(manifest=CIFAR_LIKE, device="cpu", image_size=None, free=10 * MiB, dali=True, **kw):
    probed = []

    def free_memory(dev: str) -> int:
        probed.append(dev)
        return free

    preset = kw.get("preset", "none")
    kw["preset"] = get_preset(preset) if isinstance(preset, str) else preset
    result = choose_backend(
        manifest,
        "train",
        device,
        image_size,
        available=lambda name: (dali and name == "dali", "not installed"),
        free_memory=free_memory,
        **kw,
    )
    assert probed == [device], "the free memory of the training device decides"
    return result


def test_fits_in_memory_share():
    name, reason = _choose(free=10 * MiB)
    assert name == "memory"
    for figure in ("2.9 MiB", "1000 images of 32x32", "10.0 MiB", "5.0 MiB", "0.5"):
        assert figure in reason


def test_a_fused_pad_crop_preset_counts_the_padded_store():
    # "cifar" keeps the training split padded by 4 with a mirrored copy:
    # 2 x 1000 x 3 x 40 x 40 = 9,600,000 bytes (9.2 MiB) instead of 2.9 MiB.
    assert _choose(free=10 * MiB)[0] == "memory"
    name, reason = _choose(free=10 * MiB, preset="cifar")
    assert name == "cpu" and "9.2 MiB" in reason and "'cifar' preset" in reason
    assert _choose(free=19 * MiB, preset="cifar")[0] == "memory"
    # On the CPU every rank builds its own padded store; the plain store is one shared cache.
    name, reason = _choose(free=19 * MiB, preset="cifar", ranks_per_node=2)
    assert name == "cpu" and "x2 ranks" in reason and "18.3 MiB" in reason
    assert _choose(free=19 * MiB, preset="none", ranks_per_node=2)[0] == "memory"
    assert _choose(device="cuda:0", free=19 * MiB, preset="cifar", ranks_per_node=2)[0] == "memory"


def test_memory_share_is_respected():
    assert _choose(free=5 * MiB, memory_share=0.5)[0] == "cpu"  # budget 2.5 MiB < 2.9 MiB
    name, reason = _choose(free=5 * MiB, memory_share=0.9)
    assert name == "memory" and "4.5 MiB" in reason


def test_too_big_on_gpu_with_dali_picks_dali():
    name, reason = _choose(device="cuda:0", free=4 * MiB, dali=True)
    assert name == "dali"
    assert "2.9 MiB" in reason and "4.0 MiB" in reason and "cuda:0" in reason


def test_too_big_without_gpu_picks_cpu():
    name, reason = _choose(device="cpu", free=4 * MiB, dali=True)
    assert name == "cpu" and "not a GPU" in reason and "2.9 MiB" in reason


def test_too_big_on_gpu_without_dali_picks_cpu():
    name, reason = _choose(device="cuda", free=4 * MiB, dali=False)
    assert name == "cpu" and "dali: not installed" in reason


def test_photos_are_sized_at_the_stored_decode_size():
    photos = _manifest(100, encoding="jpeg")  # varying sizes: no raw_shape
    # The "none" preset does not crop: image_size 224 is stored at 224 x 224 (a preset that
    # crops on the device, "photo", at 256 x 256: tests/read/backends/test_memory_backend.py).
    need = 100 * 3 * 224 * 224
    assert _choose(photos, image_size=224, free=2 * need)[0] == "memory"
    name, reason = _choose(photos, image_size=224, free=2 * need - 2)
    assert name == "cpu" and "100 images of 224x224" in reason


def test_photos_with_a_random_resized_crop_stay_on_the_cpu_backend_without_a_gpu():
    # memory would run the crop in the training process; cpu fuses it into decoding.
    photos = _manifest(100, encoding="jpeg")
    kw = dict(image_size=224, free=1 << 40)
    name, reason = _choose(photos, preset=get_preset("photo", 224), **kw)
    assert name == "cpu" and "it fits, but" in reason and "random-resized crop" in reason
    assert _choose(photos, **kw)[0] == "memory"  # "none": nothing to crop in the trainer
    assert _choose(CIFAR_LIKE, free=1 << 40, preset="cifar")[0] == "memory"  # raw pad-crop


def test_photos_of_varying_size_without_image_size_never_go_to_memory():
    name, reason = _choose(_manifest(10, encoding="jpeg"), free=1 << 40)
    assert name == "cpu" and "image_size" in reason


def test_choice_is_logged_with_its_figures(caplog):
    with caplog.at_level(logging.INFO, logger="fastdata"):
        _, reason = _choose()
    assert any(reason in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("share", [0, -0.1, 1.5])
def test_bad_memory_share(share):
    with pytest.raises(ValueError, match="memory_share"):
        _choose(memory_share=share)


def test_real_probes_answer():
    assert free_device_memory("cpu") > 0
    ok, why = backend_available("dali")
    assert isinstance(ok, bool) and (ok or why)


# ---------------------------------------------------------------- the splits that decide


def _splits_manifest(sizes: dict[str, int], fields=None, stats=None) -> Manifest:
    splits = {}
    for name, n in sizes.items():
        shard = ShardInfo(f"{name}-000000.tar", f"{name}-000000.idx", n, 1, "0" * 64)
        splits[name] = SplitInfo([shard], [n], "png", None, dict(stats or {}), fields=fields)
    return Manifest("/nowhere", ["a"], splits, {}, 0, "0")


def test_the_largest_of_the_splits_to_read_decides():
    manifest = _splits_manifest({"val": 10, "test": 30})  # no train split
    kw = dict(image_size=224, preset=get_preset("none", 224), free_memory=lambda _d: 1 << 40)
    _, reason = choose_backend(manifest, ["train", "val", "test"], "cpu", **kw)
    assert "split 'test'" in reason and "30 images of 224x224" in reason
    _, reason = choose_backend(manifest, ["val"], "cpu", **kw)
    assert "split 'val'" in reason and "10 images" in reason
    with pytest.raises(ValueError, match=r"none is in the manifest.*\['test', 'val'\]"):
        choose_backend(manifest, ["train"], "cpu", **kw)


def test_a_dict_split_is_sized_by_its_frames_at_their_own_size():
    from fastdata.format.fields import FieldSpec

    fields = {
        "image": FieldSpec("image", "image", ("png",)),
        "mask": FieldSpec("mask", "mask", ("mask.png",)),
    }
    stats = {"mean_height": 300.0, "mean_width": 400.0}
    manifest = _splits_manifest({"val": 10}, fields, stats)
    need = 10 * 300 * 400 * (3 + 1)  # RGB + one uint8 mask per pixel
    kw = dict(image_size=64, preset=get_preset("none", 64))
    name, reason = choose_backend(manifest, "val", "cpu", free_memory=lambda _d: 2 * need, **kw)
    assert name == "memory" and "10 samples at their own size" in reason
    name, _ = choose_backend(manifest, "val", "cpu", free_memory=lambda _d: 2 * need - 2, **kw)
    assert name == "cpu"
    unsized = _splits_manifest({"val": 10}, fields)  # no image_stats: not sized, not memory
    name, reason = choose_backend(unsized, "val", "cpu", free_memory=lambda _d: 1 << 40, **kw)
    assert name == "cpu" and "cannot be sized" in reason and "fastdata shard" in reason


@pytest.mark.parametrize(
    ("stage", "role"), [("validate", "val"), ("test", "test"), ("predict", "test")]
)
def test_auto_on_a_dataset_without_a_training_split(tmp_path, stage, role):
    from fastdata import DetectionDataModule
    from tests.lightning.family.conftest import rectangles, write_field_shards

    splits = {"val": rectangles(6, 3, fixed=(20, 20)), "test": rectangles(9, 4, fixed=(20, 20))}
    root = write_field_shards(tmp_path / "eval-only", splits)
    dm = DetectionDataModule(
        root, backend="auto", image_size=16, batch_size=4, workers=WorkerSettings(num_workers=0)
    )
    dm.setup(stage)
    assert dm.backend_name == "memory"  # 9 x 20 x 20 x (3 + 1) bytes fit; no crop to run
    loader = {"validate": dm.val_dataloader, "test": dm.test_dataloader}.get(
        stage, dm.predict_dataloader
    )()
    keys = [m["key"] for batch in dm.prepared(loader, "cpu") for m in batch["meta"]]
    assert sorted(keys) == sorted(r.key for r in splits[role])


# -- on a GPU: the faster GPU backend by measurement, not by what is installed --------------


def _choose_gpu(rates: dict[str, float | Exception], monkeypatch=None, **kw):
    """Both GPU backends available; `rates` are their fake measured images/s (or errors)."""
    asked: list[str] = []

    def rate(name: str) -> float:
        asked.append(name)
        value = rates[name]
        if isinstance(value, Exception):
            raise value
        return value

    name, reason = choose_backend(
        CIFAR_LIKE, "train", "cuda:0", None, preset=get_preset("none"),
        available=lambda name: (name in rates, "not installed"),
        free_memory=lambda dev: 4 * MiB, rate=rate, **kw,
    )  # fmt: skip
    return name, reason, asked


@pytest.mark.parametrize(
    ("dali", "nvjpeg", "want"),
    [(409.4, 6433.2, "nvjpeg"), (20_000.0, 7_000.0, "dali"), (7_000.0, 7_000.0, "dali")],
)
def test_auto_never_picks_the_slower_gpu_backend(dali, nvjpeg, want, caplog):
    """The 2026-12-04 H200 figures (dali 409, nvjpeg 6,433 images/s): today's rule took dali
    because it was installed."""
    with caplog.at_level(logging.INFO, logger="fastdata"):
        name, reason, asked = _choose_gpu({"dali": dali, "nvjpeg": nvjpeg})
    assert name == want and sorted(asked) == ["dali", "nvjpeg"]
    assert f"dali {dali:,.0f}" in reason and f"nvjpeg {nvjpeg:,.0f}" in reason
    lines = [r.getMessage() for r in caplog.records if "backend=auto chose" in r.getMessage()]
    assert len(lines) == 1 and f"chose {want!r}" in lines[0] and "fastest measured" in lines[0]


def test_a_backend_whose_probe_fails_is_not_chosen():
    name, reason, _ = _choose_gpu({"dali": RuntimeError("mixed decoder: out of memory"),
                                   "nvjpeg": 10.0})  # fmt: skip
    assert name == "nvjpeg" and "dali: its probe failed (RuntimeError: mixed decoder" in reason
    name, reason, _ = _choose_gpu({"dali": RuntimeError("a"), "nvjpeg": RuntimeError("b")})
    assert name == "cpu" and "its probe failed" in reason


def test_one_gpu_backend_is_taken_without_a_probe():
    name, reason, asked = _choose_gpu({"nvjpeg": 5.0})
    assert name == "nvjpeg" and asked == [] and "(the one GPU decoder here)" in reason


def test_the_default_probe_runs_once_per_backend_and_split(monkeypatch):
    from fastdata.read.backends import auto

    calls: list[str] = []

    def probe(name, manifest, split, device, image_size, preset):
        calls.append(name)
        return {"dali": 1.0, "nvjpeg": 2.0}[name]

    monkeypatch.setattr(auto, "probe_rate", probe)
    monkeypatch.setattr(auto, "_PROBED", {})
    for _ in range(2):
        name, _reason = choose_backend(
            CIFAR_LIKE, "train", "cuda:0", None, preset=get_preset("none"),
            available=lambda name: (True, ""), free_memory=lambda dev: 4 * MiB,
        )  # fmt: skip
        assert name == "nvjpeg"
    assert sorted(calls) == ["dali", "nvjpeg"]


def test_probe_rate_measures_a_real_loader(tiny_shards):
    """The probe itself, on the CPU with the cpu backend (the GPU backends need a GPU)."""
    from fastdata.format.manifest_io import load_manifest
    from fastdata.read.backends.auto import probe_rate

    manifest = load_manifest(tiny_shards)
    rate = probe_rate("cpu", manifest, "train", "cpu", None, get_preset("none"), batch_size=16,
                      warmup=1, measure=4)  # fmt: skip
    assert rate > 0
    with pytest.raises(RuntimeError, match="too small to probe cpu"):
        probe_rate("cpu", manifest, "train", "cpu", None, get_preset("none"), batch_size=100)
