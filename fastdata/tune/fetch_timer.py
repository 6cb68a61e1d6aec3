"""`FetchTimer`: the trainer's profiler, passed through, that also times the training fetches.

Why the fetch bracket is the data wait
-------------------------------------

Lightning's training loop (`_TrainingEpochLoop.advance`, Lightning 2.6) does, per step::

    batch = next(data_fetcher)            # -> next(loader iterator), bracketed by
                                          #    trainer.profiler.start/stop("[_TrainingEpochLoop]
                                          #    .train_dataloader_next")
    batch -> device, on_after_batch_transfer
    on_train_batch_start                  # <- the monitor stamps the step
    training_step, backward, optimizer step
    on_train_batch_end                    # other callbacks: checkpoint saves, logging syncs

The data wait of a step is the time spent in the loader's own ``next()``: the monitor wraps the
trainer's profiler (`FetchTimer`, which passes every call on to the profiler it wraps) and times
the "train_dataloader_next" action, which brackets exactly that call. An earlier version took the
gap between `on_train_batch_end` and the next `on_train_batch_start`; that gap also holds the
callbacks that run after the monitor's `on_train_batch_end` (Lightning runs `ModelCheckpoint`
last), logging syncs and the host-to-device copy, so on millisecond GPU steps it exceeded the
threshold with an instant loader. When the loader keeps up, `next()` returns an already
prefetched batch at once. Our loaders have a length, and with a length Lightning's
`_PrefetchDataFetcher` does not read ahead, so the batch fetched is the one the step uses;
without a length it reads one batch ahead, which leaves the mean over an epoch unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.profilers import Profiler

__all__ = ["FETCH_ACTION", "FetchTimer"]

#: The profiler action that brackets the training loader's ``next()`` (Lightning 2.x).
FETCH_ACTION = "train_dataloader_next"


class FetchTimer(Profiler):
    """The trainer's profiler, passed through, that also reports the training loader's fetches
    and, to listeners added with `listen`, any other action (the batch transfer hooks, ...).

    Args:
        inner: the trainer's own profiler (every call goes on to it).
        began: called when a training fetch starts (None: no fetch listener yet).
        ended: called when it ends.
    """

    def __init__(
        self,
        inner: Profiler,
        began: Callable[[], None] | None = None,
        ended: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self._listeners: list[tuple[str, Callable[[], None], Callable[[], None]]] = []
        # action name -> its listeners' (began, ended): Lightning runs ~25 actions a step, most
        # with no listener; one dict lookup each keeps the wrapper's cost at a few microseconds.
        self._matches: dict[str, tuple[tuple[Callable[[], None], Callable[[], None]], ...]] = {}
        if began is not None and ended is not None:
            self.listen(FETCH_ACTION, began, ended)

    def listen(self, suffix: str, began: Callable[[], None], ended: Callable[[], None]) -> None:
        """Call `began` when an action whose name ends with `suffix` starts, `ended` when it
        stops (once per listener: adding the same pair again does nothing)."""
        entry = (suffix, began, ended)
        if entry not in self._listeners:
            self._listeners.append(entry)
            self._matches.clear()

    def _listeners_of(
        self, action_name: str
    ) -> tuple[tuple[Callable[[], None], Callable[[], None]], ...]:
        found = self._matches.get(action_name)
        if found is None:
            found = tuple((b, e) for s, b, e in self._listeners if action_name.endswith(s))
            self._matches[action_name] = found
        return found

    def start(self, action_name: str) -> None:
        """Start `action_name` on the inner profiler (after the listeners' `began`)."""
        for began, _ in self._listeners_of(action_name):
            began()
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        """Stop `action_name` on the inner profiler (then the listeners' `ended`)."""
        self.inner.stop(action_name)
        for _, ended in self._listeners_of(action_name):
            ended()

    def summary(self) -> str:
        """The inner profiler's summary."""
        return self.inner.summary()

    def describe(self) -> None:
        """The inner profiler's report."""
        self.inner.describe()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Set up the inner profiler."""
        self.inner.setup(stage, local_rank, log_dir)

    def teardown(self, stage: str | None) -> None:
        """Tear down the inner profiler."""
        self.inner.teardown(stage)

    @property
    def _lightning_module(self) -> Any:  # the Trainer sets it on its profiler at every run
        return getattr(self.inner, "_lightning_module", None)

    @_lightning_module.setter
    def _lightning_module(self, module: Any) -> None:
        self.inner._lightning_module = module
