"""horovod.tensorflow's DistributedOptimizer: Keras optimizers go to hvdplus.keras's, TF1 optimizers are wrapped.

As in Horovod, `hvd.DistributedOptimizer` of horovod.tensorflow takes either optimizer kind. A
`tf.compat.v1.train.Optimizer` (e.g. `GradientDescentOptimizer` in a tf.compat.v1 graph) is wrapped in
Horovod's `_DistributedOptimizer`: `compute_gradients` (hence `minimize`) returns the gradients averaged
over the process set; everything else is the wrapped optimizer's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

if TYPE_CHECKING:
    import keras

from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.ops import Adasum, Average, ReduceOp
from hvdplus.common.optimizer_options import check_passes, merge_num_groups
from hvdplus.tensorflow.compression import Compression, Compressor
from hvdplus.tensorflow.gradients import GradientReducer

__all__ = ["DistributedOptimizer"]

_LegacyOptimizer = tf.compat.v1.train.Optimizer


# The base is _LegacyOptimizer, spelled out: mypy takes a class as a base, not a variable that holds one.
class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Horovod's wrapper of a TF1 optimizer: gradients are allreduced in `compute_gradients`."""

    def __init__(self, optimizer: Any, name: str, use_locking: bool, reducer: GradientReducer) -> None:
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._hvd_reducer = reducer

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's (gradient, variable) pairs, gradients allreduced.

        Collective: every rank in the process set must call this with the same variables, in the same order."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        variables = [v for _, v in pairs]
        return list(zip(self._hvd_reducer.reduce([g for g, _ in pairs], variables), variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """The wrapped optimizer's `apply_gradients`."""
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def register_local_var(self, var: Any) -> None:
        """Keep `var`'s gradient local to this rank (not allreduced), as Horovod's method does."""
        self._hvd_reducer.register_local([var])

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> list[str]:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(
    optimizer: tf.compat.v1.train.Optimizer | keras.optimizers.Optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Compressor = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: int | list[Any] | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.compat.v1.train.Optimizer | keras.optimizers.Optimizer:
    """Wrap `optimizer` so that it applies gradients averaged (`op`) over the ranks of `process_set`.

    A Keras optimizer gets `hvdplus.keras.DistributedOptimizer` (the same arguments; `use_locking` is unused);
    a `tf.compat.v1.train.Optimizer` gets Horovod's TF1 wrapper, whose `compute_gradients` allreduces (there
    `backward_passes_per_step` must be 1 and `op` not Adasum). Collective: every rank in the process set must
    wrap its optimizer and apply it the same number of times."""
    check_passes(backward_passes_per_step)
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    groups = merge_num_groups(num_groups, groups)
    if isinstance(optimizer, _LegacyOptimizer):
        return _wrap_legacy(
            optimizer,
            name,
            use_locking,
            compression,
            sparse_as_dense,
            backward_passes_per_step,
            op,
            gradient_predivide_factor,
            groups,
            process_set,
            scale_local_gradients,
        )
    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    from hvdplus.keras.optimizer import DistributedOptimizer as keras_distributed_optimizer

    return keras_distributed_optimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )


def _wrap_legacy(
    optimizer: Any,
    name: str | None,
    use_locking: bool,
    compression: Compressor,
    sparse_as_dense: bool,
    passes: int,
    op: ReduceOp,
    predivide: float,
    groups: int | list[Any] | None,
    process_set: ProcessSet,
    scale_local_gradients: bool,
) -> _DistributedOptimizer:
    if passes != 1:
        raise NotImplementedError(
            "backward_passes_per_step > 1 is not supported for tf.compat.v1.train optimizers "
            "in hvdplus; accumulate in your training loop or use a Keras optimizer"
        )
    if op == Adasum:
        raise NotImplementedError(
            "op=Adasum (Horovod's delta optimizer) is not supported for tf.compat.v1.train "
            "optimizers in hvdplus; use op=Average"
        )
    name = name or f"Distributed{type(optimizer).__name__}"
    reducer = GradientReducer(
        compression, sparse_as_dense, op, predivide, groups, process_set, scale_local_gradients, name
    )
    return _DistributedOptimizer(optimizer, name, use_locking, reducer)
