"""The resume state of a training epoch: what `ShardDataModule.state_dict()` records.

Resumption counts *global* samples (MosaicML Streaming's lesson): the epoch plan
(`fastdata.read.plan`, rule 2) consumes its order from the front, so "the first `consumed`
samples of epoch `epoch`" names the same samples whatever world size or batch size took them.
A state taken on 2 ranks x batch 10 therefore resumes on 1 rank x batch 20 (or the reverse) with
exactly the samples not yet consumed. A state that cannot be honoured (another dataset, another
seed, another split size) is refused with the reason, never silently remapped.
"""

from __future__ import annotations

import hashlib
import numbers
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from fastdata.format.manifest import Manifest

__all__ = [
    "STATE_VERSION",
    "ResumeError",
    "ResumeState",
    "ScheduleState",
    "dataset_fingerprint",
    "mix_description",
]

STATE_VERSION = 2

# The least each integer field may be (a state from a checkpoint is untrusted input).
_MINIMUM = {
    "epoch": 0,
    "consumed": 0,
    "steps": 0,
    "seed": 0,
    "world_size": 1,
    "batch_size": 1,
    "num_samples": 0,
}
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
_SHUFFLE = re.compile(r"shard|full|window:[1-9][0-9]*")


class ResumeError(ValueError):
    """A saved data position that this DataModule cannot continue from."""


def dataset_fingerprint(manifest: Manifest, split: str) -> str:
    """A short hash of the split's shards (their sha256s and sizes, in manifest order).

    A mix (`fastdata.read.mix`): a hash of each dataset's own fingerprint and weight, in mix
    order, and the epoch size, so a state from another mix or weighting does not match (and
    moving a dataset's folder does not matter). A scheduled weight (`fastdata.read.schedule`)
    counts as "scheduled": a resume may change a schedule (`ScheduleState`). A mix of videos
    read as clips (`fastdata.read.clips.clip_mix`) adds its clips per video: row r is clip
    ``r % N`` of video ``r // N``, so another N reads other clips.
    """
    if manifest.source.get("kind") == "mix":
        parts = [
            f"{d['fingerprints'][split]}*{_weight_text(d['weight'], repr)}"
            for d in manifest.source["datasets"]
        ]
        text = "mix;" + ";".join(parts) + f";{_mix_epoch_size(manifest, split)}"
        if "clips" in manifest.source:  # a mix of videos read as clips: rows are clips of N
            text += f";clips={manifest.source['clips']}"
    else:
        shards = manifest.split(split).shards
        text = ";".join(f"{s.name}:{s.num_samples}:{s.sha256}" for s in shards)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mix_description(manifest: Manifest, split: str) -> str:
    """How a training epoch of `split` is drawn, for messages: "" for one dataset, else the
    datasets' fingerprints, the weights and the epoch size (a schedule: "scheduled")."""
    if manifest.source.get("kind") != "mix":
        return ""
    datasets = manifest.source["datasets"]
    weights = "weights " + ":".join(_weight_text(d["weight"], lambda w: f"{w:g}") for d in datasets)
    if "scheduled" in weights:
        weights = "scheduled weights"
    prints = ", ".join(d["fingerprints"][split] for d in datasets)
    size = _mix_epoch_size(manifest, split)
    return f"{weights} over datasets {prints}, epoch size {size}"


def _weight_text(weight: object, text: Any) -> str:
    """A fixed weight as `text` makes it; any schedule or function as "scheduled"."""
    return text(weight) if isinstance(weight, (int, float)) else "scheduled"


def _mix_epoch_size(manifest: Manifest, split: str) -> int:
    """`epoch_samples`, else the sum of the datasets' sizes (`fastdata.read.mix.epoch_mix`)."""
    given = manifest.source.get("epoch_samples")
    return int(given or sum(d["samples"][split] for d in manifest.source["datasets"]))


@dataclass(frozen=True)
class ScheduleState:
    """What a resume state records of a scheduled mix (`fastdata.read.schedule`).

    Args:
        block: samples per block of the epoch order (plan rule 7): the per-rank batch size the
            run started with, kept by every resume so that the order stays the same.
        schedule: each dataset's weight as text (`fastdata.read.schedule.describe_weight`).
        taken: samples of the epoch consumed so far from each dataset, in mix order.
        splice: (position, taken at it) where a resume changed the schedule in this epoch;
            None: the epoch follows one schedule.
    """

    block: int
    schedule: str
    taken: tuple[int, ...]
    splice: tuple[int, tuple[int, ...]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain ints, lists and a string."""
        splice = None if self.splice is None else [self.splice[0], list(self.splice[1])]
        return {
            "block": self.block,
            "schedule": self.schedule,
            "taken": list(self.taken),
            "splice": splice,
        }

    @classmethod
    def from_dict(cls, value: Any, consumed: int) -> ScheduleState:
        """Parse a `to_dict` result of a state that consumed `consumed` samples.

        Raises:
            ResumeError: a malformed record, naming the field at fault.
        """
        if not isinstance(value, Mapping) or not isinstance(value.get("schedule"), str):
            raise ResumeError(f"data position field 'schedule' is malformed: {value!r}")
        block = value.get("block")
        if not _counts([block]) or block < 1:
            raise ResumeError(f"schedule field 'block' must be an integer >= 1, got {block!r}")
        taken, splice = value.get("taken"), value.get("splice")
        if not _counts(taken) or sum(taken) != consumed:
            raise ResumeError(
                f"schedule field 'taken' must be counts summing to 'consumed' ({consumed}), "
                f"got {taken!r}"
            )
        if splice is not None and not (
            isinstance(splice, (list, tuple))
            and len(splice) == 2
            and _counts([splice[0]])
            and _counts(splice[1])
            and len(splice[1]) == len(taken)
            and sum(splice[1]) == splice[0] <= consumed
        ):
            raise ResumeError(
                f"schedule field 'splice' must be [position <= {consumed}, counts summing to "
                f"it], got {splice!r}"
            )
        return cls(
            int(block),
            value["schedule"],
            tuple(int(n) for n in taken),
            None if splice is None else (int(splice[0]), tuple(int(n) for n in splice[1])),
        )


def _counts(values: Any) -> bool:
    """A list or tuple of integers >= 0 (not bools)."""
    return isinstance(values, (list, tuple)) and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0 for v in values
    )


@dataclass(frozen=True)
class ResumeState:
    """The position in the training epoch.

    Args:
        epoch: the epoch.
        consumed: samples of the epoch consumed by all ranks together (a prefix of its order).
        steps: batches each rank had taken in the epoch (Lightning's count of the epoch's steps).
        seed: the base seed (the epoch order depends on it).
        world_size: ranks when the state was taken (informative: any world size may resume).
        batch_size: per-rank batch size then (informative).
        num_samples: samples in the training split.
        dataset: `dataset_fingerprint` of the training split.
        mix: `mix_description` of the training split ("" for one dataset).
        shuffle: the training shuffle that made the epoch order (`fastdata.read.shuffle`):
            "shard", "full" or "window:N" with the window N in samples. A default window is
            sized from the node's free memory, so the resumed run must reuse this one to see
            the same order. "": not recorded (a state from before shuffles were chosen).
        schedule: a scheduled mix's record (`ScheduleState`); None for any other training split.
    """

    epoch: int
    consumed: int
    steps: int
    seed: int
    world_size: int
    batch_size: int
    num_samples: int
    dataset: str
    mix: str = ""
    shuffle: str = ""
    schedule: ScheduleState | None = None

    def to_dict(self) -> dict[str, Any]:
        """The checkpointable form (plain ints and strings, with a version)."""
        state = {"version": STATE_VERSION, **asdict(self)}
        state["schedule"] = self.schedule.to_dict() if self.schedule is not None else None
        if self.schedule is None:
            del state["schedule"]  # no scheduled mix: the same state as before schedules
        if not self.mix:
            del state["mix"]  # one dataset: the same state as before mixes existed
        if not self.shuffle:
            del state["shuffle"]
        return state

    @classmethod
    def from_dict(cls, state: Any) -> ResumeState:
        """Parse and validate a `to_dict` result.

        Every field is checked (type, range, consistency with the others); `check` then
        compares it with the dataset and seed.

        Raises:
            ResumeError: an older or malformed state, naming the field at fault.
        """
        if not isinstance(state, Mapping):
            raise ResumeError(
                f"the checkpoint's data position is a {type(state).__name__}, not the dict "
                "ShardDataModule.state_dict() returns: drop the checkpoint's 'ShardDataModule' "
                "entry to restart the epoch, or resume from a checkpoint Lightning wrote"
            )
        if state.get("version") != STATE_VERSION:
            raise ResumeError(
                f"this data position was saved by an older fastdata ({sorted(state)}): it records "
                "batches, not the samples consumed, so it cannot be mapped onto the epoch plan "
                "exactly; resume from an end-of-epoch checkpoint, or drop the checkpoint's "
                "'datamodule' entry to restart the epoch"
            )
        values: dict[str, Any] = {}
        for name, least in _MINIMUM.items():
            if name not in state:
                raise ResumeError(f"the data position lacks field {name!r} ({dict(state)})")
            value = state[name]
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ResumeError(f"data position field {name!r} must be an integer, got {value!r}")
            if value < least:
                raise ResumeError(f"data position field {name!r} must be >= {least}, got {value}")
            values[name] = int(value)
        for name, pattern, words in (
            ("dataset", _FINGERPRINT, "16 hex digits"),
            ("mix", None, "a string"),
            ("shuffle", _SHUFFLE, "'shard', 'full' or 'window:N'"),
        ):
            value = state.get(name) if name == "dataset" else state.get(name, "")
            optional = name == "shuffle" and value == ""  # not recorded: an older state
            if not isinstance(value, str) or (
                pattern is not None and not optional and not pattern.fullmatch(value)
            ):
                raise ResumeError(f"data position field {name!r} must be {words}, got {value!r}")
            values[name] = value
        if state.get("schedule") is not None:
            values["schedule"] = ScheduleState.from_dict(state["schedule"], values["consumed"])
        result = cls(**values)  # no "mix": one dataset
        result._check_consistent()
        return result

    def _check_consistent(self) -> None:
        """The fields agree with each other (ResumeError naming the one that does not)."""
        if self.consumed > self.num_samples:
            raise ResumeError(
                f"data position field 'consumed' ({self.consumed}) exceeds 'num_samples' "
                f"({self.num_samples})"
            )
        # A step (all ranks together) consumes at least one new sample of the epoch, whatever the
        # world size and batch size; a run resumed from a checkpoint without a data position
        # restarts the epoch's samples after counting its earlier steps (`restored_steps`), so
        # steps can exceed consumed, but never two epochs' worth: that bounds len() as well.
        if self.steps > 2 * self.num_samples:
            raise ResumeError(
                f"data position field 'steps' ({self.steps}) exceeds twice 'num_samples' "
                f"({self.num_samples}): no epoch of this dataset has that many steps"
            )

    def check(self, seed: int, num_samples: int, dataset: str, mix: str = "") -> None:
        """ResumeError unless this state belongs to the same dataset (or mix) and seed.

        Args:
            seed: this DataModule's seed.
            num_samples: samples in its training epoch.
            dataset: `dataset_fingerprint` of its training split.
            mix: `mix_description` of its training split ("" for one dataset).
        """
        if self.mix != mix:
            raise ResumeError(
                f"the checkpoint's data position was taken on "
                f"{_mix_words(self.mix)}; this DataModule reads {_mix_words(mix)}: the epoch's "
                "selection of samples differs, so the consumed ones cannot be skipped; resume "
                "with the same roots, weights and epoch_samples"
            )
        if self.dataset != dataset or self.num_samples != num_samples:
            same = (
                " (the same shards, read as another number of samples: another val= carve or, "
                "for video, another ClipSampling.clips)"
                if self.dataset == dataset
                else ""
            )
            raise ResumeError(
                f"the checkpoint's data position belongs to another dataset or val= carve "
                f"(fingerprint {self.dataset}, {self.num_samples} samples; this one: {dataset}, "
                f"{num_samples}){same}: resume with the shard folder and the val= (and clips) it "
                "was trained with"
            )
        if self.seed != seed:
            raise ResumeError(
                f"the checkpoint's data position was taken with seed={self.seed}, this DataModule "
                f"has seed={seed}: the epoch order differs, so the consumed samples cannot be "
                f"skipped; pass seed={self.seed}"
            )
        self._check_consistent()

    def resumed_window(self, mode: str, window: int | None) -> int | None:
        """The window the resumed run must use: the recorded one (a default window depends on
        the node's free memory, so it is not sized again); `window` if none is recorded.

        Args:
            mode: the resuming DataModule's shuffle ("window", "shard", "full").
            window: its given window (None: sized from the node).

        Raises:
            ResumeError: the state was taken with another shuffle or another given window.
        """
        if not self.shuffle:
            return window
        recorded_mode, _, size = self.shuffle.partition(":")
        recorded = int(size) if size else None
        if recorded_mode != mode or (window is not None and recorded != window):
            own = window if window is not None else mode
            raise ResumeError(
                f"the checkpoint's data position was taken with shuffle {self.shuffle!r}, this "
                f"DataModule has shuffle={own!r}: the epoch order differs, so the consumed "
                f"samples cannot be skipped; pass shuffle={recorded or recorded_mode!r}"
            )
        return recorded


def _mix_words(mix: str) -> str:
    return f"a mix ({mix})" if mix else "a single dataset"
