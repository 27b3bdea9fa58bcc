"""horovod.keras.callbacks for Keras 3: broadcast, metric averaging, learning-rate schedules, best checkpoint.

The learning rate is read and set through `optimizer.learning_rate` (a variable in Keras 3); Keras itself
raises when the optimizer was built with a LearningRateSchedule, whose rate cannot be set.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvdplus.common.basics import rank, size
from hvdplus.common.collectives import allgather_object
from hvdplus.common.plans.lr_schedules import fractional_epoch, in_epoch_range, warmup_multiplier
from hvdplus.keras.functions import broadcast_model

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "BestModelCheckpoint",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from the root's model weights and optimizer state.

    A built model (e.g. one with a `keras.Input`) is broadcast, optimizer included, when training begins,
    so the first step already starts from the root's values. A model that only builds itself on its first
    call is broadcast after the first batch instead, as Horovod's TF2 callback does. `local_variables` (a
    variable or a list of them; more with `register_local_var`) keep each rank's own values.
    Collective: every rank must use it in `fit`."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local_vars: list[Any] = []
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        if not all(_is_variable(v) for v in local_variables):
            raise ValueError(
                f"All local variables must be of tf.Variable or keras.Variable type, got {list(local_variables)!r}"
            )
        for variable in local_variables:
            self.register_local_var(variable)

    def register_local_var(self, var: Any) -> None:
        """Leave `var` out of the broadcast: each rank keeps its own value (Horovod's method)."""
        self._local_vars.append(var)

    def _broadcast(self) -> None:
        if not self.broadcast_done:
            broadcast_model(self.model, self.root_rank, local_variables=self._local_vars)
            self.broadcast_done = True

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._broadcast()


def _is_variable(value: Any) -> bool:
    return isinstance(value, (tf.Variable, keras.Variable))


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch-end metric in `logs` with its average over the ranks.

    Put it before callbacks that read the metrics (checkpoints, schedules, early stopping).
    Collective: every rank must use it in `fit`, with the same metrics."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is None:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        gathered = allgather_object((names, [float(logs[k]) for k in names]), name=f"MetricAverageCallback.{epoch}")
        if any(other != names for other, _ in gathered):
            raise ValueError(
                f"MetricAverageCallback: ranks report different metrics: "
                f"{[other for other, _ in gathered]}; compile every rank's model with the same metrics"
            )
        for i, key in enumerate(names):
            logs[key] = float(np.mean([values[i] for _, values in gathered]))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to `initial_lr * multiplier(epoch)` from `start_epoch` to `end_epoch` (Horovod's).

    `multiplier` is a number or a function of the epoch; with `staircase=False` (functions only) the epoch is
    fractional and the rate changes every batch. `momentum_correction` is not applied: Keras 3 compiles the
    momentum into the train step as a constant (a warning says so when the optimizer has momentum)."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.staircase = staircase or not callable(multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.momentum_correction and getattr(self.model.optimizer, "momentum", None):
            warnings.warn(
                f"{type(self).__name__}: momentum correction is not applied with Keras 3 (momentum is a "
                f"constant of the compiled train step); pass momentum_correction=False to silence this",
                stacklevel=2,
            )

    def _steps(self) -> int:
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    f"could not find the number of steps per epoch; pass steps_per_epoch= to {type(self).__name__}()"
                )
        return self.steps_per_epoch

    def _adjust(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch
        if in_epoch_range(epoch, self.start_epoch, self.end_epoch) and self.staircase:
            self._adjust(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and in_epoch_range(self.current_epoch, self.start_epoch, self.end_epoch):
            self._adjust(fractional_epoch(self.current_epoch, batch, self._steps()))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warmup: ramp the rate from `initial_lr / size` to `initial_lr` over `warmup_epochs`.

    `initial_lr` is the rate after warmup (usually the single-process rate times `hvd.size()`); it changes every
    batch. Pass `steps_per_epoch` when Keras cannot tell (e.g. an infinite dataset)."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__(
            initial_lr,
            self._warmup,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

    def _warmup(self, epoch: float) -> float:
        return warmup_multiplier(epoch, self.warmup_epochs, size(), self._steps())

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if self.end_epoch is not None and epoch == self.end_epoch - 1 and self.verbose > 0:
            rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model with the best `monitor` value to `filepath` (a `.keras` file), from rank 0 only.

    Keras 3 needs the path when the callback is made (Horovod's set it later); pass it as `filepath=`.
    Use MetricAverageCallback before it so that `monitor` is the average over the ranks."""

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        mode: str = "auto",
        save_freq: Any = "epoch",
        filepath: str | None = None,
    ) -> None:
        if filepath is None:
            raise ValueError("BestModelCheckpoint needs filepath= (a path ending in .keras) with Keras 3")
        super().__init__(
            filepath,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=False,
            mode=mode,
            save_freq=save_freq,
        )

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if rank() == 0:
            super().on_epoch_end(epoch, logs)
