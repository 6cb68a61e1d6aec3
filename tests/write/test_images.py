"""Every image kind a standard Pillow opens shards and loads as 3-channel batches; broken files are
listed with a reason a person can act on."""

from __future__ import annotations

import io
import re
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata import ShardDataModule, WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.write import ShardOptions, write_shards
from fastdata.write.images import UnreadableImage, open_image, to_rgb
from fastdata.write.sources.folder import FolderSource

# The zoo writes TIFF/WebP cases with imagecodecs (a test extra; the GPU machine lacks it).
pytest.importorskip("imagecodecs", reason="the image zoo writes TIFF/WebP cases with it")
from tests.write.image_zoo import BROKEN, make_zoo, valid_images  # noqa: E402

# The zoo is a third broken files on purpose: no max_bad stop.
OPTS = ShardOptions(max_count=8, workers=1, progress=False, max_bad=1.0)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> tuple[Path, Path, list]:
    """(image folder, shard folder, valid images), sharded once for the module."""
    root = tmp_path_factory.mktemp("zoo")
    images, _ = make_zoo(root / "images")
    write_shards(FolderSource(root / "images"), root / "shards", OPTS)
    return root / "images", root / "shards", images


def _stored_samples(out: Path) -> dict[int, tuple[str, bytes]]:
    """sample id -> (image ext, image bytes) of every sample in the shards."""
    manifest = load_manifest(out)
    found: dict[int, tuple[str, bytes]] = {}
    for shard in manifest.split("train").shards:
        with tarfile.open(out / shard.name) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, data in members.items():
            key, ext = name.split(".", 1)
            if ext in ("jpg", "png"):
                found[int(key.rsplit("_", 1)[1])] = (ext, data)
    return found


def test_each_kind_decodes_to_the_pixels_it_shows():
    for image in valid_images():
        rgb = np.asarray(to_rgb(open_image(image.data).image))
        assert rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.dtype == np.uint8, image.name
        if image.expected is not None:
            assert rgb.shape == image.expected.shape, image.name
            diff = np.abs(rgb.astype(int) - image.expected.astype(int)).max()
            assert diff <= 1, f"{image.name}: differs by {diff}"


def test_sixteen_bit_grey_is_scaled_not_clipped_to_white():
    ramp = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (4, 1))
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, "PNG")
    rgb = np.asarray(to_rgb(open_image(buf.getvalue()).image))
    assert rgb[..., 0].min() == 0 and rgb[..., 0].max() == 255
    assert 120 <= rgb[0, 128, 0] <= 135  # the middle of the ramp is mid-grey, not white


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_files_get_a_reason_a_person_can_act_on(name):
    data, phrase = BROKEN[name]
    with pytest.raises(UnreadableImage) as info:
        open_image(data)
    assert phrase in info.value.reason
    assert not re.search(r"0x[0-9a-f]{6,}", info.value.reason)


def test_missing_codec_library_is_named(monkeypatch):
    webp = next(image for image in valid_images() if image.name == "still.webp")
    monkeypatch.setitem(sys.modules, "imagecodecs", None)  # import imagecodecs -> ImportError
    with pytest.raises(UnreadableImage, match=r"^WebP: no decoder .*install imagecodecs"):
        open_image(webp.data)


def test_manifest_keeps_every_valid_image_and_lists_each_broken_one(zoo):
    images_dir, out, images = zoo
    manifest = load_manifest(out)
    train = manifest.split("train")
    assert train.num_samples == len(images)
    assert train.encoding == "mixed"
    skipped = {Path(s.origin).name: s.reason for s in train.skipped}
    assert sorted(skipped) == sorted(BROKEN)
    for name, (_, phrase) in BROKEN.items():
        assert phrase in skipped[name]
    assert not any("0x" in reason for reason in skipped.values())


def test_jpeg_bytes_are_kept_and_the_rest_is_stored_as_rgb_png(zoo):
    images_dir, out, images = zoo
    source = FolderSource(images_dir)
    by_name = {image.name: image for image in images}
    stored = _stored_samples(out)
    assert len(stored) == len(images)
    for sample_id, (ext, data) in stored.items():
        name = source.item("train", sample_id).path.name
        image = by_name[name]
        if image.kept:
            assert ext == "jpg" and data == image.data, name
            continue
        assert ext == "png", name
        png = Image.open(io.BytesIO(data))
        assert png.mode == "RGB", name
        if image.expected is not None:
            diff = np.abs(np.asarray(png).astype(int) - image.expected.astype(int)).max()
            assert diff <= 1, f"{name}: stored pixels differ by {diff}"


BACKENDS = [
    "cpu",
    "memory",
    pytest.param("dali", marks=pytest.mark.dali),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_yields_three_channel_batches(zoo, backend):
    _, out, images = zoo
    dm = ShardDataModule(
        out,
        batch_size=4,
        backend=backend,
        image_size=32,
        drop_last=False,
        workers=WorkerSettings(num_workers=0),
    )
    dm.setup("fit")
    seen = 0
    for batch in dm.train_dataloader():
        # What Lightning does with each batch: the device-side part of the preset (the memory
        # backend's uint8 batches are cropped and normalized here).
        batch_images, labels = dm.on_after_batch_transfer(batch, 0)
        assert tuple(batch_images.shape[1:]) == (3, 32, 32), backend
        assert batch_images.shape[0] == labels.shape[0]
        assert bool(batch_images.float().isfinite().all())
        seen += int(labels.shape[0])
    assert seen == len(images)


@pytest.mark.dali
def test_dali_cpu_decodes_the_kept_jpegs_as_pillow_does():
    """Why "keep" may keep grey, CMYK and progressive JPEG bytes: DALI reads them to the same RGB."""
    from nvidia.dali import fn, pipeline_def, types

    kept = [image for image in valid_images() if image.kept and len(image.data) < 1 << 20]
    assert {"cmyk.jpg", "progressive.jpg", "mixed.Jpeg"} <= {image.name for image in kept}
    encoded = [np.frombuffer(image.data, dtype=np.uint8) for image in kept]

    @pipeline_def(batch_size=len(kept), num_threads=1, device_id=None)
    def decode():
        data = fn.external_source(source=lambda: encoded, batch=True)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    (outputs,) = pipe.run()
    for i, image in enumerate(kept):
        dali = np.array(outputs[i])
        pillow = np.asarray(Image.open(io.BytesIO(image.data)).convert("RGB"))
        assert dali.shape == pillow.shape, image.name
        assert np.abs(dali.astype(int) - pillow.astype(int)).max() <= 1, image.name


def test_an_image_over_pillows_pixel_limit_says_what_to_do(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # errors above 2x: 200 pixels
    buf = io.BytesIO()
    Image.new("RGB", (30, 30)).save(buf, "PNG")
    with pytest.raises(UnreadableImage, match=r"^PNG: .*900 pixels.*MAX_IMAGE_PIXELS"):
        open_image(buf.getvalue())
