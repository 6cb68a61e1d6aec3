"""`DatasetInfo`: what LightningModules read from their DataModule, from the manifest.

Modules build their heads from `self.trainer.datamodule.num_classes` (or take `dm.num_classes` as a
constructor argument, before any `setup()`), label their logs with `classes`, and size their stems
or example inputs from `image_shape`. These properties read the manifest once, lazily, and never
choose a backend or start a loader, so they are safe before the Trainer is attached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdata.format.manifest import Manifest, resolve_splits
from fastdata.lightning.transforms import TransformSpec, resolve_transforms

if TYPE_CHECKING:  # pragma: no cover
    from fastdata.augment import Preset

__all__ = ["DEFAULT_PHOTO_SIZE", "SMALL_IMAGE_SIDE", "DatasetInfo"]

# Here, not in datamodule.py (which imports them from here), so that the DataModule's mixin does
# not import the DataModule: the defaults of `setup()` that the mixin predicts before it runs.
DEFAULT_PHOTO_SIZE = 224
SMALL_IMAGE_SIDE = 64  # raw data at most this size gets the "cifar" preset by default


class DatasetInfo:
    """Mixin of `ShardDataModule`: `num_classes`, `classes`, `image_shape` from the manifest.

    The host class provides the attributes annotated below and `_read_manifest()`.
    """

    manifest: Manifest | None
    transforms: Preset | None
    image_size: int | None
    split_names: dict[str, str]
    train_transforms_spec: TransformSpec | None
    eval_transforms_spec: TransformSpec | None
    _described: Manifest | None = None

    def _read_manifest(self) -> Manifest:  # pragma: no cover - provided by the host
        raise NotImplementedError

    def _load_manifest(self) -> Manifest:
        """The manifest (a mix's merged one), read once and kept for `setup()`."""
        if self._described is None:
            self._described = self._read_manifest()
        return self._described

    @property
    def classes(self) -> list[str]:
        """Class names: label `i` is `classes[i]` (a mix: its classes merged by name).

        Raises:
            fastdata.format.manifest.ManifestError: the manifest is missing or unreadable (names it).
        """
        return list((self.manifest or self._load_manifest()).classes)

    @property
    def num_classes(self) -> int:
        """The number of classes, i.e. the size of a classifier's output layer.

        Raises:
            fastdata.format.manifest.ManifestError: the manifest is missing or unreadable (names it).
        """
        return (self.manifest or self._load_manifest()).num_classes

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the images the model receives (after the training transforms).

        Fixed-size data keeps its size unless `image_size` is given; photos (or a preset that
        crops) get `image_size` squared (224 by default). For a callable training transform this
        is the size the DataModule feeds it: the callable's own output size is not known.

        Raises:
            fastdata.format.manifest.ManifestError: the manifest is missing or unreadable (names it).
        """
        if self.transforms is not None:  # after setup(): what it resolved
            size, raw = self.transforms.image_size, self._train_raw_shape(self.manifest)
        else:
            size, raw = self._expected_size()
        if size is not None:
            return (3, size, size)
        if raw is None:  # pragma: no cover - setup() and _expected_size() set a size then
            raise ValueError("images of varying size need image_size")
        return (3, int(raw[0]), int(raw[1]))

    def _train_raw_shape(self, manifest: Manifest) -> list[int] | None:
        names = resolve_splits(manifest, self.split_names)
        return manifest.split(names.get("train") or next(iter(manifest.splits))).raw_shape

    def _expected_size(self) -> tuple[int | None, list[int] | None]:
        """(output side or None, raw (H, W, C) or None) as `setup()` will resolve them."""
        raw = self._train_raw_shape(self._load_manifest())
        image_size = self.image_size
        if image_size is None and raw is None:
            image_size = DEFAULT_PHOTO_SIZE
        small = raw is not None and max(raw[:2]) <= SMALL_IMAGE_SIDE
        chosen = self.train_transforms_spec or ("cifar" if small else "photo")
        preset = resolve_transforms(chosen, self.eval_transforms_spec, image_size, None, None)
        return preset.image_size, raw
