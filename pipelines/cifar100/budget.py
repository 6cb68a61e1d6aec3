"""Fitting a training run into a wall-time budget: measure, plan the steps, fit the LR schedule.

``--budget SECONDS`` (the pipeline's default, 300 s) replaces a fixed epoch count:

1. The first optimizer steps of epoch 1 run under a provisional one-cycle schedule (over
   `PROVISIONAL_EPOCHS` epochs); after `BudgetPlanner.skip_steps` warm-up steps it times
   `BudgetPlanner.measure_steps` steps (wall time per step, data wait included). These steps are
   part of the run: nothing is thrown away.
2. `plan_steps` turns the measured img/s, the time one evaluation costs (estimated from the
   training throughput until the first one is timed) and the time left until the deadline (the
   budget counted from the process start, so sharding and start-up are included) into a total
   number of optimizer steps: as many as fit, one evaluation per epoch end and one after the last
   (possibly partial) epoch, or only the final one (``eval_each_epoch=False``). A last partial
   epoch shorter than `MIN_PARTIAL_EPOCH` of an epoch is dropped when it would pay a whole
   evaluation.
3. `pipelines.cifar100.schedule.PlannedSchedule.refit` re-draws the rest of the LR schedule from
   the current step and LR: linear warm-up to the peak at `warmup` of the planned steps, then
   linear decay to the end value at the last planned step, so the LR reaches its end value
   whatever the plan.
4. The plan is re-made every `BudgetPlanner.replan_every` steps and at each epoch end with the
   throughput and evaluation time measured since (the latest epoch's figures), so a machine that
   slows down (or speeds up) mid-run still ends on time with a fully decayed LR; training stops
   (``trainer.should_stop``) at the planned step, mid-epoch if need be, and Lightning then runs the
   last evaluation.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl

__all__ = [
    "MIN_PARTIAL_EPOCH",
    "NO_EPOCH_EVAL",
    "PROVISIONAL_EPOCHS",
    "BudgetPlanner",
    "Plan",
    "plan_steps",
]

log = logging.getLogger("fastdata")

#: Epochs the schedule spans before the first plan (only its first steps run under it).
PROVISIONAL_EPOCHS = 4
#: A last partial epoch shorter than this fraction of an epoch is not started (a few steps would
#: pay a whole evaluation and print a row for nothing; longer ones use time that would be lost).
MIN_PARTIAL_EPOCH = 0.1
#: ``check_val_every_n_epoch`` that turns the per-epoch evaluation off (``eval_each_epoch=False``).
NO_EPOCH_EVAL = 1_000_000
#: Evaluation img/s (each view one forward pass) as a multiple of training img/s (forward and
#: backward), used until the first evaluation is timed. A forward pass costs about a third of a
#: training step; 2.5 leaves a margin (measured here: 3.1 and 3.5 with flip TTA, 2 views per
#: image, ResNet-9 width 24).
EVAL_SPEEDUP = 2.5


# ----------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class Plan:
    """What a budget allows, from the figures measured so far.

    Attributes:
        total_steps: optimizer steps of the whole run (those done included).
        steps_done: optimizer steps done when the plan was made.
        steps_per_epoch: optimizer steps of a full epoch.
        img_per_s: training throughput the plan assumes (samples per second, all ranks).
        eval_s: time the plan allows per evaluation (epoch-end overhead included).
        evals: evaluations still to run.
        time_left_s: seconds left until the deadline when the plan was made.
        train_s: planned seconds of training from now.
        reserve_s: seconds kept for the end of the run (metrics, shut-down).
        reason: one line on what limited the plan.
    """

    total_steps: int
    steps_done: int
    steps_per_epoch: int
    img_per_s: float
    eval_s: float
    evals: int
    time_left_s: float
    train_s: float
    reserve_s: float
    reason: str

    @property
    def epochs(self) -> float:
        """Planned epochs, the last possibly partial (`total_steps` / `steps_per_epoch`)."""
        return self.total_steps / self.steps_per_epoch

    @property
    def eval_total_s(self) -> float:
        """Seconds kept for the evaluations still to run."""
        return self.evals * self.eval_s

    def as_dict(self) -> dict[str, Any]:
        """The plan's fields and `epochs`, for metrics.json."""
        return {**asdict(self), "epochs": self.epochs}

    def describe(self) -> str:
        """One line: epochs, steps, the measured figures and the time kept for evaluation."""
        return (
            f"plan: {self.epochs:.2f} epochs = {self.total_steps:,} steps "
            f"({self.total_steps - self.steps_done:,} to go, {self.train_s:.0f} s at "
            f"{self.img_per_s:,.0f} img/s) + {self.evals} eval x {self.eval_s:.1f} s "
            f"+ {self.reserve_s:.0f} s reserve, {self.time_left_s:.0f} s left; {self.reason}"
        )


def _evals(steps_done: int, end: int, steps_per_epoch: int, each_epoch: bool) -> int:
    """Evaluations between `steps_done` and `end`: each epoch end reached, and the last partial
    epoch's (at an epoch boundary `steps_done` counts that epoch's evaluation as done); or only
    the final one."""
    if not each_epoch:
        return 1
    return max(0, math.ceil(end / steps_per_epoch) - steps_done // steps_per_epoch)


def plan_steps(
    *,
    time_left_s: float,
    img_per_s: float,
    batch_size: int,
    steps_per_epoch: int,
    steps_done: int,
    eval_s: float,
    reserve_s: float = 0.0,
    min_partial: float = MIN_PARTIAL_EPOCH,
    eval_each_epoch: bool = True,
) -> Plan:
    """The most optimizer steps whose training and evaluations fit in `time_left_s`.

    Cost of stopping at step ``end``: ``(end - steps_done) * batch_size / img_per_s`` of training,
    plus `eval_s` for each evaluation still to run (every epoch end up to ``end``, and one for a
    last partial epoch), plus `reserve_s`. The largest ``end`` within `time_left_s` is kept, except
    that a last partial epoch of fewer than ``min_partial * steps_per_epoch`` steps is dropped
    (when the run is not already inside it, and evaluations run at each epoch end). With no time
    left the plan is to stop now.

    Args:
        time_left_s: seconds until the deadline.
        img_per_s: measured training samples per second (all ranks).
        batch_size: samples per optimizer step (all ranks).
        steps_per_epoch: optimizer steps of one epoch.
        steps_done: optimizer steps already done.
        eval_s: seconds per evaluation (with the epoch-end overhead).
        reserve_s: seconds to keep for the end of the run.
        min_partial: shortest last partial epoch worth starting, as a fraction of an epoch.
        eval_each_epoch: an evaluation ends every epoch; False: only the final one runs.

    Raises:
        ValueError: a non-positive throughput, batch size or epoch length, or negative counts.
    """
    if img_per_s <= 0 or batch_size <= 0 or steps_per_epoch <= 0:
        raise ValueError(
            f"plan_steps needs img_per_s, batch_size and steps_per_epoch > 0, got {img_per_s}, "
            f"{batch_size}, {steps_per_epoch}"
        )
    if steps_done < 0 or eval_s < 0 or reserve_s < 0:
        raise ValueError(
            f"plan_steps needs steps_done, eval_s, reserve_s >= 0, got {steps_done}, {eval_s}, "
            f"{reserve_s}"
        )
    step_s = batch_size / img_per_s

    def cost(end: int) -> float:
        return (
            (end - steps_done) * step_s
            + _evals(steps_done, end, steps_per_epoch, eval_each_epoch) * eval_s
            + reserve_s
        )

    # cost() grows with end: bisect for the largest end that fits.
    low, high = steps_done, steps_done + max(0, int(time_left_s / step_s)) + 1
    while low < high:
        mid = (low + high + 1) // 2
        if cost(mid) <= time_left_s:
            low = mid
        else:
            high = mid - 1
    end = low
    reason = "as many steps as fit"
    if end == steps_done:
        reason = "no time left for another step: stop now"
    partial = end % steps_per_epoch
    boundary = end - partial
    short = eval_each_epoch and partial and partial < min_partial * steps_per_epoch
    if short and boundary > steps_done:
        end = boundary
        reason = f"last partial epoch of {partial} steps (< {min_partial:.0%} of an epoch) dropped"
    return Plan(
        total_steps=end,
        steps_done=steps_done,
        steps_per_epoch=steps_per_epoch,
        img_per_s=img_per_s,
        eval_s=eval_s,
        evals=_evals(steps_done, end, steps_per_epoch, eval_each_epoch),
        time_left_s=time_left_s,
        train_s=(end - steps_done) * step_s,
        reserve_s=reserve_s,
        reason=reason,
    )


# ----------------------------------------------------------------------------- callback
class BudgetPlanner(pl.Callback):
    """Measures the run, plans its steps within the budget, re-fits the LR and stops on time.

    The LightningModule must expose its `PlannedSchedule` as ``pl_module.lr_schedule`` (stepped
    once per optimizer step). `plans` keeps every plan made (for metrics.json), `plan` the latest.

    Throughput is timed per epoch, from its `skip_steps`-th step on (the loader's and the kernels'
    warm-up left out). The evaluation cost is estimated from the training throughput (a forward
    pass per view at `eval_speedup` times the training img/s) until timed; then it is the gap
    between an epoch's last step and the next epoch's first one (evaluation, checkpoint, loader
    restart) less one step.

    With ``eval_each_epoch=False`` only the final step is evaluated: make the Trainer with
    ``check_val_every_n_epoch`` larger than any run (`NO_EPOCH_EVAL`); the planner sets it to 1
    when it stops the run, so Lightning evaluates at that step. That evaluation is never timed
    before it runs: the plan keeps the estimate for it.

    Args:
        budget_s: seconds from `started` (a `time.monotonic` value) to the end of the run.
        started: when the budget started (the process start).
        skip_steps: steps of each epoch not timed (at most a quarter of an epoch).
        measure_steps: steps timed before the first plan (at most half of the rest of an epoch).
        replan_every: steps between re-plans inside an epoch.
        reserve_s: seconds kept for the end of the run (metrics, shut-down).
        eval_speedup: evaluation img/s per view over training img/s, until an evaluation is timed.
        eval_each_epoch: evaluations at each epoch end (True) or after the last step only.

    Raises:
        ValueError: a budget that is not positive.
    """

    def __init__(
        self,
        budget_s: float,
        started: float,
        skip_steps: int = 5,
        measure_steps: int = 25,
        replan_every: int = 50,
        reserve_s: float = 5.0,
        eval_speedup: float = EVAL_SPEEDUP,
        eval_each_epoch: bool = True,
    ) -> None:
        if budget_s <= 0:
            raise ValueError(f"the budget must be > 0 seconds, got {budget_s}")
        self.budget_s, self.deadline = budget_s, started + budget_s
        self.skip_steps, self.measure_steps = skip_steps, measure_steps
        self.replan_every, self.reserve_s, self.eval_speedup = replan_every, reserve_s, eval_speedup
        self.eval_each_epoch = eval_each_epoch
        self.steps_run = 0  # optimizer steps done (the global step)
        self.plan: Plan | None = None
        self.plans: list[dict[str, Any]] = []
        self.img_per_s: float | None = None  # the latest measured training throughput
        self.eval_s: float | None = None  # the latest measured evaluation + epoch turnover
        self._steps_per_epoch = self._batch = self._views = 1
        self._val_samples = 0
        self._mark: tuple[int, float] | None = None  # (step, time) this epoch's timing starts at
        self._epoch_start_step = 0
        self._last_step_end: float | None = None
        self._val_t0 = self._val_s = 0.0
        self._stopping = False  # the planner set trainer.should_stop
        self._evaluated = False  # the last epoch ended with an evaluation

    def time_left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - time.monotonic()

    def summary(self) -> dict[str, Any]:
        """The budget, the measured figures and every plan, for metrics.json."""
        return {
            "budget_s": self.budget_s,
            "measured_img_per_s": self.img_per_s,
            "measured_eval_s": self.eval_s,
            "planned_epochs": None if self.plan is None else self.plan.epochs,
            "planned_steps": None if self.plan is None else self.plan.total_steps,
            "steps_run": self.steps_run,
            "plans": self.plans,
        }

    # -- planning
    def _replan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        assert self.img_per_s is not None
        step = trainer.global_step
        eval_s = self.eval_s
        if eval_s is None:
            eval_s = self._val_samples * self._views / (self.eval_speedup * self.img_per_s)
        plan = plan_steps(
            time_left_s=self.time_left(),
            img_per_s=self.img_per_s,
            batch_size=self._batch,
            steps_per_epoch=self._steps_per_epoch,
            steps_done=step,
            eval_s=eval_s,
            reserve_s=self.reserve_s,
            eval_each_epoch=self.eval_each_epoch,
        )
        if trainer.world_size > 1:  # ranks start at different times: all follow rank 0's plan
            plan = trainer.strategy.broadcast(plan, src=0)
        if self.plan is None or plan.total_steps != self.plan.total_steps:
            pl_module.lr_schedule.refit(step, plan.total_steps)
        first, self.plan = self.plan is None, plan
        self.plans.append({"when": when, **plan.as_dict()})
        if first and trainer.is_global_zero:
            print(f"budget {self.budget_s:.0f} s, {when}: {plan.describe()}", flush=True)
            if plan.total_steps == step:
                log.warning(
                    "the --budget of %.0f s is spent before training could run (start-up, "
                    "sharding and %d measuring steps took %.0f s): the run stops now; give a "
                    "larger --budget, or --epochs N for a fixed length",
                    self.budget_s,
                    step,
                    self.budget_s - plan.time_left_s,
                )
        else:
            log.debug("budget re-plan (%s): %s", when, plan.describe())
        self._stop_if_done(trainer)

    def _stop_if_done(self, trainer: pl.Trainer) -> None:
        """Stop at the planned step; a later plan with more steps lifts the planner's own stop."""
        if self.plan is not None and trainer.global_step >= self.plan.total_steps:
            trainer.should_stop = self._stopping = True
        elif self._stopping:
            trainer.should_stop = self._stopping = False
        if not self.eval_each_epoch:  # Lightning evaluates the step it stops at
            trainer.check_val_every_n_epoch = 1 if self._stopping else NO_EPOCH_EVAL

    # -- hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        accumulate = max(1, int(trainer.accumulate_grad_batches))
        self._steps_per_epoch = max(1, int(trainer.num_training_batches) // accumulate)
        per_rank = int(trainer.datamodule.batch_size)
        self._batch = per_rank * accumulate * trainer.world_size
        self._views = 2 if getattr(pl_module, "tta", False) else 1
        self._val_samples = _val_samples(trainer, per_rank)
        self.skip_steps = min(self.skip_steps, self._steps_per_epoch // 4)
        self.measure_steps = max(
            1, min(self.measure_steps, (self._steps_per_epoch - self.skip_steps) // 2)
        )
        if trainer.global_step == 0:  # a resumed run keeps its checkpointed schedule
            pl_module.lr_schedule.refit(0, self._steps_per_epoch * PROVISIONAL_EPOCHS)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start_step = trainer.global_step
        self._mark = (trainer.global_step, time.monotonic()) if self.skip_steps == 0 else None
        self._val_s = 0.0

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        now, step = time.monotonic(), trainer.global_step
        self.steps_run = step
        in_epoch = step - self._epoch_start_step
        if in_epoch == 1 and self._evaluated and self._last_step_end is not None and self.img_per_s:
            gap = now - self._last_step_end - self._batch / self.img_per_s
            self.eval_s = max(gap, 0.0)
        self._last_step_end = now
        if self._mark is None and in_epoch >= self.skip_steps:
            self._mark = (step, now)
        elif self._mark is not None and batch_idx + 1 < trainer.num_training_batches:
            timed = step - self._mark[0]
            if (self.plan is None and timed >= self.measure_steps) or (
                self.plan is not None and timed > 0 and timed % self.replan_every == 0
            ):
                self.img_per_s = timed * self._batch / max(now - self._mark[1], 1e-9)
                self._replan(trainer, pl_module, f"step {step}")
        self._stop_if_done(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_t0 = time.monotonic()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_s += time.monotonic() - self._val_t0

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluated = self._val_s > 0
        if self._val_s:  # this epoch's evaluation; the turnover after it is not known yet
            self.eval_s = max(self.eval_s or 0.0, self._val_s)
        if self._mark is not None and self._last_step_end is not None:
            timed = trainer.global_step - self._mark[0]
            if timed > 0:  # this epoch's training steps, its evaluation left out
                self.img_per_s = (
                    timed * self._batch / max(self._last_step_end - self._mark[1], 1e-9)
                )
        cut_short = trainer.global_step - self._epoch_start_step < self._steps_per_epoch
        if self._stopping and (cut_short or not self.eval_each_epoch):
            # Lightning has evaluated the step the planner stopped at, an evaluation that would
            # not have run otherwise: the stop is final (going on would pay another one).
            return
        if self.img_per_s is not None:
            self._replan(trainer, pl_module, f"end of epoch {trainer.current_epoch + 1}")


def _val_samples(trainer: pl.Trainer, batch_size: int) -> int:
    """Samples one evaluation runs over all ranks (from the DataModule's manifest, with
    ``limit_val_batches``); 0 when the DataModule does not say."""
    dm = trainer.datamodule
    try:
        samples = dm.manifest.splits[dm.split_names["val"]].num_samples
    except (AttributeError, KeyError):
        return 0
    limit = trainer.limit_val_batches
    if isinstance(limit, int):
        return min(samples, limit * batch_size * trainer.world_size)
    return int(samples * (1.0 if limit is None else limit))
