"""horovod.keras's DistributedOptimizer for Keras 3 (TensorFlow backend): `apply` allreduces the gradients first.

`DistributedOptimizer(opt)` returns a new instance of a dynamic subclass of `type(opt)` built from
`opt.get_config()` (as Horovod does), carrying over `opt`'s variables if it was already built. The subclass
keeps the wrapped class's name and module, so `model.save()` records a plain Keras optimizer: the file loads
with `keras.models.load_model` where hvdplus is not installed, and `hvdplus.keras.load_model` wraps it again.

Gradient accumulation (`backward_passes_per_step=k`): each `apply` adds the local gradients to accumulators
(plain tf.Variables, not part of `optimizer.variables`, so saved models stay plain); every k-th call the sums
(divided by k with `average_aggregated_gradients=True`) are allreduced and the wrapped optimizer applies them.
The k calls are counted by a counter of the wrapper's own (an optimizer wrapped after some training keeps
its `iterations`); `optimizer.iterations` counts every call, as Keras' own gradient_accumulation_steps does.
The collective names are taken in the step's graph before the update's tf.cond (whose branch graph would
number them afresh), so two accumulating optimizers in one step keep theirs apart. With a mean loss and equal
batches, `average_aggregated_gradients=True` makes k steps of b samples on n ranks equal one step on the combined
k * n * b samples.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import keras
import tensorflow as tf

from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.ops import Average, ReduceOp
from hvdplus.common.optimizer_options import check_passes, merge_num_groups
from hvdplus.common.subclassing import disguised_subclass
from hvdplus.tensorflow.compression import Compression, Compressor
from hvdplus.tensorflow.gradient_tape import layer_variables
from hvdplus.tensorflow.gradients import GradientReducer

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]

if TYPE_CHECKING:  # the mixins below sit before a Keras optimizer class, whose attributes and methods they use
    OptimizerMixin: TypeAlias = keras.optimizers.Optimizer
else:
    OptimizerMixin = object


class _Reducer(Protocol):
    """What the accumulation code needs of `_hvd_reducer`: a GradientReducer, or ZeroOptimizer's name passing."""

    def names(self, variables: Sequence[Any]) -> list[str]: ...

    def reduce(
        self, grads: Sequence[Any], variables: Sequence[Any], names: Sequence[str] | None = None
    ) -> list[Any]: ...


class DistributedOptimizerMixin(OptimizerMixin):
    """Mixin placed before the user's optimizer class; the `_hvd_*` attributes are set on each instance."""

    _hvd_reducer: _Reducer
    _hvd_passes: int
    _hvd_average_aggregated: bool
    _hvd_accumulators: list[tf.Variable] | None = None
    _hvd_calls: tf.Variable | None = None

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Allreduce `grads` (every `backward_passes_per_step`-th call), then apply them with the wrapped optimizer.

        Collective: every rank in the process set must call this the same number of times."""
        grads = list(grads)
        if trainable_variables is None and getattr(self, "built", False):
            trainable_variables = self._trainable_variables  # what Keras would use
        if trainable_variables is None:
            raise ValueError(
                "the optimizer is not built yet: pass trainable_variables to apply(), or call "
                "optimizer.build(model.trainable_variables) first"
            )
        variables = list(trainable_variables)
        if self._hvd_passes == 1:
            return super().apply(self._hvd_reducer.reduce(grads, variables), trainable_variables)
        return self._hvd_accumulate(grads, variables, trainable_variables)

    def _hvd_accumulate(self, grads: list[Any], variables: list[Any], trainable_variables: Any) -> None:
        optimizer: Any = self
        if not optimizer.built:
            optimizer.build(variables)
        accumulators = self._hvd_accumulators_for(variables)
        for accumulator, grad in zip(accumulators, grads):
            if grad is not None:
                accumulator.assign_add(tf.convert_to_tensor(grad))
        names = self._hvd_reducer.names(variables)
        assert self._hvd_calls is not None  # _hvd_accumulators_for created it with the accumulators
        calls = self._hvd_calls.assign_add(1)

        def update() -> None:
            scale = 1.0 / self._hvd_passes if self._hvd_average_aggregated else 1.0
            summed = [
                None if g is None else a.read_value() * tf.cast(scale, a.dtype) for g, a in zip(grads, accumulators)
            ]
            reduced = self._hvd_reducer.reduce(summed, variables, names)
            super(DistributedOptimizerMixin, self).apply(reduced, trainable_variables)
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))

        def skip() -> None:
            optimizer.iterations.assign_add(1)

        tf.cond(tf.equal(calls % self._hvd_passes, 0), update, skip)

    def discard_pending(self) -> None:
        """Start a new accumulation window (backward_passes_per_step > 1): after an elastic reset the sums so far
        are each rank's own, and a new worker has none."""
        for accumulator in self._hvd_accumulators or []:
            accumulator.assign(tf.zeros_like(accumulator))
        if self._hvd_calls is not None:
            self._hvd_calls.assign(0)

    def _hvd_accumulators_for(self, variables: list[Any]) -> list[tf.Variable]:
        """One zero-initialised accumulator per variable (and the call counter), created on first use outside
        any tf.function."""
        if self._hvd_accumulators is None:
            with tf.init_scope():
                self._hvd_accumulators = [
                    tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="hvd_accumulator") for v in variables
                ]
                self._hvd_calls = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_accumulated_calls")
        if len(self._hvd_accumulators) != len(variables):
            raise ValueError(
                f"backward_passes_per_step: this optimizer accumulates {len(self._hvd_accumulators)} "
                f"gradients but got {len(variables)}; pass the same variables on every step"
            )
        return self._hvd_accumulators


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Compressor = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: ReduceOp = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: int | list[Any] | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that it applies gradients averaged (`op`) over the ranks of `process_set`.

    `name` renames the optimizer and prefixes its collectives' names; `compression` is the wire codec (e.g.
    `Compression.fp16`); tf.IndexedSlices gradients are allgathered unless `sparse_as_dense`;
    `gradient_predivide_factor` f divides by f before the sum and by size/f after; `groups` (an int, or lists of
    variables) sets how many allreduce ops carry the gradients (one by default); see the module docstring for
    `backward_passes_per_step`. Collective: every rank in the process set must wrap its optimizer and apply it the
    same number of times."""
    return _wrap(
        optimizer,
        name,
        compression,
        sparse_as_dense,
        gradient_predivide_factor,
        op,
        backward_passes_per_step,
        average_aggregated_gradients,
        merge_num_groups(num_groups, groups),
        process_set,
        scale_local_gradients,
        [],
    )


def PartialDistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Compressor = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: ReduceOp = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: int | list[Any] | None = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """A DistributedOptimizer whose `local_layers` (a Keras layer or a list of them) keep local gradients.

    Collective: as DistributedOptimizer."""
    return _wrap(
        optimizer,
        name,
        compression,
        sparse_as_dense,
        gradient_predivide_factor,
        op,
        backward_passes_per_step,
        average_aggregated_gradients,
        groups,
        process_set,
        scale_local_gradients,
        layer_variables(local_layers),
    )


def _wrap(
    optimizer: Any,
    name: str | None,
    compression: Compressor,
    sparse_as_dense: bool,
    predivide: float,
    op: ReduceOp,
    passes: int,
    average_aggregated: bool,
    groups: int | list[Any] | None,
    process_set: ProcessSet,
    scale_local_gradients: bool,
    local_variables: Any,
) -> Any:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"optimizer must be a Keras 3 optimizer (keras.optimizers.Optimizer), got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, DistributedOptimizerMixin):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the original optimizer only once")
    check_passes(passes)
    if keras.config.dtype_policy().name == "mixed_float16" and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        warnings.warn(
            "with the mixed_float16 policy, wrap the loss-scale optimizer: hvd.DistributedOptimizer("
            "keras.optimizers.LossScaleOptimizer(opt)). Otherwise model.compile() puts a LossScaleOptimizer "
            "around this one, which skips the allreduce on a rank whose own gradients overflow while the "
            "other ranks wait for it.",
            stacklevel=3,
        )
    reducer = GradientReducer(
        compression,
        sparse_as_dense,
        op,
        predivide,
        groups,
        process_set,
        scale_local_gradients,
        name or "DistributedOptimizer",
    )
    reducer.register_local(local_variables)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = disguised_subclass(DistributedOptimizerMixin, type(optimizer)).from_config(config)
    wrapped._hvd_reducer, wrapped._hvd_passes = reducer, passes
    wrapped._hvd_average_aggregated = average_aggregated
    if optimizer.built:
        _copy_state(optimizer, wrapped)
    return wrapped


def _copy_state(source: Any, target: Any) -> None:
    """Build `target` on `source`'s variables and copy its slots and iteration count."""
    target.build(source._trainable_variables)  # the list a built Keras optimizer was built with
    if len(target.variables) != len(source.variables):
        raise ValueError(
            f"cannot carry the optimizer's state over: it has {len(source.variables)} variables, "
            f"the wrapped copy {len(target.variables)}"
        )
    for mine, theirs in zip(target.variables, source.variables):
        mine.assign(theirs)
