"""The nvjpeg backend on the CPU: everything but the GPU decode call, which a fake replaces.

The fake decodes with Pillow to CHW tensors, as ``torchvision.io.decode_jpeg(..., device="cuda")``
returns them; the loader must then crop the same regions (and flip the same samples) as the cpu
backend, from the same plan.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fastdata.format.manifest_io import load_manifest
from fastdata.read.backends import nvjpeg
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.backends.nvjpeg import NvjpegLoader, crop_resize, nvjpeg_status
from fastdata.read.base import LoaderSpec
from fastdata.read.decoders.image import Geometry, draw_crop
from fastdata.read.shardio import ShardReadError
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.folder import FolderSource

SIZE = 24


def _smooth_folder(root: Path, classes: int = 3, per_class: int = 6) -> Path:
    """JPEGs (and one PNG per class) of smooth, asymmetric gradients: resamplers agree on them,
    and a mirrored crop differs clearly from an unmirrored one."""
    yy, xx = np.mgrid[0:60, 0:80].astype(np.float32)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = np.stack([xx * 3, yy * 4, (xx + yy) * (1 + i % 3)], axis=-1)
            image = Image.fromarray(np.clip(pixels + 10 * c, 0, 255).astype(np.uint8))
            if i == per_class - 1:
                image.save(folder / f"img{i}.png", "PNG")
            else:
                image.save(folder / f"img{i}.jpg", "JPEG", quality=95)
    return root


@pytest.fixture
def photo_shards(tmp_path: Path) -> Path:
    source = FolderSource(_smooth_folder(tmp_path / "images"))
    out = tmp_path / "shards"
    write_shards(source, out, ShardOptions(max_count=5, workers=1, progress=False))
    return out


def _spec(root: Path, **kw) -> LoaderSpec:
    manifest = load_manifest(root)
    base = dict(
        manifest=manifest,
        split=next(iter(manifest.splits)),
        train=True,
        batch_size=4,
        seed=3,
        preset="photo",
        image_size=SIZE,
    )
    base.update(kw)
    return LoaderSpec(**base)


class FakeDecoder:
    """Pillow standing in for nvJPEG: a list of byte tensors -> a list of CHW uint8 tensors."""

    def __init__(self, fail_on: bytes | None = None) -> None:
        self.calls: list[int] = []
        self.fail_on = fail_on

    def __call__(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls.append(len(data))
        out = []
        for t in data:
            raw = t.numpy().tobytes()
            assert raw[:2] == b"\xff\xd8", "only JPEG bytes go to the GPU decoder"
            if self.fail_on is not None and raw == self.fail_on:
                raise RuntimeError("nvjpeg: bitstream error")
            pixels = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
            out.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1))
        return out


# -- geometry: the cpu backend's windows, cropped and resized in a batch ------------------------


def test_windows_are_the_cpu_decoders_draws():
    """nvjpeg draws no geometry of its own: its window and flip are `draw_crop`'s."""
    spec_seed = 3
    geometry = Geometry("rrc", SIZE, flip_p=0.5)

    class Spec:
        seed = spec_seed

    for position in range(20):
        rng = np.random.default_rng(nvjpeg.sample_seed(spec_seed, 1, position))
        want = draw_crop((80, 60), geometry, rng)
        assert nvjpeg.draw_box((60, 80), geometry, Spec, 1, position) == want
    assert not hasattr(nvjpeg, "crop_box")


def test_draw_crop_center_cover_and_none():
    rng = np.random.default_rng(0)
    (left, top, right, bottom), flip = draw_crop((80, 60), Geometry("center", 28), rng)
    side = round(60 / (256 / 224))
    assert (right - left, bottom - top) == (side, side) and not flip
    assert (left, top) == ((80 - side) // 2, (60 - side) // 2)
    assert draw_crop((80, 60), Geometry("cover", hw=(30, 30)), rng) == ((10, 0, 70, 60), False)
    assert draw_crop((80, 60), Geometry("none"), rng) == ((0, 0, 80, 60), False)


def test_crop_resize_crops_resizes_and_flips():
    image = torch.arange(5 * 7, dtype=torch.uint8).reshape(1, 5, 7).repeat(3, 1, 1)
    box = (2, 1, 6, 4)  # left, top, right, bottom
    out = crop_resize([image, image], [box, box], (3, 4), [False, True])
    assert out.shape == (2, 3, 3, 4) and out.dtype == torch.uint8
    assert torch.equal(out[0], image[:, 1:4, 2:6])  # same size: an exact crop
    assert torch.equal(out[1], image[:, 1:4, 2:6].flip(-1))
    smaller = crop_resize([image], [(0, 0, 7, 5)], (2, 3), [False])
    assert smaller.shape == (1, 3, 2, 3)


@pytest.mark.parametrize("path", ["dense", "chunks", "per_image"])
@pytest.mark.parametrize("out_hw", [(24, 24), (90, 70), (5, 9)])
def test_batched_crop_resize_gives_per_image_interpolate_pixels(out_hw, path, monkeypatch):
    """Mixed image sizes (several groups), down- and up-scaling, flips: within one level of
    a per-image antialiased `interpolate` of the crop (float rounding), whether a group is
    stacked whole, in chunks of one or two images, or resized one by one (large images)."""
    from fastdata.read.backends import crop_resize as module

    if path == "chunks":
        monkeypatch.setattr(module, "CHUNK_BYTES", 2 * 3 * 49 * 70 * 4)
    if path == "per_image":
        monkeypatch.setattr(module, "DENSE_MAX_PIXELS", 0)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(1)
    images, boxes, flips = [], [], []
    for i in range(12):
        h, w = 40 + 9 * (i % 3), 70 - 6 * (i % 2)
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen))
        left, top = int(rng.integers(0, w - 1)), int(rng.integers(0, h - 1))
        right, bottom = int(rng.integers(left + 1, w + 1)), int(rng.integers(top + 1, h + 1))
        boxes.append((left, top, right, bottom))
        flips.append(bool(i % 3 == 1))
    got = crop_resize(images, boxes, out_hw, flips)
    for i, (image, (left, top, right, bottom), flip) in enumerate(
        zip(images, boxes, flips, strict=True)
    ):
        crop = image[None, :, top:bottom, left:right].float()
        want = F.interpolate(crop, size=out_hw, mode="bilinear", antialias=True)[0]
        want = (want.flip(-1) if flip else want).round().clamp(0, 255)
        assert (got[i].float() - want).abs().max() <= 1, i


def test_crop_resize_refuses_a_box_outside_the_image():
    image = torch.zeros((3, 5, 7), dtype=torch.uint8)
    with pytest.raises(ValueError, match="not inside its 7x5"):
        crop_resize([image], [(0, 0, 8, 5)], (5, 7), [False])


# -- the loader ------------------------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False])
def test_same_samples_regions_and_flips_as_the_cpu_backend(photo_shards, train):
    spec = _spec(photo_shards, train=train)
    decoder = FakeDecoder()
    loader = NvjpegLoader(spec, decoder=decoder)
    cpu = make_cpu_loader(spec)
    assert len(loader) == len(cpu) and loader.applied_ops == cpu.applied_ops
    assert not loader.normalized and not loader.augmented
    batches = 0
    for (x, y), (cx, cy) in zip(loader, cpu, strict=True):
        assert x.dtype == torch.uint8 and x.shape == cx.shape == (len(y), 3, SIZE, SIZE)
        assert torch.equal(y, cy)
        # Another resampler (and the cpu backend's JPEG draft scaling): close, not equal.
        diff = (x.float() - cx.float()).abs().mean(dim=(1, 2, 3))
        assert diff.max() < 12, diff
        batches += 1
    assert batches == len(cpu) and sum(decoder.calls) > 0


def test_png_samples_are_decoded_on_the_cpu(photo_shards):
    decoder = FakeDecoder()  # asserts it never sees PNG bytes
    loader = NvjpegLoader(_spec(photo_shards, batch_size=18, drop_last=False), decoder=decoder)
    (x, y), *_ = list(loader)
    assert len(y) == 18 and decoder.calls == [15]  # 3 PNGs of 18 took the CPU path


def test_set_epoch_changes_the_order_and_len_counts_the_plan(photo_shards):
    loader = NvjpegLoader(_spec(photo_shards), decoder=FakeDecoder())
    first = [int(v) for _, y in loader for v in y]
    loader.set_epoch(1)
    second = [int(v) for _, y in loader for v in y]
    assert sorted(first) == sorted(second) and first != second
    loader.set_epoch(0, consumed=8, steps_before=2)
    assert len(loader) == len(_spec(photo_shards).plan(0, 8, 2))


def _first_jpeg(photo_shards, spec):
    from fastdata.read.shardio import ShardReader

    reader = ShardReader(load_manifest(photo_shards), spec.split)
    batch = nvjpeg.read_batch(reader, spec, spec.plan(0), 0)
    reader.close()
    return batch.payloads[batch.exts.index("jpg")], batch.payloads


def test_a_jpeg_nvjpeg_refuses_is_decoded_on_the_cpu_and_counted(photo_shards, caplog):
    spec = _spec(photo_shards, train=False, batch_size=18)
    refused, payloads = _first_jpeg(photo_shards, spec)
    same = payloads.count(refused)  # the folder repeats some images byte for byte
    want = [x for x, _ in NvjpegLoader(spec, decoder=FakeDecoder())]
    decoder = FakeDecoder(fail_on=refused)
    loader = NvjpegLoader(spec, decoder=decoder)
    with caplog.at_level("WARNING", logger="fastdata"):
        got = [x for x, _ in loader]  # no ShardReadError
    warned = [r.getMessage() for r in caplog.records if "refused by nvJPEG" in r.getMessage()]
    assert len(warned) == 1 and "bitstream error" in warned[0] and ".tar, sample '" in warned[0]
    assert loader.cpu_fallbacks == same >= 1
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # Pillow both ways
    calls = len(decoder.calls)
    list(loader)  # the next epoch sends it straight to the CPU: no failing batch call again
    assert loader.cpu_fallbacks == 2 * same and len(decoder.calls) == calls + 1


def test_a_jpeg_no_decoder_reads_is_named(photo_shards, monkeypatch):
    spec = _spec(photo_shards, train=False, batch_size=18)
    bad, _ = _first_jpeg(photo_shards, spec)
    real = nvjpeg.decode_image

    def pillow(data, geometry, rng):
        if bytes(data) == bad:
            raise ValueError("cannot decode image (OSError: broken data stream)")
        return real(data, geometry, rng)

    monkeypatch.setattr(nvjpeg, "decode_image", pillow)
    loader = NvjpegLoader(spec, decoder=FakeDecoder(fail_on=bad))
    with pytest.raises(ShardReadError, match=r"\.tar, sample '.+_\d{8}'.*broken data stream"):
        list(loader)


def test_the_next_batch_decodes_while_this_one_is_consumed(photo_shards):
    """Batch 1 is decoded (in the decode thread) while the caller still holds batch 0."""
    import threading
    import time

    threads: list[str] = []
    decoder = FakeDecoder()

    def recording(data):
        threads.append(threading.current_thread().name)
        return decoder(data)

    loader = NvjpegLoader(_spec(photo_shards, batch_size=4), decoder=recording)
    batches = iter(loader)
    next(batches)
    deadline = time.monotonic() + 10
    while len(threads) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(threads) >= 2, "batch 1 was not decoded ahead"
    assert all(name.startswith("fastdata-nvjpeg-decode") for name in threads)
    assert len(list(batches)) == len(loader) - 1


def test_raw_splits_and_skip_are_refused(tiny_shards, photo_shards):
    with pytest.raises(ValueError, match="raw pixels"):
        NvjpegLoader(_spec(tiny_shards, preset="none", image_size=None), decoder=FakeDecoder())
    with pytest.raises(ValueError, match="on_error='raise' only"):
        NvjpegLoader(_spec(photo_shards, on_error="skip"), decoder=FakeDecoder())


# -- availability ------------------------------------------------------------------------------


def test_status_without_gpu_or_torchvision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert nvjpeg_status() == (False, "no CUDA GPU is visible")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(nvjpeg.importlib.util, "find_spec", lambda name: None)
    ok, reason = nvjpeg_status()
    assert not ok and "torchvision is not installed" in reason


def test_status_never_raises(monkeypatch):
    def broken(name):
        raise OSError("libnvjpeg.so.13: cannot open shared object file")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(nvjpeg.importlib.util, "find_spec", broken)
    ok, reason = nvjpeg_status()
    assert not ok and "libnvjpeg" in reason
    assert nvjpeg.nvjpeg_available() is False


def test_boxes_drawn_in_the_read_thread_match_the_draws_after_decoding(photo_shards):
    spec = _spec(photo_shards)
    loader = NvjpegLoader(spec, decoder=FakeDecoder())
    plan = spec.plan(0)
    from fastdata.read.shardio import ShardReader

    reader = ShardReader(load_manifest(photo_shards), spec.split)
    early = nvjpeg.read_batch(reader, spec, plan, 0, loader.geometry)
    late = nvjpeg.read_batch(reader, spec, plan, 0)
    assert not late.draws and len(early.draws) == len(early.payloads)
    for ext, data, drawn in zip(early.exts, early.payloads, early.draws, strict=True):
        assert (drawn is None) == (ext == "png")  # PNG sizes come from decoding
        if drawn is not None:
            assert drawn[0] == Image.open(io.BytesIO(data)).size[::-1]
    # Same pixels whether the boxes came early or were drawn after decoding.
    x_early, y_early = loader.decode_batch(early, 0, reader)
    x_late, y_late = loader.decode_batch(late, 0, reader)
    assert torch.equal(x_early, x_late) and torch.equal(y_early, y_late)
    # A header size the decoder disagrees with is not trusted: the box is drawn again.
    wrong = [None if d is None else ((1, 1), (0, 0, 1, 1), False) for d in early.draws]
    x_wrong, _ = loader.decode_batch(replace(early, draws=wrong), 0, reader)
    assert torch.equal(x_wrong, x_late)
    reader.close()


def test_crop_resize_checks_its_flips():
    image = torch.zeros((3, 5, 7), dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 images but 2 boxes and 1 flips"):
        crop_resize([image, image], [(0, 0, 7, 5)] * 2, (5, 7), [False])
