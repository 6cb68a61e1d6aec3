"""A one-cycle learning-rate schedule over a step count that can be re-planned mid-run."""

from __future__ import annotations

__all__ = ["PlannedSchedule"]


class PlannedSchedule:
    """A one-cycle LR multiplier (for `torch.optim.lr_scheduler.LambdaLR`) over a step count that
    can be re-planned: linear rise from `start` to 1 over the first `warmup` of the steps, linear
    decay to `end` at the last step (``total_steps - 1``); `end` after it.

    `refit` keeps the schedule continuous: from the current step and multiplier it rises to the
    peak (if the new warm-up end is still ahead) and decays to `end` at the new last step. The
    knots are instance attributes, so LambdaLR's ``state_dict`` saves them in checkpoints.

    Args:
        total_steps: planned optimizer steps.
        warmup: fraction of the steps spent rising to the peak.
        start: multiplier at step 0 (OneCycleLR's ``1 / div_factor``).
        end: multiplier at the last step (``1 / (div_factor * final_div_factor)``).
    """

    def __init__(
        self, total_steps: int, warmup: float = 0.25, start: float = 0.1, end: float = 1e-3
    ) -> None:
        if not 0 <= warmup < 1:
            raise ValueError(f"warmup must be in [0, 1), got {warmup}")
        self.warmup, self.start, self.end = warmup, start, end
        self.total_steps = max(1, total_steps)
        self.knots: list[tuple[float, float]] = []
        self._draw(0, start)

    def _draw(self, step: int, value: float) -> None:
        last = self.total_steps - 1
        peak = self.warmup * last
        knots = [(float(step), value)]
        if step < peak:
            knots.append((peak, 1.0))
        if last > knots[-1][0]:
            knots.append((float(last), self.end))
        self.knots = knots

    def refit(self, step: int, total_steps: int) -> None:
        """Re-plan from optimizer step `step` (its multiplier kept) to end at `total_steps`."""
        value = self(step)
        self.total_steps = max(1, total_steps, step + 1)
        self._draw(step, value)

    def __call__(self, step: int) -> float:
        knots = self.knots
        if step <= knots[0][0]:
            return knots[0][1]
        for (x0, y0), (x1, y1) in zip(knots, knots[1:], strict=False):
            if step <= x1:
                return y0 + (y1 - y0) * (step - x0) / (x1 - x0)
        return self.end if len(knots) > 1 else knots[-1][1]
