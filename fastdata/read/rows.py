"""One planned-batch reader: plan rows -> each sample's components, label, padding flag, skips.

Every backend that reads shards per batch (cpu, nvjpeg, dali) and the decoded cache (which reads
a split once, row by row) turns rows of the epoch plan into samples here, so that the steps they
share are written once:

1. row -> (shard, index in shard) (`plan.rows_to_refs`);
2. the sample's components (`ShardReader.sample`), its key;
3. classification splits: the label (`schema.label_and_id`), mapped through a mix's merged
   classes (`ShardEntry.map_label`), and the image component; other splits: every component,
   decoded later field by field (`fastdata.read.decoders.dict_batch`);
4. evaluation padding: the padded flag (and `PAD_LABEL` for a classification label);
5. errors: a `ShardReadError` naming the shard and the key (and the field, for a field's error)
   under ``on_error="raise"``; a `Skip` under ``on_error="skip"``, counted by the caller and
   logged once per key (`log_skips`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from fastdata.format import schema
from fastdata.read.plan import PAD_LABEL, EpochPlan, rows_to_refs
from fastdata.read.shardio import ShardReader, ShardReadError

__all__ = ["PlannedBatch", "RowReader", "RowSample", "Skip", "log_skips"]

log = logging.getLogger("fastdata")


@dataclass(frozen=True)
class Skip:
    """A sample skipped under on_error='skip': counted and logged when its batch is handed out.

    Attributes:
        shard: the shard's name.
        key: the sample's key (``#index`` when the index itself is unreadable).
        reason: what went wrong.
        shard_failed: the whole shard failed (`ShardReadError.shard_failed`).
    """

    shard: str
    key: str
    reason: str
    shard_failed: bool = False


class RowSample(NamedTuple):
    """One sample of a planned batch, read but not decoded (`PlannedBatch.rows` holds them as
    plain tuples in this order: a tuple costs a tenth of an object, per sample of every batch).

    Attributes:
        slot: its place in the planned batch (0 .. batch size - 1).
        shard: the shard's number in the split.
        index: the sample's index in its shard.
        parts: the sample's components (zero-copy views: valid while the reader is open).
        label: classification: the (mapped) label, `PAD_LABEL` for evaluation padding;
            None for other splits.
        image: classification: (component, bytes) of the image; None for other splits.
        padded: an evaluation padding sample (a repeat that metrics skip).
        position: its position in the epoch order (its generator's seed).
    """

    slot: int
    shard: int
    index: int
    parts: Mapping[str, memoryview]
    label: int | None
    image: tuple[str, memoryview] | None
    padded: bool
    position: int


@dataclass
class PlannedBatch:
    """The samples of one planned batch that could be read, and those skipped.

    Classification batches are kept as columns (`slots`, `labels`, `images`: no object per
    sample, which the garbage collector would walk), other batches as `rows`; `samples` gives
    either as `RowSample`s.

    Attributes:
        number: the batch's number in the plan.
        refs: (shard, index in shard) of every planned sample, by slot.
        positions: every planned sample's position in the epoch order, by slot.
        padded: every planned sample's evaluation-padding flag, by slot.
        slots, labels, images: classification: the readable samples' slots, labels and
            (component, bytes) images, in plan order.
        rows: other splits: one tuple per readable sample, fields as in `RowSample`.
        skips: the samples skipped under on_error='skip'.
    """

    number: int
    refs: list[list[int]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    padded: list[bool] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    images: list[tuple[str, memoryview]] = field(default_factory=list)
    rows: list[tuple] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)

    @property
    def samples(self) -> list[RowSample]:
        """The readable samples as `RowSample`s (classification: without their `parts`)."""
        if self.rows:
            return [RowSample._make(row) for row in self.rows]
        return [
            RowSample(
                slot, *self.refs[slot], {}, label, image, self.padded[slot], self.positions[slot]
            )
            for slot, label, image in zip(self.slots, self.labels, self.images, strict=True)
        ]


class RowReader:
    """Reads planned batches of one split with one `on_error` policy.

    Args:
        reader: an open `ShardReader` of the split (the caller closes it).
        shard_sizes: samples per shard (`LoaderSpec.shard_sizes`).
        train: a training loader (no padding marks).
        on_error: "raise" or "skip".
        classification: read the label and image component (True), or keep every component
            for field-by-field decoding (False: `fastdata.read.decoders.dict_batch`).
    """

    def __init__(
        self,
        reader: ShardReader,
        shard_sizes: tuple[int, ...],
        *,
        train: bool,
        on_error: str = "raise",
        classification: bool = True,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.reader, self.shard_sizes = reader, shard_sizes
        self.train, self.on_error, self.classification = train, on_error, classification

    def read(self, plan: EpochPlan, number: int) -> PlannedBatch:
        """Batch `number` of `plan`: its readable samples in plan order, and its skips.

        Raises:
            ShardReadError: a sample cannot be read and on_error is "raise" (names shard, key).
        """
        refs = rows_to_refs(plan.rows[number], self.shard_sizes).tolist()
        n = len(refs)
        pads = [False] * n if self.train else plan.padding[number].tolist()
        batch = PlannedBatch(number, refs, plan.positions[number].tolist(), pads)
        if not self.classification:
            for slot, (shard, index) in enumerate(refs):
                try:
                    parts = self.reader.sample(shard, index)
                except (ShardReadError, ValueError) as exc:
                    batch.skips.append(self.fail(shard, index, exc))
                    continue
                batch.rows.append(
                    (slot, shard, index, parts, None, None, pads[slot], batch.positions[slot])
                )
            return batch
        slots, labels, images = batch.slots, batch.labels, batch.images
        reader = self.reader
        sample, key, entries = reader.sample, reader.key, reader.shards
        # `_read` inlined: this loop runs for every sample of every classification batch.
        for slot, (shard, index) in enumerate(refs):
            try:
                parts = sample(shard, index)
                label, _ = schema.label_and_id(key(shard, index), parts)
                label = PAD_LABEL if pads[slot] else entries[shard].map_label(label)
                image = schema.image_component(parts)
            except (ShardReadError, ValueError) as exc:
                batch.skips.append(self.fail(shard, index, exc))
                continue
            slots.append(slot)
            labels.append(label)
            images.append(image)
        return batch

    def sample(self, shard: int, index: int, padded: bool = False) -> RowSample:
        """One sample by (shard, index); raises ShardReadError or ValueError (unnamed)."""
        parts, label, image = self._read(shard, index, padded)
        return RowSample(0, shard, index, parts, label, image, padded, 0)

    def _read(
        self, shard: int, index: int, padded: bool
    ) -> tuple[Mapping[str, memoryview], int | None, tuple[str, memoryview] | None]:
        reader = self.reader
        parts = reader.sample(shard, index)
        if not self.classification:
            return parts, None, None
        label, _ = schema.label_and_id(reader.key(shard, index), parts)
        label = reader.shards[shard].map_label(label)  # a mix's merged classes
        image = schema.image_component(parts)
        return parts, PAD_LABEL if padded else label, image

    def error(
        self, shard: int, index: int, exc: Exception, field: str | None = None
    ) -> ShardReadError:
        """`exc` as a ShardReadError naming the shard, the key (and the field)."""
        if isinstance(exc, ShardReadError):
            return exc
        try:
            key = self.reader.key(shard, index)
        except Exception:  # noqa: BLE001 - the index itself is unreadable
            key = f"#{index}"
        reason = str(exc) if field is None else f"field {field!r}: {exc}"
        return ShardReadError(self.reader.shards[shard].name, key, reason)

    def fail(self, shard: int, index: int, exc: Exception, field: str | None = None) -> Skip:
        """The sample's error: raised under on_error='raise', else returned as a `Skip`.

        Raises:
            ShardReadError: on_error is "raise" (names shard and key, and `field` when given).
        """
        error = self.error(shard, index, exc, field)
        if self.on_error != "skip":
            raise error from exc
        name = self.reader.shards[shard].name
        key = error.key if error.key is not None else _key_or_index(self.reader, shard, index)
        reason = str(exc) if field is None else f"field {field!r}: {exc}"
        return Skip(name, key, reason, getattr(exc, "shard_failed", False))


def _key_or_index(reader: ShardReader, shard: int, index: int) -> str:
    try:
        return reader.key(shard, index)
    except Exception:  # noqa: BLE001 - the index itself is unreadable
        return f"#{index}"


def log_skips(skips: list[Skip], warned: set[str], keys: set[str] | None = None) -> None:
    """Log skipped samples once per key, a failed shard once per shard.

    Args:
        skips: the skips of a batch.
        warned: shards already warned about (noted here).
        keys: samples already logged (noted here); None: `warned` holds them too.
    """
    keys = warned if keys is None else keys
    for skip in skips:
        if skip.shard_failed:  # a remote shard that failed to download: warned once
            if skip.shard not in warned:
                warned.add(skip.shard)
                log.warning("skipped shard %s (on_error='skip'): %s", skip.shard, skip.reason)
            continue
        tag = f"{skip.shard}\0{skip.key}"
        if tag in keys:
            continue
        keys.add(tag)
        log.warning(
            "skipped bad sample %s in %s (on_error='skip'): %s", skip.key, skip.shard, skip.reason
        )
