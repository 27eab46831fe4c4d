"""The training feed's steps, the next one pulled while the current one trains, the position still exact.

`regen.train.feed.ShardFeed.steps()` advances the feed's position when it yields a step, and a checkpoint stores
that position: the step after it is the first one a resumed run trains. Reading feature objects of the next step
while this one computes (`train.producers.read_ahead`, `regen.train.features.client`) needs the next step's
micro-batches early, so `StepLookahead.pull_next` takes it from the feed in a background thread (follow mode may
wait there for `regen render`'s shards; the training thread does not) and hands it to `on_pulled` (the reader's
`submit`). `state_dict()` is the position after the last step `take`n, not after one pulled early: it is what
`save_checkpoint` and the summary store, so a run stopped at any point resumes at the first step it did not train
(tests/train/test_readahead.py). An error of the early pull (a bad shard) is raised by the `take` that would
have met it, where the loop agrees on it across ranks as before.
"""
from __future__ import annotations

import threading


class StepLookahead:
    """`feed.steps(num_epochs)` with at most one step pulled ahead (see the module docstring)."""

    def __init__(self, feed, num_epochs):
        self.feed = feed
        self._steps = feed.steps(num_epochs=num_epochs)
        self._state = feed.state_dict()  # the position after the last step taken
        self._pulled = None  # (step | None, position after it, error | None)
        self._thread: threading.Thread | None = None

    def take(self):
        """The next step (None at the end of the feed); its early pull is waited for when there was one. Raises
        what the feed raised for it (InputError: a bad shard or row)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._pulled is None:
            step = next(self._steps, None)
            self._state = self.feed.state_dict()
            return step
        (step, state, error), self._pulled = self._pulled, None
        if error is not None:
            raise error
        self._state = state
        return step

    def pull_next(self, on_pulled=None) -> None:
        """Start pulling the step after the one last taken, in a background thread; `on_pulled(step)` runs there
        once it is (not for the end of the feed or an error). At most one at a time."""
        if self._thread is not None or self._pulled is not None:
            return

        def pull():
            try:
                step = next(self._steps, None)
                self._pulled = (step, self.feed.state_dict(), None)
                if step is not None and on_pulled is not None:
                    on_pulled(step)
            except Exception as exc:  # noqa: BLE001 - raised by `take`, where the ranks agree on it
                self._pulled = (None, None, exc)

        self._thread = threading.Thread(target=pull, name="feed-lookahead", daemon=True)
        self._thread.start()

    def state_dict(self) -> dict:
        """The feed position after the last step taken (what a checkpoint stores)."""
        return dict(self._state)
