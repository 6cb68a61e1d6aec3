"""`DatasetInfo`: what LightningModules read from their DataModule, from the manifest.

Modules build their heads from `self.trainer.datamodule.num_classes` (or take `dm.num_classes` as a
constructor argument, before any `setup()`), label their logs with `classes`, and size their stems
or example inputs from `image_shape`. These properties read the manifest once, lazily, and never
choose a backend or start a loader, so they are safe before the Trainer is attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastdata.augment.presets import default_preset
from fastdata.format.manifest import Manifest, resolve_splits
from fastdata.lightning.transforms import TransformSpec, resolve_transforms

if TYPE_CHECKING:  # pragma: no cover
    from fastdata.augment import Preset

__all__ = ["DatasetInfo"]


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
        chosen, image_size = self._default_transforms(raw)
        preset = resolve_transforms(chosen, self.eval_transforms_spec, image_size, None, None)
        return preset.image_size, raw

    def _default_transforms(
        self, raw_shape: Sequence[int] | None
    ) -> tuple[TransformSpec, int | None]:
        """(training transforms, output side) as `setup()` resolves them: the ones given, else
        `_default_train_transforms` of `fastdata.augment.default_preset`'s choice; `image_size`,
        else that rule's size."""
        name, image_size = default_preset(raw_shape, self.image_size)
        return self.train_transforms_spec or self._default_train_transforms(name), image_size

    def _default_train_transforms(self, name: str) -> TransformSpec:
        """The training transforms when none are given; `name` is the default preset's name.
        Family members with a task's own default override this (`fastdata.lightning.family`)."""
        return name
