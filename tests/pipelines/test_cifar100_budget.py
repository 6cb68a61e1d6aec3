"""The time budget: the step planner, the re-fittable LR schedule, and the planner in a Trainer.

Nothing here depends on the machine's speed: throughput is given to `plan_steps`, and the
Trainer tests run on a fake clock that each training step and evaluation advances by a set cost.
"""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipelines.cifar100 import budget as budget_module
from pipelines.cifar100.budget import BudgetPlanner, plan_steps
from pipelines.cifar100.schedule import PlannedSchedule


# ----------------------------------------------------------------------------- plan_steps
def _plan(**kwargs: float) -> budget_module.Plan:
    # 0.1 s a step (100 samples at 1000 img/s), 100 steps (10 s) an epoch, 2 s an evaluation.
    figures = {
        "img_per_s": 1000.0,
        "batch_size": 100,
        "steps_per_epoch": 100,
        "steps_done": 20,
        "eval_s": 2.0,
        "reserve_s": 3.0,
        **kwargs,
    }
    return plan_steps(**figures)  # type: ignore[arg-type]


def test_plan_takes_the_most_steps_whose_training_and_evals_fit() -> None:
    # (490 - 20) steps x 0.1 s + 5 evals x 2 s + 3 s = 60 s exactly; one more step would not fit.
    plan = _plan(time_left_s=60.0)

    assert plan.total_steps == 490
    assert plan.epochs == pytest.approx(4.9)
    assert plan.evals == 5  # four epoch ends and the last, partial epoch
    assert plan.train_s == pytest.approx(47.0)
    assert plan.train_s + plan.eval_total_s + plan.reserve_s <= 60.0
    assert _plan(time_left_s=60.09).total_steps == 490
    assert _plan(time_left_s=60.1).total_steps == 491


def test_plan_drops_a_last_partial_epoch_shorter_than_a_tenth() -> None:
    # 405 steps would fit (38.5 s + 5 evals + 3 s = 51.5 s), but the 5 steps of epoch 5 would
    # pay a whole evaluation: the plan stops at the end of epoch 4.
    plan = _plan(time_left_s=51.55)

    assert plan.total_steps == 400 and plan.evals == 4
    assert "dropped" in plan.reason
    assert _plan(time_left_s=51.55, min_partial=0.0).total_steps == 405
    assert _plan(time_left_s=52.05).total_steps == 410  # 10 steps: a tenth, kept


def test_plan_at_an_epoch_boundary_counts_that_epochs_eval_as_done() -> None:
    # At the end of epoch 2 its evaluation has run: one more epoch costs 10 s + 2 s.
    plan = _plan(steps_done=200, time_left_s=15.0)

    assert plan.total_steps == 300 and plan.evals == 1


def test_plan_inside_the_last_partial_epoch_keeps_it() -> None:
    # Already 5 steps into epoch 5: the drop rule never moves the end behind the steps done.
    plan = _plan(steps_done=405, time_left_s=5.5)

    assert plan.total_steps == 410 and plan.evals == 1


def test_plan_with_no_time_left_stops_now() -> None:
    plan = _plan(time_left_s=4.0)  # less than one evaluation and the reserve

    assert plan.total_steps == plan.steps_done == 20
    assert "stop now" in plan.reason


def test_a_faster_machine_gets_more_epochs_in_the_same_budget() -> None:
    slow = _plan(time_left_s=280.0)
    fast = _plan(time_left_s=280.0, img_per_s=3000.0, eval_s=2.0 / 3)

    assert fast.epochs > 2.5 * slow.epochs
    assert slow.describe().startswith(f"plan: {slow.epochs:.2f} epochs")


def test_plan_rejects_a_nonpositive_throughput() -> None:
    with pytest.raises(ValueError, match="img_per_s"):
        _plan(time_left_s=60.0, img_per_s=0.0)


# ----------------------------------------------------------------------------- PlannedSchedule
def _lrs(schedule: PlannedSchedule, steps: int, peak: float = 0.5) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_fixed_plan_matches_the_one_cycle_schedule_of_the_fixed_recipe() -> None:
    steps, peak = 400, 0.5
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=peak,
        total_steps=steps,
        pct_start=0.25,
        anneal_strategy="linear",
        div_factor=10.0,
        final_div_factor=100.0,
        cycle_momentum=False,
    )
    expected = []
    for _ in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        one_cycle.step()

    got = _lrs(PlannedSchedule(steps), steps, peak)

    assert got[0] == pytest.approx(0.05) and got[-1] == pytest.approx(5e-4)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 0.01 * peak


@pytest.mark.parametrize(("step", "total"), [(30, 1000), (30, 120), (500, 600), (500, 2000)])
def test_refit_is_continuous_and_ends_at_the_end_value(step: int, total: int) -> None:
    schedule = PlannedSchedule(400)
    before = schedule(step)

    schedule.refit(step, total)

    assert schedule(step) == pytest.approx(before)
    assert schedule(total - 1) == pytest.approx(1e-3)
    values = [schedule(s) for s in range(step, total)]
    peak_at = values.index(max(values))
    assert all(a <= b + 1e-12 for a, b in pairwise(values[: peak_at + 1]))
    assert all(a >= b - 1e-12 for a, b in pairwise(values[peak_at:]))
    if step < 0.25 * (total - 1):  # still warming up: it reaches the peak at 25% of the new plan
        assert schedule(round(0.25 * (total - 1))) == pytest.approx(1.0, abs=0.01)


def test_schedule_knots_travel_in_the_scheduler_state_dict() -> None:
    schedule = PlannedSchedule(400)
    schedule.refit(30, 900)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    state = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule).state_dict()

    fresh = PlannedSchedule(5)
    torch.optim.lr_scheduler.LambdaLR(optimizer, fresh).load_state_dict(state)

    assert fresh.total_steps == 900 and fresh.knots == schedule.knots


# ----------------------------------------------------------------------------- in a Trainer
class _Clock:
    """A fake `time.monotonic`: only the test's steps and evaluations move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Toy(pl.LightningModule):
    """A linear model whose training steps and evaluation batches cost fake seconds."""

    def __init__(self, clock: _Clock, step_s, eval_s: float) -> None:  # noqa: ANN001
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.clock, self.step_s, self.eval_s = clock, step_s, eval_s
        self.lr_schedule: PlannedSchedule | None = None
        self.lrs: list[float] = []
        self.evals_at: list[int] = []  # the optimizer step of each evaluation batch

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        self.clock.now += self.step_s(self.global_step)
        self.lrs.append(self.optimizers().param_groups[0]["lr"])
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.clock.now += self.eval_s
        self.evals_at.append(self.global_step)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        self.lr_schedule = PlannedSchedule(int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class _Data(pl.LightningDataModule):
    def __init__(self, n: int = 80, batch_size: int = 8, val_samples: int | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        if val_samples is not None:  # what the planner reads from a ShardDataModule
            split = SimpleNamespace(num_samples=val_samples)
            self.manifest = SimpleNamespace(splits={"test": split})
            self.split_names = {"val": "test"}
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size * 10)  # one batch


def _fit(
    monkeypatch: pytest.MonkeyPatch,
    step_s,  # noqa: ANN001
    budget_s: float,
    eval_each_epoch: bool = True,
    val_samples: int | None = None,
) -> tuple[_Toy, BudgetPlanner, _Clock]:
    clock = _Clock()
    monkeypatch.setattr(budget_module.time, "monotonic", clock)
    model = _Toy(clock, step_s, eval_s=0.5)
    planner = BudgetPlanner(
        budget_s, started=0.0, replan_every=3, reserve_s=1.0, eval_each_epoch=eval_each_epoch
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=10_000,
        check_val_every_n_epoch=1 if eval_each_epoch else budget_module.NO_EPOCH_EVAL,
        callbacks=[planner],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=_Data(val_samples=val_samples))
    return model, planner, clock


def test_planner_fills_the_budget_and_decays_the_lr_to_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 10 steps of 0.1 s an epoch, 0.5 s an evaluation: 1.5 s an epoch, 20 s of budget less 1 s
    # reserve: 12 epochs (18 s), then 0.5 s of steps (5) and an evaluation would overrun by 0.
    model, planner, clock = _fit(monkeypatch, lambda step: 0.1, budget_s=20.0)

    assert clock.now <= 20.0 - planner.reserve_s + 1e-6
    assert len(model.lrs) == planner.plan.total_steps >= 120
    assert clock.now >= 20.0 - planner.reserve_s - 1.5  # it used the budget: < one epoch left
    assert planner.img_per_s == pytest.approx(80.0)
    assert planner.eval_s == pytest.approx(0.5)
    assert model.lrs[-1] == pytest.approx(0.5e-3)  # the LR's end value at the last step
    assert max(model.lrs) == pytest.approx(0.5, rel=0.05)
    summary = planner.summary()
    assert summary["planned_steps"] == len(model.lrs) and summary["plans"][0]["when"] == "step 6"


def test_planner_ends_on_time_when_the_machine_slows_down(monkeypatch: pytest.MonkeyPatch) -> None:
    # After 40 steps each step costs three times as much: the plan shrinks, the LR still ends.
    model, planner, clock = _fit(monkeypatch, lambda step: 0.1 if step < 40 else 0.3, budget_s=20.0)

    assert clock.now <= 20.0 - planner.reserve_s + 1e-6
    first = planner.plans[0]["total_steps"]
    assert len(model.lrs) == planner.plan.total_steps < first
    assert model.lrs[-1] == pytest.approx(0.5e-3)
    assert planner.img_per_s == pytest.approx(8 / 0.3)


def test_without_epoch_evals_the_planner_evaluates_the_last_step_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    each, _, _ = _fit(monkeypatch, lambda step: 0.1, budget_s=20.0)
    model, planner, clock = _fit(
        monkeypatch, lambda step: 0.1, budget_s=20.0, eval_each_epoch=False
    )

    assert model.evals_at == [len(model.lrs)]  # one evaluation, after the last step
    assert clock.now <= 20.0
    assert len(model.lrs) == planner.plan.total_steps > len(each.lrs) + 40  # 12 evals' time
    assert model.lrs[-1] == pytest.approx(0.5e-3)
    assert all(plan["evals"] == 1 for plan in planner.plans)


def test_a_stop_that_was_evaluated_is_final(monkeypatch: pytest.MonkeyPatch) -> None:
    # The final evaluation is estimated at 1000 samples / (2.5 x 80 img/s) = 5 s but takes 0.5 s:
    # once it has run at the planned stop, the time it left over must not restart training
    # (that would pay a second evaluation and end on an unevaluated step).
    model, planner, clock = _fit(
        monkeypatch, lambda step: 0.1, budget_s=20.0, eval_each_epoch=False, val_samples=1000
    )

    assert model.evals_at == [len(model.lrs)]
    assert planner.plan.eval_s == pytest.approx(5.0)
    assert clock.now <= 20.0 - 5.0 + 0.5
    assert planner.summary()["steps_run"] == len(model.lrs) == planner.plan.total_steps
