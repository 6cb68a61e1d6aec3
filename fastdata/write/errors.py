"""The write side's errors, and the `max_bad` rule: how many bad inputs stop a run.

A run stops (no manifest) as soon as its skipped inputs are more than `max_bad` of all its
inputs: the samples of its plan plus the entries the source itself found unusable (a folder
source's unreadable folders and broken symlinks). The writer's workers share one count, so a
list of a million missing files stops after a tenth of them, with the first reasons.
"""

from __future__ import annotations

from typing import Any

from fastdata.write.results import ShardResult

__all__ = [
    "ShardingError",
    "TooManyBadSamplesError",
    "allowance",
    "check_bad",
    "too_many_message",
]

_SHOWN_REASONS = 10  # bad inputs named in a TooManyBadSamplesError


class ShardingError(RuntimeError):
    """Sharding stopped: a bad sample under `strict`, or an output folder that must not be touched."""


class TooManyBadSamplesError(ShardingError):
    """More than `ShardOptions.max_bad` of the inputs are bad: the run stopped, no manifest."""


def check_bad(results: list[ShardResult], total: int, max_bad: float) -> None:
    """Raise `TooManyBadSamplesError` when the skipped inputs of `results` are more than
    `max_bad` of the `total` inputs."""
    bad = [s for r in results for s in r.skipped]
    if len(bad) > allowance(max_bad, total):
        raise TooManyBadSamplesError(too_many_message(len(bad), total, max_bad, bad))


def allowance(max_bad: float, total: int) -> int:
    """Most bad inputs out of `total` under `max_bad` (one more is too many)."""
    return int(max_bad * total + 1e-9)


def too_many_message(bad: int, total: int, max_bad: float, reasons: list[Any]) -> str:
    """The message of a `TooManyBadSamplesError`, with the first (origin, reason) pairs."""
    shown = "\n".join(f"  {origin}: {reason}" for origin, reason in reasons[:_SHOWN_REASONS])
    more = f"\n  (first {_SHOWN_REASONS} shown)" if len(reasons) > _SHOWN_REASONS else ""
    return (
        f"stopped: {bad:,} of {total:,} inputs are bad, more than max_bad={max_bad:g} "
        f"({allowance(max_bad, total):,} allowed); no manifest written. Fix the input (or "
        f"raise --max-bad if these losses are expected). Reasons:\n{shown}{more}"
    )
