"""Flat (1-D) reduce-scatter and allgather with explicit per-rank element counts, as TensorFlow ops.

The building blocks of ZeRO-style sharding (`hvdplus.keras.ZeroOptimizer`): a rank's slice of a flat
buffer is `counts[r]` elements, as a partition plan (`hvdplus.common.plans.sharding`) cuts it, not Horovod's
split of the first dimension. Both ops work eagerly and inside tf.function (see _graph.py: a submit op and a
wait op in graphs) and have static output shapes (`counts[this rank]`, `sum(counts)`). They are not
differentiable: they move gradients and parameters, they are not part of a model.

The counts are checked across ranks by the core: ranks that disagree get CollectiveMismatchError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.handles import Completion
from hvdplus.common.ops import ReduceOp
from hvdplus.tensorflow._graph import Finish, dtype_name, execute, storage, values

__all__ = ["reducescatter_flat", "allgather_flat"]


def _flat(tensor: Any, counts: Sequence[int], process_set: ProcessSet, what: str) -> tuple[tf.Tensor, list[int]]:
    """Checked when the op is built (the core's own check, so a tf.function fails at trace time)."""
    tensor = tf.convert_to_tensor(tensor)
    dtype_name(tensor.dtype)
    shape = tensor.shape.as_list() if tensor.shape.rank is not None else ["unknown rank"]
    return tensor, list(core.check_counts(counts, shape, process_set, what))


def reducescatter_flat(
    tensor: Any,
    counts: Sequence[int],
    name: str | None,
    op: ReduceOp = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce the flat `tensor` (of `sum(counts)` elements) over the set and return this rank's `counts[r]`
    elements of the result (r: this rank's index in the set).

    Collective: every rank in the process set must call this, in the same order, with the same counts."""
    tensor, counts = _flat(tensor, counts, process_set, "reducescatter_flat")
    if tensor.shape[0] is not None and tensor.shape[0] != sum(counts):
        raise ValueError(f"reducescatter_flat: counts {counts} must add up to the tensor's {tensor.shape[0]} elements")
    core.check_reducescatter_op(op)
    dtype = dtype_name(tensor.dtype)
    mine = counts[process_set.rank()]

    def start(array: np.ndarray) -> Finish:
        handle = core.submit_reducescatter(
            storage(array), dtype, name, op, prescale_factor, postscale_factor, process_set, counts=counts
        )
        return Completion([handle], lambda results: [values(np.asarray(results[0]).reshape(-1), dtype)])

    return execute(start, [tensor], [tensor.dtype], [tf.TensorShape([mine])])[0]


def allgather_flat(
    tensor: Any, counts: Sequence[int], name: str | None, process_set: ProcessSet = global_process_set
) -> tf.Tensor:
    """Concatenate every member's flat `tensor` (`counts[r]` elements on member r) into one flat tensor of
    `sum(counts)` elements, on every member.

    Collective: every rank in the process set must call this, in the same order, with the same counts."""
    tensor, counts = _flat(tensor, counts, process_set, "allgather_flat")
    mine = counts[process_set.rank()]
    if tensor.shape[0] is not None and tensor.shape[0] != mine:
        raise ValueError(f"allgather_flat: this rank's tensor has {tensor.shape[0]} elements, its count is {mine}")
    dtype = dtype_name(tensor.dtype)

    def start(array: np.ndarray) -> Finish:
        handle = core.submit_allgather(storage(array), dtype, name, process_set, counts=counts)
        return Completion([handle], lambda results: [values(np.asarray(results[0]).reshape(-1), dtype)])

    return execute(start, [tensor], [tensor.dtype], [tf.TensorShape([sum(counts)])])[0]
