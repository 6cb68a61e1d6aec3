"""The training epoch's position (`EpochPosition`): where training is, as the epoch plan counts it.

One position serves every training loader a `ShardDataModule` makes
(`fastdata.lightning.epoch_loader`): a loader starts its epochs on it; the DataModule counts on it
the batches that reach the device, records it in `state_dict` (batches taken, hence the global
samples consumed, `EpochPlan.consumed_after`) and restores a checkpoint's into it.
"""

from __future__ import annotations

import logging

from fastdata.read import LoaderSpec
from fastdata.read.plan import EpochPlan, batch_seed
from fastdata.read.resume import ResumeState

__all__ = ["EpochPosition"]

log = logging.getLogger("fastdata")


class EpochPosition:
    """Where training is: the epoch, the batches each rank took, the plan, a pending resume.

    Args:
        seed: the DataModule's base seed (batch seeds outside a plan derive from it).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch, self.batches = 0, 0
        self.plan: EpochPlan | None = None
        self.resume: ResumeState | None = None
        self._manual_epoch = -1

    def start(
        self, spec: LoaderSpec, trainer_epoch: int | None, restored_steps: int = 0
    ) -> tuple[int, int, int]:
        """Begin a training epoch: (epoch, consumed, steps before) the backend must produce.

        Args:
            spec: the training loader's spec (its plan is kept for the batch seeds).
            trainer_epoch: the Trainer's current epoch; None without a Trainer (0, 1, 2, ...).
            restored_steps: batches of this epoch a Trainer restored from a checkpoint counts
                as taken. Without a data position for the epoch (a checkpoint lacking this
                DataModule's entry) the whole epoch runs after them, with a warning: its samples
                before the checkpoint are trained twice, none is skipped.
        """
        if trainer_epoch is None:
            self._manual_epoch += 1
            trainer_epoch = self._manual_epoch
        consumed = steps = 0
        if self.resume is not None and self.resume.epoch == trainer_epoch:
            consumed, steps = self.resume.consumed, self.resume.steps
        elif 0 < restored_steps < len(spec.plan(trainer_epoch)):
            log.warning(
                "the checkpoint resumes epoch %d after %d batches but holds no data position of "
                "the ShardDataModule (its entry is missing): the epoch restarts from its first "
                "sample, so the samples of those %d batches are trained twice and none is "
                "skipped. Checkpoints saved by Lightning with this DataModule hold the entry.",
                trainer_epoch,
                restored_steps,
                restored_steps,
            )
            steps = restored_steps
        if self.resume is not None and self.resume.epoch < trainer_epoch:
            _warn_unfinished(spec, self.resume, trainer_epoch)
        self.resume = None
        self.epoch, self.batches = trainer_epoch, steps
        self.plan = spec.plan(trainer_epoch, consumed, steps)
        return trainer_epoch, consumed, steps

    def restore(self, state: ResumeState) -> None:
        """Resume from `state` when its epoch next starts."""
        self.resume = state
        self.epoch, self.batches = state.epoch, state.steps
        # Without a Trainer epochs are counted here: the next one started is the saved one.
        self._manual_epoch = state.epoch - 1

    def pending_len(self, spec: LoaderSpec, restored_steps: int = 0) -> int | None:
        """len() of the training loader while a resume is pending (before the epoch starts).

        Without a data position but with `restored_steps` (see `start`) restored by a Trainer:
        those steps and a whole epoch after them.

        Lightning reads len() once per `fit` and keeps it for every later epoch, so this is the
        larger of the resumed epoch's batches (steps taken + remaining) and a whole epoch's:
        after a resume with another world size x batch size the resumed epoch's count may be
        smaller and would cut every later epoch short. A loader that ends before len() batches
        just ends Lightning's epoch there.
        """
        if not spec.train:
            return None
        if self.resume is None:
            whole = len(spec.plan(spec.epoch))
            return restored_steps + whole if 0 < restored_steps < whole else None
        state = self.resume
        resumed = len(spec.plan(state.epoch, state.consumed, state.steps))
        return max(resumed, len(spec.plan(state.epoch)))

    def next_batch_seed(self) -> int:
        """The augmentation seed of the next training batch (plan rule 5); counts the batch."""
        plan, number = self.plan, self.batches
        self.batches += 1
        if plan is not None and 0 <= number - plan.steps_before < len(plan.seeds):
            return plan.seeds[number - plan.steps_before]
        # A batch no plan covers (a loader iterated outside `EpochLoader`): the plan's own seed
        # derivation, at a position no planned batch starts at.
        return batch_seed(self.seed, self.epoch, -1 - number)

    def consumed(self) -> int:
        """Global samples of the epoch consumed so far (all ranks together)."""
        if self.plan is not None:
            return self.plan.consumed_after(self.batches - self.plan.steps_before)
        return self.resume.consumed if self.resume is not None else 0


def _warn_unfinished(spec: LoaderSpec, state: ResumeState, trainer_epoch: int) -> None:
    """Warn when a Trainer resumes at a later epoch than a restored position whose epoch still
    had batches left: those samples are never trained in that epoch."""
    left = len(spec.plan(state.epoch, state.consumed, state.steps)) - state.steps
    if left == 0:
        return  # a checkpoint of a finished epoch: the next one starts afresh, as it should
    log.warning(
        "the checkpoint holds the data position of epoch %d after %d of its samples, but the "
        "Trainer resumes at epoch %d: the %d batches left of epoch %d are not trained. "
        "Lightning counts a checkpoint saved at an epoch's end (on_train_epoch_end, e.g. Ray "
        "Train's RayTrainReportCallback) as a finished epoch even when max_steps ended it "
        "early; save mid-epoch checkpoints (ModelCheckpoint(every_n_train_steps=...), "
        "fastdata.lightning.ray.RayStepCheckpoint) to resume inside the epoch.",
        state.epoch,
        state.consumed,
        trainer_epoch,
        left,
        state.epoch,
    )
