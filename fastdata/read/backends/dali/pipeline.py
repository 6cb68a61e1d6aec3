"""The DALI pipeline of a loader: built once, fed every batch of the plan with its crop windows.

The graph does what the cpu backend's decoder does (`fastdata.read.decoders.image`), with the
cpu backend's geometry (`cpu_batches.decode_geometry`) and the windows it draws for each sample
(`fastdata.read.backends.dali.feed`), so both backends give the same images up to the resize
kernels' rounding:

- "rrc" / "center": ``fn.decoders.image_slice`` decodes the drawn window (absolute anchor and
  shape inputs: only that region of a JPEG is decoded), ``fn.resize`` (linear, antialiased)
  brings it to size x size, ``fn.crop_mirror_normalize`` flips it where the draw said so and
  writes uint8 CHW;
- "cover": ``fn.decoders.image`` decodes the whole image and ``fn.resize`` resizes the sub-pixel
  window of `resize.cover_box` to the stored size;
- "none": the decoded image as it is; raw splits: the gathered NCHW batch as it is.

The rest of the preset (a pad-crop, user callables) runs batched on the training device like
every backend's (`ShardDataModule.on_after_batch_transfer`). Decoding runs on the ``mixed``
backend (nvJPEG, the hardware JPEG decoder) with a CUDA device, else on the CPU
(``device_id=None``); JPEG chroma is upsampled as libjpeg-turbo does by default (the cpu
backend's decoder) and EXIF orientation is ignored, as there. `nvidia.dali` is imported inside
the builders only, so importing this module never needs DALI.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from fastdata.format.manifest import SplitInfo
from fastdata.read.decoders.image import Geometry

__all__ = [
    "HW_DECODER_LOAD",
    "WINDOW_INPUTS",
    "DecoderSettings",
    "GraphShape",
    "build_pipeline",
    "decoder_settings",
    "new_pipeline",
]

log = logging.getLogger("fastdata")

#: Share of the JPEGs given to the hardware decoder (A100/H100/H200) by the mixed decoder: DALI's
#: documented default, set explicitly and recorded (`DaliLoader.decoder`); not tuned on a GPU yet.
HW_DECODER_LOAD = 0.65


@dataclass(frozen=True)
class DecoderSettings:
    """What the DALI decoder is told (recorded as `DaliLoader.decoder`).

    Attributes:
        hw_decoder_load: share of the JPEGs for the hardware decoder (mixed backend).
        preallocate_width_hint: the split's widest image (manifest `image_stats`; 0: unknown),
            so the hardware decoder's buffers are allocated once, not grown.
        preallocate_height_hint: the split's tallest image (0: unknown).
        jpeg_fancy_upsampling: chroma upsampled as libjpeg-turbo does (the cpu backend's pixels).
        adjust_orientation: EXIF orientation applied (False, as the cpu backend).
    """

    hw_decoder_load: float = HW_DECODER_LOAD
    preallocate_width_hint: int = 0
    preallocate_height_hint: int = 0
    jpeg_fancy_upsampling: bool = True
    adjust_orientation: bool = False

    def kwargs(self) -> dict[str, Any]:
        """The settings as DALI decoder arguments."""
        return asdict(self)


def decoder_settings(info: SplitInfo) -> DecoderSettings:
    """The decoder settings of a split: buffer hints from its largest image (`image_stats`)."""
    stats = info.image_stats or {}
    return DecoderSettings(
        preallocate_width_hint=int(stats.get("max_width", 0)),
        preallocate_height_hint=int(stats.get("max_height", 0)),
    )


#: The inputs of a batch decoded through windows (`PlanFeeder`): encoded bytes, labels, each
#: image's window (anchor (x, y), shape (w, h)), the padded window's (h, w), the resize's ROI in
#: the padded window ((y, x) start and end), the share of the filter on the image of each output
#: row (H, 1, 1) and column (1, W, 1), and the flip.
WINDOW_INPUTS = (
    "data", "labels", "anchor", "shape", "pad_h", "pad_w", "roi_start", "roi_end", "rows",
    "cols", "mirror",
)  # fmt: skip


@dataclass(frozen=True)
class GraphShape:
    """What the graph needs to know; fixed for the life of the loader.

    Attributes:
        geometry: the decode-time geometry (the cpu backend's, `decode_geometry`).
        raw: the split is raw pixels (fed as gathered NCHW batches).
        gpu: decode on the ``mixed`` backend and run the ops on the GPU.
        decoder: the decoder's settings.
    """

    geometry: Geometry
    raw: bool
    gpu: bool
    decoder: DecoderSettings

    @property
    def inputs(self) -> tuple[str, ...]:
        """The names of the per-batch inputs, in the order the feeder yields them."""
        if self.raw or self.geometry.kind == "none":
            return ("data", "labels")
        return WINDOW_INPUTS


def new_pipeline(
    *, batch_size: int, threads: int, device_id: int | None, prefetch: int, seed: int
) -> Any:
    """An empty DALI pipeline as every fastdata loader runs it (`PipelineLoader`)."""
    from nvidia.dali import Pipeline

    return Pipeline(
        batch_size=batch_size,
        num_threads=threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=prefetch,
        # Outputs bound to the caller's stream (`run(stream)`) need the dynamic executor, the
        # default only in recent DALI releases.
        exec_dynamic=True,
    )


def build_pipeline(shape: GraphShape, source: Callable[[], tuple[Any, ...]], **options: Any) -> Any:
    """A built DALI pipeline whose one external source calls `source` for each batch's inputs
    (`GraphShape.inputs`; StopIteration ends the epoch, ``pipe.reset()`` starts the next);
    `options` are `new_pipeline`'s."""
    from nvidia.dali import fn, types

    pipe = new_pipeline(**options)
    dtypes = {
        "data": types.UINT8,
        "labels": types.INT64,
        "anchor": types.INT32,
        "shape": types.INT32,
        "mirror": types.INT32,
        "pad_h": types.FLOAT,
        "pad_w": types.FLOAT,
        "roi_start": types.FLOAT,
        "roi_end": types.FLOAT,
        "rows": types.FLOAT,
        "cols": types.FLOAT,
    }
    with pipe:
        nodes = fn.external_source(
            source=source,
            num_outputs=len(shape.inputs),
            batch=True,
            dtype=[dtypes[name] for name in shape.inputs],
        )
        inputs = dict(zip(shape.inputs, nodes, strict=True))
        images = _images(inputs, shape)
        labels = inputs["labels"]
        pipe.set_outputs(images, labels.gpu() if shape.gpu else labels)
    pipe.build()
    return pipe


def _images(inputs: dict[str, Any], shape: GraphShape) -> Any:
    """The graph: a batch's inputs -> uint8 CHW images at the geometry's output size."""
    from nvidia.dali import fn, types

    data, g = inputs["data"], shape.geometry
    if shape.raw:  # gathered NCHW pixels: every op runs on the device
        return data.gpu() if shape.gpu else data
    decoder = "mixed" if shape.gpu else "cpu"
    device = "gpu" if shape.gpu else "cpu"
    settings = shape.decoder.kwargs()
    if g.kind == "none":
        images = fn.decoders.image(data, device=decoder, output_type=types.RGB, **settings)
        return fn.crop_mirror_normalize(
            images, device=device, dtype=types.UINT8, output_layout="CHW"
        )
    # Only the window is decoded (the JPEG's region); then `_resize_like_pillow`.
    window = fn.decoders.image_slice(
        data, inputs["anchor"], inputs["shape"], device=decoder, output_type=types.RGB, **settings
    )
    images = _resize_like_pillow(window, inputs, g.out_hw, device)
    return fn.crop_mirror_normalize(
        images, device=device, dtype=types.UINT8, output_layout="CHW", mirror=inputs["mirror"]
    )


def _resize_like_pillow(
    window: Any, inputs: dict[str, Any], hw: tuple[int, int], device: str
) -> Any:
    """The window's ROI resized to `hw` with the cpu backend's filter, as float HWC.

    DALI's antialiased linear resize is Pillow's (and torch's) triangle filter inside the image,
    but it repeats the edge pixels where the filter reaches past the image, where Pillow leaves
    them out and renormalizes: up to ~15 grey levels apart on the edge rows of a downscaled
    crop. So the window is padded with zeros by the filter's reach (``pad_h`` x ``pad_w``,
    centred), resized, and divided by the share of each output pixel's filter weight that fell
    on the image (``rows`` x ``cols``, separable: `feed.weight_inside`), which is Pillow's
    renormalization (within a grey level of the cpu backend's pixels:
    tests/read/backends/test_dali_backend.py).
    """
    from nvidia.dali import fn, types

    padded = fn.crop(
        window,
        device=device,
        crop_h=inputs["pad_h"],
        crop_w=inputs["pad_w"],
        out_of_bounds_policy="pad",
        fill_values=0,
    )
    resized = fn.resize(
        padded,
        device=device,
        size=list(hw),
        roi_start=inputs["roi_start"],
        roi_end=inputs["roi_end"],
        interp_type=types.INTERP_LINEAR,
        antialias=True,
        dtype=types.FLOAT,
    )
    share = inputs["rows"] * inputs["cols"]
    return resized / (share.gpu() if device == "gpu" else share)
