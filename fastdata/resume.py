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
from dataclasses import asdict, dataclass
from typing import Any

from fastdata.manifest import Manifest

__all__ = ["STATE_VERSION", "ResumeError", "ResumeState", "dataset_fingerprint"]

STATE_VERSION = 2


class ResumeError(ValueError):
    """A saved data position that this DataModule cannot continue from."""


def dataset_fingerprint(manifest: Manifest, split: str) -> str:
    """A short hash of the split's shards (their sha256s and sizes, in manifest order)."""
    shards = manifest.split(split).shards
    text = ";".join(f"{s.name}:{s.num_samples}:{s.sha256}" for s in shards)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    """

    epoch: int
    consumed: int
    steps: int
    seed: int
    world_size: int
    batch_size: int
    num_samples: int
    dataset: str

    def to_dict(self) -> dict[str, Any]:
        """The checkpointable form (plain ints and strings, with a version)."""
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> ResumeState:
        """Parse a `to_dict` result; ResumeError for an older or malformed state."""
        if state.get("version") != STATE_VERSION:
            raise ResumeError(
                f"this data position was saved by an older fastdata ({sorted(state)}): it records "
                "batches, not the samples consumed, so it cannot be mapped onto the epoch plan "
                "exactly; resume from an end-of-epoch checkpoint, or drop the checkpoint's "
                "'datamodule' entry to restart the epoch"
            )
        fields = cls.__dataclass_fields__
        try:
            values = {name: state[name] for name in fields}
        except KeyError as exc:
            raise ResumeError(f"data position {state} lacks {exc}") from exc
        return cls(**{k: (str(v) if k == "dataset" else int(v)) for k, v in values.items()})

    def check(self, seed: int, num_samples: int, dataset: str) -> None:
        """ResumeError unless this state belongs to the same dataset and seed."""
        if self.dataset != dataset or self.num_samples != num_samples:
            raise ResumeError(
                f"the checkpoint's data position belongs to another dataset (fingerprint "
                f"{self.dataset}, {self.num_samples} samples; this one: {dataset}, {num_samples}): "
                "resume with the shard folder it was trained on"
            )
        if self.seed != seed:
            raise ResumeError(
                f"the checkpoint's data position was taken with seed={self.seed}, this DataModule "
                f"has seed={seed}: the epoch order differs, so the consumed samples cannot be "
                f"skipped; pass seed={self.seed}"
            )
        if not 0 <= self.consumed <= self.num_samples:
            raise ResumeError(f"consumed={self.consumed} outside [0, {self.num_samples}]")
