"""What bounds a training step, from its stage times, and what to change: a pure function.

`StageTimer` (`fastdata.tune.stages`) measures, per training step: the data wait (the loader's
``next()``), the host-to-device copy (``transfer_batch_to_device``), the device augmentation
(``on_after_batch_transfer``), and from the cpu backend the seconds its maker (a loader worker,
or the training process with 0 workers) spent reading and decoding the batch. `bound` turns an
epoch's means into one line:

- the step's *data time* is wait + transfer + augment: the training loop's own time on input;
  above `threshold` of the step the step is **input-bound**, else **compute-bound**;
- the wait is split into read and decode in the proportion the batch makers spent on each
  (with workers, the wait is the part of their work the step did not hide);
- the stage with the largest share of the data time is named, with the change that shortens it:
  more workers (as many as make a batch per compute time: ceil((read + decode) / compute)) while
  cores are left, else a backend that decodes elsewhere (``nvjpeg``/``dali`` on a GPU, ``memory``
  on a CPU: decoded once); pinned memory for the copy; a lighter augmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["STAGES", "Bound", "StageFigures", "bound"]

#: The stages of a step's data time, in the order they happen.
STAGES = ("read", "decode", "wait", "transfer", "augment")


@dataclass(frozen=True)
class StageFigures:
    """One epoch's mean seconds per training step, by stage.

    Args:
        epoch: the epoch.
        step_s: interval between two training steps' starts.
        wait_s: data wait (the loader's ``next()``).
        transfer_s: host-to-device copy.
        augment_s: device augmentation.
        read_s: seconds the batch's maker spent reading it (None: the backend does not say).
        decode_s: seconds it spent decoding and collating it (None: unknown).
        workers: the loader's worker processes (None: unknown).
        usable_cores: cores this process may use (None: unknown).
        on_gpu: whether the step runs on a GPU (decode-on-GPU backends are then an option).
    """

    epoch: int
    step_s: float
    wait_s: float
    transfer_s: float = 0.0
    augment_s: float = 0.0
    read_s: float | None = None
    decode_s: float | None = None
    workers: int | None = None
    usable_cores: int | None = None
    on_gpu: bool = False

    @property
    def data_s(self) -> float:
        """The training loop's own seconds on input per step."""
        return self.wait_s + self.transfer_s + self.augment_s


@dataclass(frozen=True)
class Bound:
    """What bounds the step.

    Args:
        kind: "input" or "compute".
        stage: the stage with the largest share of the data time (one of `STAGES`).
        shares: each stage's share of the data time.
        data_frac: the data time's share of the step.
        advice: what to change (empty when compute-bound and nothing is to gain).
        line: all of it on one log line.
        workers: the workers that would keep up (None: not a loader stage, or unknown).
    """

    kind: str
    stage: str
    shares: dict[str, float] = field(default_factory=dict)
    data_frac: float = 0.0
    advice: str = ""
    line: str = ""
    workers: int | None = None


def _shares(f: StageFigures) -> dict[str, float]:
    data = max(f.data_s, 1e-12)
    made = (f.read_s or 0.0) + (f.decode_s or 0.0)
    parts = {"transfer": f.transfer_s, "augment": f.augment_s}
    if f.read_s is not None and f.decode_s is not None and made > 0:
        parts["read"] = f.wait_s * f.read_s / made
        parts["decode"] = f.wait_s * f.decode_s / made
    else:
        parts["wait"] = f.wait_s
    return {s: parts[s] / data for s in STAGES if s in parts}


def _workers_needed(f: StageFigures) -> int | None:
    """Workers that would make a batch per compute time: ceil((read + decode) / compute)."""
    if f.read_s is None or f.decode_s is None:
        if f.workers is None:
            return None
        compute = max(f.step_s - f.data_s, 1e-6)
        per_batch = f.wait_s if f.workers == 0 else f.workers * (compute + f.wait_s)
        return max(f.workers + 1, math.ceil(per_batch / compute))
    compute = max(f.step_s - f.data_s, 1e-6)
    return max(1, math.ceil((f.read_s + f.decode_s) / compute))


def _loader_advice(f: StageFigures, stage: str, needed: int | None) -> str:
    now = "" if f.workers is None else f" (now {f.workers})"
    room = f.usable_cores is None or needed is None or needed < f.usable_cores
    more = needed is not None and (f.workers is None or needed > f.workers)
    elsewhere = {
        "decode": "backend='nvjpeg' or 'dali' (decode on the GPU)"
        if f.on_gpu
        else "backend='memory' (decode once and keep the decoded split, when it fits in memory)",
        "read": "shards on a local disk (remote shards: the node-local cache)",
        "wait": "a faster backend (fastdata.read.BACKENDS)",
    }[stage]
    if more and room:
        return f"raise workers to {needed}{now} or use {elsewhere}"
    if more:
        return f"no core is left for {needed} workers{now}: use {elsewhere}"
    return f"use {elsewhere}"


def _advice(f: StageFigures, stage: str, needed: int | None) -> str:
    if stage in ("read", "decode", "wait"):
        return _loader_advice(f, stage, needed)
    if stage == "transfer":
        return "pin the batches (WorkerSettings(pin_memory=True)) so that the copy overlaps compute"
    if f.on_gpu:
        return "use lighter train_transforms (the device augmentation)"
    return "train on a GPU, or use lighter train_transforms (augmentation runs on this CPU)"


def bound(f: StageFigures, threshold: float = 0.2) -> Bound:
    """What bounds the step of epoch `f.epoch`, and what to change (see the module docstring).

    Args:
        f: the epoch's mean stage times.
        threshold: data-time share of the step above which the step is input-bound.
    """
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be a fraction in (0, 1), got {threshold!r}")
    shares = _shares(f)
    stage = max(shares, key=lambda s: shares[s])
    frac = f.data_s / max(f.step_s, 1e-12)
    needed = _workers_needed(f) if stage in ("read", "decode", "wait") else None
    listed = ", ".join(f"{s} {shares[s]:.0%}" for s in STAGES if s in shares)
    head = f"epoch {f.epoch}: "
    figures = f"data {1e3 * f.data_s:.1f} of {1e3 * f.step_s:.1f} ms per step = {frac:.0%}"
    if frac > threshold:
        advice = _advice(f, stage, needed)
        line = (
            f"{head}input-bound: {stage} {shares[stage]:.0%} of the data time ({figures}; "
            f"{listed}); {advice}"
        )
        return Bound("input", stage, shares, frac, advice, line, needed)
    advice = ""
    if needed is not None and f.workers is not None and needed < f.workers:
        advice = f"{needed} workers would also keep up (now {f.workers})"
    line = f"{head}compute-bound: {figures} ({listed}); the loader keeps up"
    line += f"; {advice}" if advice else ""
    return Bound("compute", stage, shares, frac, advice, line, needed)
