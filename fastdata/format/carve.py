"""Carving a validation split out of a training split: a seeded share of its rows set aside.

`ShardDataModule(val=0.1)` validates on a tenth of the training split's samples and never trains
on them. The carve names rows (`fastdata.read.plan`: a sample's position in the split with the
shards laid end to end in manifest order), chosen by a permutation seeded with the carve seed
alone, so it depends on neither rank, world size, batch size nor epoch: every rank and every run
of the same shard folder carves the same rows. A smaller fraction carves a subset of a larger
one's rows (both take a prefix of the same permutation).

The epoch plan applies the carve (`PlanConfig.carve`) to the split's epoch order, so every
backend (cpu, memory, dali, nvjpeg), which all consume the plan, honours it: the training side
keeps the other rows in its usual shard-local shuffled order, the val side reads its rows in row
order. `carve_ids` is the same choice over a source's sample ids, for `fastdata shard
--val-fraction` (a val split written at shard time).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

__all__ = ["Carve", "carve_fingerprint", "carve_ids", "carved_count", "check_fraction"]

_STREAM = 0xCA4E  # the permutation's stream tag (independent of the plan's draws)


def check_fraction(fraction: object, what: str = "val") -> float:
    """`fraction` as a float in (0, 1), or a ValueError naming `what`."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise ValueError(f"{what} must be a float in (0, 1), got {fraction!r}")
    if not 0.0 < float(fraction) < 1.0:
        raise ValueError(
            f"{what}={fraction!r}: a carved fraction must be in (0, 1), e.g. 0.1 for a tenth"
        )
    return float(fraction)


def carved_count(total: int, fraction: float) -> int:
    """Rows carved from `total`: round(total * fraction), at least 1 and at most total - 1.

    Raises:
        ValueError: fewer than 2 rows (nothing could stay on each side).
    """
    if total < 2:
        raise ValueError(f"cannot carve a val split out of {total} sample(s): need at least 2")
    return min(total - 1, max(1, round(total * fraction)))


@lru_cache(maxsize=8)
def _carved_mask(total: int, fraction: float, seed: int) -> np.ndarray:
    order = np.random.default_rng([seed, _STREAM]).permutation(total)
    mask = np.zeros(total, dtype=bool)
    mask[order[: carved_count(total, fraction)]] = True
    mask.flags.writeable = False  # shared by every plan of the process
    return mask


def carve_ids(total: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, carved): the ids in range(total) that stay, and those carved, each ascending."""
    mask = _carved_mask(total, check_fraction(fraction), seed)
    return np.flatnonzero(~mask), np.flatnonzero(mask)


@dataclass(frozen=True)
class Carve:
    """A seeded share of a split's rows set aside as a val split, and which side a loader reads.

    Attributes:
        fraction: the share carved, in (0, 1).
        seed: the carve's seed (the DataModule passes the manifest's shard seed: the carve is a
            property of the dataset, the same for every training seed).
        side: "train" (the rows not carved) or "val" (the carved rows).
    """

    fraction: float
    seed: int
    side: Literal["train", "val"] = "train"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fraction", check_fraction(self.fraction))
        if self.side not in ("train", "val"):
            raise ValueError(f"side must be 'train' or 'val', got {self.side!r}")

    def mask(self, total: int) -> np.ndarray:
        """bool (total,): True for the rows of this side (read-only, cached)."""
        carved = _carved_mask(total, self.fraction, self.seed)
        return carved if self.side == "val" else ~carved

    def count(self, total: int) -> int:
        """Rows of this side out of `total`."""
        carved = carved_count(total, self.fraction)
        return carved if self.side == "val" else total - carved

    def select(self, order: np.ndarray, total: int) -> np.ndarray:
        """The rows of `order` (rows of a `total`-row split) on this side, order kept."""
        return order[self.mask(total)[order]]

    def describe(self) -> str:
        """For fingerprints and messages, e.g. "val=0.1 (carve seed 0)"."""
        return f"val={self.fraction!r} (carve seed {self.seed})"


def carve_fingerprint(fingerprint: str, carve: Carve | None) -> str:
    """A split's `fastdata.read.resume.dataset_fingerprint`, changed by a carve (None: unchanged)."""
    if carve is None:
        return fingerprint
    text = f"{fingerprint};carve:{carve.fraction!r}:{carve.seed}:{carve.side}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
