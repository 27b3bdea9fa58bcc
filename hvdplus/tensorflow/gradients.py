"""Averaging a list of gradients over the ranks: shared by DistributedGradientTape and Keras' DistributedOptimizer.

Dense gradients go in one grouped allreduce op per group (with `groups=None`, one op for all of them: the core
fuses them into as few reductions as the fusion threshold allows). tf.IndexedSlices are allgathered unless
`sparse_as_dense`. Gradients of local variables (PartialDistributed*) are not reduced; with
`scale_local_gradients` they are divided by the process set's size, as Horovod does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import tensorflow as tf

from hvdplus.common.basics import ProcessSet, elastic_worker
from hvdplus.common.ops import ReduceOp
from hvdplus.common.optimizer_options import check_compression, check_predivide, predivide_scales
from hvdplus.common.plans.grouping import check_groups, group_indices
from hvdplus.tensorflow._graph import graph_name
from hvdplus.tensorflow.compression import Compressor
from hvdplus.tensorflow.mpi_ops import allreduce_op, as_tensors, sparse_allreduce

__all__ = ["GradientReducer"]


class GradientReducer:
    """Horovod's gradient allreduce for a tape or an optimizer; `reduce` is called once per step on every rank."""

    def __init__(
        self,
        compression: Compressor,
        sparse_as_dense: bool,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: int | list[Any] | None,
        process_set: ProcessSet,
        scale_local_gradients: bool,
        prefix: str,
    ) -> None:
        check_compression(compression)
        check_predivide(gradient_predivide_factor, op)
        check_groups(groups)
        self.compression, self.sparse_as_dense, self.op = compression, sparse_as_dense, op
        self.prescale, self.postscale = predivide_scales(gradient_predivide_factor, op)
        self.groups, self.process_set, self.scale_local_gradients = groups, process_set, scale_local_gradients
        self.prefix = prefix
        self._local: set[int] = set()

    def register_local(self, variables: Iterable[Any]) -> None:
        """Leave the gradients of `variables` out of the allreduce (they stay local to each rank)."""
        self._local.update(id(v) for v in variables)

    def is_local(self, variable: Any) -> bool:
        """Whether `variable`'s gradient stays local to each rank (`register_local`)."""
        return id(variable) in self._local

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any], names: Sequence[str] | None = None) -> list[Any]:
        """The gradients averaged (op) over the process set; None stays None. `names` (from `names()`) must be
        given when this runs inside a tf.cond branch, whose graph numbers names afresh.

        Collective: every rank in the process set must call this with the same variables, in the same order."""
        grads = list(grads)
        alone = self.process_set.size() == 1 and elastic_worker() is None  # an elastic job may grow: trace the op
        if not self.process_set.included() or alone:
            return grads
        names = list(names) if names is not None else self.names(variables)
        shared = [i for i, g in enumerate(grads) if g is not None and not self.is_local(variables[i])]
        for i, g in enumerate(grads):
            if g is not None and self.is_local(variables[i]) and self.scale_local_gradients:
                grads[i] = g / tf.cast(self.process_set.size(), g.dtype)
        dense = []
        for i in shared:
            if isinstance(grads[i], tf.IndexedSlices) and not self.sparse_as_dense:
                grads[i] = sparse_allreduce(
                    grads[i], names[i], self.op, self.prescale, self.postscale, self.process_set, True
                )
            else:
                dense.append(i)
        for members in self._plan(variables, dense):
            self._allreduce(grads, members, names)
        return grads

    def names(self, variables: Sequence[Any]) -> list[str]:
        """The collective names of the gradients of `variables` in the graph being built (or eagerly).

        Names by position only: Keras numbers layers per process, so variable names can differ between ranks,
        and a variable whose shape differs between ranks must meet its peers to raise CollectiveMismatchError."""
        prefix = self.prefix if tf.executing_eagerly() else graph_name(self.prefix)
        return [f"{prefix}.grad{i}" for i in range(len(variables))]

    def _plan(self, variables: Sequence[Any], dense: list[int]) -> list[list[int]]:
        """The dense gradients' positions, one list per allreduce op."""
        wanted = set(dense)
        plan = [[i for i in group if i in wanted] for group in group_indices(list(variables), self.groups)]
        plan = [group for group in plan if group] or [dense]
        return [group for group in plan if group]

    def _allreduce(self, grads: list[Any], members: list[int], names: list[str]) -> None:
        pairs = [self.compression.compress(tf.convert_to_tensor(grads[i])) for i in members]
        inputs = as_tensors([p[0] for p in pairs])
        reduced = allreduce_op(
            inputs, [names[i] for i in members], self.op, self.prescale, self.postscale, self.process_set
        )
        for i, output, (_, ctx) in zip(members, reduced, pairs):
            grads[i] = self.compression.decompress(output, ctx)
