"""hvd.elastic for Keras 3 (horovod.keras.elastic and horovod.tensorflow.keras.elastic): KerasState, run and the
callbacks that keep the state's epoch and batch and commit it during `model.fit`.

Use the callbacks in this order: UpdateEpochStateCallback, UpdateBatchStateCallback, CommitStateCallback (each
commit then holds the epoch and batch just finished), before callbacks that stop training (EarlyStopping), and
resume with `model.fit(..., initial_epoch=state.epoch, epochs=epochs)`: Keras then numbers the epochs of the
whole job, so epoch-based schedules see the right one. Horovod's `epochs=epochs - state.epoch` works too.
"""

from __future__ import annotations

from typing import Any

import keras

from hvdplus.common.elastic.state import ObjectState, State
from hvdplus.tensorflow.elastic import TensorFlowKerasState, run

__all__ = [
    "KerasState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
    "State",
    "ObjectState",
    "TensorFlowKerasState",
]


class KerasState(TensorFlowKerasState):
    """State of a built Keras model, its optimizer (or `optimizer`) and keyword attributes (e.g. epoch=0, batch=0)."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit `state` every `batches_per_commit` batches and at the end of every epoch.

    A commit is a collective (it checks for host changes): every rank must use this callback."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be a positive int, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining = self.batches_per_commit  # every rank counts from the same point after a reset

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep `state.batch` at the number of batches done in the current epoch (0 again at its end).

    After a reset in the middle of an epoch, `fit` runs only the batches that epoch still had, when it knows
    the steps per epoch: the job then makes as many optimizer steps as one without a reset (Horovod keeps the
    last batch's index and shortens `params['steps']`, which tf.keras' loop does not read). The data iterator
    starts again: the resumed epoch draws its batches from the start of the data."""

    def __init__(self, state: ObjectState) -> None:
        super().__init__()
        self.state = state
        self._done_before = 0  # batches of the current epoch done before this fit call
        self._cut_short = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._done_before = self.state.batch
        self._cut_short = False

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = self._done_before + batch + 1
        steps = self.params.get("steps")
        if self._done_before and steps and self.state.batch >= steps and not self.model.stop_training:
            self.model.stop_training = True  # ends this epoch: on_epoch_end lets fit go on to the next one
            self._cut_short = True

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = 0
        self._done_before = 0
        if self._cut_short:
            self.model.stop_training = False
            self._cut_short = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep `state.epoch` at the number of epochs the job has done, across resets.

    The first epoch of each `fit` is taken to be `state.epoch`, whether fit numbers it `initial_epoch=state.epoch`
    or 0 (`epochs=epochs - state.epoch`). Horovod adds the state's epoch to fit's, which counts it twice when
    fit starts at `initial_epoch=state.epoch` (the wrong epoch after a reset of horovod#2844)."""

    def __init__(self, state: ObjectState) -> None:
        super().__init__()
        self.state = state
        self._offset: int | None = None  # the job's epoch minus fit's

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._offset = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._offset is None:
            self._offset = self.state.epoch - epoch

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self._offset is not None  # on_epoch_begin set it
        self.state.epoch = epoch + self._offset + 1
