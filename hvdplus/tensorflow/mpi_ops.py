"""horovod.tensorflow's collectives on TensorFlow tensors, eager and inside tf.function, with gradients.

Every op keeps Horovod's signature (`device_*` arguments are accepted and ignored: tensors are staged
through host memory); the work itself is done by `hvdplus.common.collectives` (see _graph.py for how
a call becomes a graph op and how names are chosen).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, overload

import numpy as np
import tensorflow as tf

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set, rank
from hvdplus.common.handles import Completion
from hvdplus.common.naming import group_size
from hvdplus.common.ops import ReduceOp, reducescatter_grad_scale
from hvdplus.tensorflow._graph import (
    Finish,
    InvalidArgument,
    collective_names,
    differentiable,
    dtype_name,
    execute,
    storage,
    values,
)
from hvdplus.tensorflow.compression import Compression, Compressor

__all__ = [
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "join",
    "barrier",
]

Names = Sequence["str | None"]


def as_tensors(tensors: Sequence[Any]) -> list[tf.Tensor]:
    result = [tf.convert_to_tensor(t) for t in tensors]
    for t in result:
        dtype_name(t.dtype)
    return result


def check_member(process_set: ProcessSet) -> None:
    """Horovod's errors for a process set an op cannot run on, raised as the op is made (eagerly, or when a graph
    is built, so that no failing op joins a graph): ValueError for an id that is not registered (Horovod's Python
    raises it), InvalidArgument (also a tf.errors.InvalidArgumentError, as Horovod's enqueue fails) on a rank that is
    not a member. Other misuse (not a ProcessSet, never registered) is left to the core's checks."""
    set_id = getattr(process_set, "process_set_id", None)
    if not set_id:  # the global set (0), or not registered: the core says why
        return
    ranks = core.process_set_ranks(set_id)
    if rank() not in ranks:
        raise InvalidArgument(
            f"rank {rank()} is not a member of process set {set_id} (ranks {list(ranks)}); only members may submit"
        )


# ----------------------------------------------------------------------------- allreduce
def _same_shape_op(
    tensors: list[tf.Tensor],
    names: Names,
    submit: Callable[..., Any],
    gradient: Callable[[list[tf.Tensor]], list[tf.Tensor]],
    chain: str = "",
    now: Callable[[np.ndarray, np.ndarray, str, str | None], None] | None = None,
) -> list[tf.Tensor]:
    """One collective whose outputs have the inputs' shapes (allreduce, broadcast); `submit(source, output, dtype,
    name, group)` starts one member, `gradient(output_grads)` differentiates it; `chain` as in `execute`.
    `now(source, output, dtype, name)`, if given, runs a lone eager tensor to completion on this thread instead (the
    core's lone lane: no handle, and no cycle of its own when the request is cached)."""
    dtypes = [dtype_name(t.dtype) for t in tensors]
    group = group_size(len(tensors))
    alone_now = now if len(tensors) == 1 and tf.executing_eagerly() else None  # graphs submit, then wait

    def start(*arrays: np.ndarray) -> Finish:
        sources = [storage(a) for a in arrays]
        outputs = [np.empty_like(s) for s in sources]
        if alone_now is not None:  # done when it returns: no handle to wait for
            alone_now(sources[0], outputs[0], dtypes[0], names[0])
            handles = []
        else:
            handles = [submit(s, o, d, n, group) for s, o, d, n in zip(sources, outputs, dtypes, names)]
        return Completion(handles, lambda _: [values(o, d) for o, d in zip(outputs, dtypes)])

    @differentiable
    def forward(*xs: tf.Tensor) -> Any:
        ys = execute(start, xs, [x.dtype for x in xs], [x.shape for x in xs], chain)
        return ys, lambda *dys: gradient(as_tensors(dys))

    return list(forward(*tensors)) if tensors else []


def allreduce_op(
    tensors: list[tf.Tensor], names: Names, op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet
) -> list[tf.Tensor]:
    """One op reducing every tensor (fused by the core); its gradient allreduces the gradients (Sum/Average)."""
    check_member(process_set)

    def gradient(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise NotImplementedError(f"the gradient of allreduce is defined for Average and Sum, not {op!r}")
        return allreduce_op(dys, collective_names("Allreduce", dys, None), op, prescale, postscale, process_set)

    return _same_shape_op(
        tensors,
        names,
        lambda s, o, d, n, g: core.submit_allreduce(s, o, d, n, op, prescale, postscale, process_set, group=g),
        gradient,
        now=lambda s, o, d, n: core.allreduce_now(s, o, d, n, op, prescale, postscale, process_set),
    )


def _check_sparse(op: ReduceOp, prescale: float, postscale: float) -> None:
    """Horovod's limits on allreducing tf.IndexedSlices, checked on every rank before anything is submitted."""
    if op == ReduceOp.ADASUM:
        raise NotImplementedError(
            "The Adasum reduction does not currently support sparse tensors. As a workaround please pass "
            "sparse_as_dense=True to DistributedOptimizer"
        )
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(f"Only Sum and Average ops are supported with tf.IndexedSlices, not {op!r}")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def sparse_allreduce(
    tensor: tf.IndexedSlices,
    name: str | None,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    ignore_name_scope: bool,
) -> tf.IndexedSlices:
    """Horovod's IndexedSlices allreduce: allgather values and indices; Average divides the values by the set's
    size with TensorFlow's `/` (so integer values become floating point, as in Horovod). The scale factors are
    applied for the gradient reducers' gradient_predivide_factor (`allreduce` itself refuses them, see
    `_check_sparse`)."""
    parts = as_tensors([tensor.values, tensor.indices])
    names = collective_names("Allgather", parts, name, ignore_name_scope)
    gathered_values, indices = _allgather_op(parts, names, process_set)
    if prescale * postscale != 1.0:
        gathered_values = gathered_values * tf.cast(prescale * postscale, gathered_values.dtype)
    if op == ReduceOp.AVERAGE:
        gathered_values = gathered_values / tf.cast(process_set.size(), gathered_values.dtype)
    return tf.IndexedSlices(gathered_values, indices, dense_shape=tensor.dense_shape)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Compressor = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> tf.Tensor | tf.IndexedSlices:
    """Reduce `tensor` over the ranks (Average by default); tf.IndexedSlices are allgathered. Differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    op = core.resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        return sparse_allreduce(tensor, name, op, 1.0, 1.0, process_set, ignore_name_scope)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    [tensor] = as_tensors([compressed])
    names = collective_names("Allreduce", [tensor], name, ignore_name_scope)
    [reduced] = allreduce_op([tensor], names, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Compressor = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor | tf.IndexedSlices]:
    """Allreduce a list of tensors in one op (fused by the core); tf.IndexedSlices are allgathered.

    Collective: every rank in the process set must call this, in the same order."""
    op = core.resolve_op(average, op)
    results: list[Any] = list(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if len(dense) < len(results):
        _check_sparse(op, prescale_factor, postscale_factor)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = sparse_allreduce(t, None, op, 1.0, 1.0, process_set, False)
    compressed, contexts = (
        zip(*(compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense)) if dense else ((), ())
    )
    inputs = as_tensors(compressed)
    reduced = allreduce_op(
        inputs, collective_names("Allreduce", inputs, None), op, prescale_factor, postscale_factor, process_set
    )
    for i, output, ctx in zip(dense, reduced, contexts):
        results[i] = compression.decompress(output, ctx)
    return results


# ----------------------------------------------------------------------------- allgather
def _resizing_op(
    kind: str,
    tensors: list[tf.Tensor],
    names: Names,
    submit: Callable[..., Any],
    gradient: Callable[[Sequence[tf.Tensor], list[tf.Tensor]], list[tf.Tensor]],
) -> list[tf.Tensor]:
    """One op whose outputs keep each input's trailing dimensions but not its row count (allgather,
    reducescatter); `submit(array, dtype, name, group)` starts one member, `gradient(inputs, output_grads)`."""
    dtypes = [dtype_name(t.dtype) for t in tensors]
    group = group_size(len(tensors))
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError(f"{kind} needs a tensor with at least one dimension, got a scalar; reshape it to (1,)")

    def start(*arrays: np.ndarray) -> Finish:
        handles = [submit(storage(a), d, n, group) for a, d, n in zip(arrays, dtypes, names)]
        return Completion(handles, lambda results: [values(r, d) for r, d in zip(results, dtypes)])

    @differentiable
    def forward(*xs: tf.Tensor) -> Any:
        ys = execute(start, xs, [x.dtype for x in xs], [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs])
        return ys, lambda *dys: gradient(xs, as_tensors(dys))

    return list(forward(*tensors)) if tensors else []


def _allgather_op(tensors: list[tf.Tensor], names: Names, process_set: ProcessSet) -> list[tf.Tensor]:
    """One op gathering every tensor along dimension 0; the gradient is this rank's rows of the gradient averaged
    over the set (Horovod's `_allgather_grad`)."""
    check_member(process_set)

    def gradient(xs: Sequence[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor]:
        averaged = allreduce_op(dys, collective_names("Allreduce", dys, None), ReduceOp.AVERAGE, 1.0, 1.0, process_set)
        rows = [tf.shape(x, out_type=tf.int64)[:1] for x in xs]
        all_rows = _allgather_op(rows, collective_names("Allgather", rows, None), process_set)
        me = process_set.rank()
        return [g[tf.reduce_sum(r[:me]) : tf.reduce_sum(r[: me + 1])] for g, r in zip(averaged, all_rows)]

    return _resizing_op(
        "allgather", tensors, names, lambda a, d, n, g: core.submit_allgather(a, d, n, process_set, group=g), gradient
    )


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set
) -> tf.Tensor:
    """Concatenate every rank's `tensor` along dimension 0 (first dimensions may differ). Differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    tensors = as_tensors([tensor])
    return _allgather_op(tensors, collective_names("Allgather", tensors, name, ignore_name_scope), process_set)[0]


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    """Allgather a list of tensors in one op. Differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    inputs = as_tensors(tensors)
    return _allgather_op(inputs, collective_names("Allgather", inputs, name, ignore_name_scope), process_set)


# ----------------------------------------------------------------------------- broadcast
def broadcast_op(
    tensors: list[tf.Tensor], names: Names, root_rank: int, process_set: ProcessSet, chain: str = ""
) -> list[tf.Tensor]:
    """One op copying the root's tensors to every member; `root_rank` is a global rank (Horovod's rule, checked
    here on every member). The gradient is the gradient averaged over the set on the root, times 0 elsewhere
    (Horovod's `_broadcast_grad`): a product, so that a graph fetching it runs the average on every rank (tf.zeros_like
    of a tensor of static shape does not depend on it, and the root would wait for the others forever)."""
    check_member(process_set)
    root_rank = core.check_root(root_rank, process_set)

    def gradient(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        averaged = allreduce_op(dys, collective_names("Allreduce", dys, None), ReduceOp.AVERAGE, 1.0, 1.0, process_set)
        return averaged if rank() == root_rank else [g * tf.constant(0, g.dtype) for g in averaged]

    return _same_shape_op(
        tensors,
        names,
        lambda s, o, d, n, g: core.submit_broadcast(s, o, d, root_rank, n, process_set, group=g),
        gradient,
        chain,
    )


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Return the root's `tensor` on every member; `root_rank` is a global rank (`hvd.rank()`), also with
    `process_set`. Differentiable. Collective: every rank in the process set must call this, in the same order."""
    tensors = as_tensors([tensor])
    names = collective_names("Broadcast", tensors, name, ignore_name_scope)
    return broadcast_op(tensors, names, root_rank, process_set)[0]


# ----------------------------------------------------------------------------- alltoall
@overload
def alltoall(
    tensor: Any,
    splits: None = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor: ...


@overload
def alltoall(
    tensor: Any,
    splits: Sequence[int] | np.ndarray | tf.Tensor,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tuple[tf.Tensor, tf.Tensor]: ...


def alltoall(
    tensor: Any,
    splits: Sequence[int] | np.ndarray | tf.Tensor | None = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor | tuple[tf.Tensor, tf.Tensor]:
    """Scatter slices of `tensor` to every rank and gather theirs (rows splits[r] go to rank r). Differentiable.

    Returns the output, or (output, received_splits) when `splits` is given (as hvdplus.torch).
    Splits must be known when the op runs: a list, a numpy array or an eager tensor, or in tf.function a tensor.
    Collective: every rank in the process set must call this, in the same order."""
    [x] = as_tensors([tensor])
    if x.shape.rank == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar; reshape it to (1,)")
    split_tensor = tf.zeros([0], tf.int32) if splits is None else _split_counts(splits)
    [op_name] = collective_names("Alltoall", [x], name, ignore_name_scope)
    output, received = _alltoall_op(x, split_tensor, splits is None, op_name, process_set)
    return output if splits is None else (output, received)


def _split_counts(splits: Sequence[int] | np.ndarray | tf.Tensor) -> tf.Tensor:
    """`splits` as int32 counts. A non-integer dtype is refused by the dtype alone, so every rank given such splits
    raises, whatever values each holds: as Horovod's op, whose splits input is int32, InvalidArgument when run
    eagerly and TypeError when a graph (tf.function, a v1 session) is built."""
    given = tf.convert_to_tensor(splits)
    if not given.dtype.is_integer:
        message = f"alltoall splits must be integers (Horovod's op takes int32), got {given.dtype.name}"
        raise InvalidArgument(message) if tf.executing_eagerly() else TypeError(message)
    return tf.cast(given, tf.int32)


def _rows_to_send(rows: int, splits: list[int] | None, set_size: int) -> int:
    """How many leading rows alltoall sends: Horovod's enqueue checks (horovod/common/operations.cc
    EnqueueTensorAlltoall), failing with InvalidArgument on every rank whose input breaks them; rows beyond
    the splits' sum are not sent, as in Horovod."""
    if splits is None:
        if rows % set_size:
            raise InvalidArgument(
                f"alltoall without splits needs the first dimension ({rows}) to be divisible by the number of "
                f"ranks ({set_size}); pass splits=... to send uneven parts"
            )
        return rows
    if len(splits) != set_size or any(s < 0 for s in splits):
        raise InvalidArgument(f"splits must have one non-negative entry per rank ({set_size}), got {splits}")
    if sum(splits) > rows:
        raise InvalidArgument(
            f"the sum of splits ({sum(splits)}) is greater than the first dimension of the tensor ({rows}): {splits}"
        )
    return sum(splits)


def _alltoall_op(
    x: tf.Tensor, splits: tf.Tensor, even: bool, name: str | None, process_set: ProcessSet
) -> tuple[tf.Tensor, tf.Tensor]:
    check_member(process_set)
    dtype = dtype_name(x.dtype)

    def start(array: np.ndarray, split_array: np.ndarray) -> Finish:
        split_list = None if even else split_array.tolist()
        sent = array[: _rows_to_send(array.shape[0], split_list, process_set.size())]
        handle = core.submit_alltoall(storage(sent), dtype, split_list, name, process_set)
        return Completion([handle], lambda results: [values(results[0][0], dtype), results[0][1].astype(np.int32)])

    @differentiable
    def forward(value: tf.Tensor) -> Any:
        output, received = execute(
            start,
            [value, splits],
            [value.dtype, tf.int32],
            [tf.TensorShape([None]).concatenate(value.shape[1:]), tf.TensorShape([process_set.size()])],
        )

        def grad(dy: tf.Tensor, *_: Any) -> tf.Tensor:
            [dy] = as_tensors([dy])
            [grad_name] = collective_names("Alltoall", [dy], None)
            sent_back = _alltoall_op(dy, received, False, grad_name, process_set)[0]
            return tf.concat([sent_back, tf.zeros_like(value[tf.shape(sent_back)[0] :])], 0)  # rows not sent: 0

        return (output, tf.stop_gradient(received)), grad

    return forward(x)


# ----------------------------------------------------------------------------- reducescatter
def _reducescatter_op(
    tensors: list[tf.Tensor], names: Names, op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet
) -> list[tf.Tensor]:
    """One op reduce-scattering every tensor; the gradient is the allgather of the shard gradients, scaled as
    Horovod's `_reducescatter_grad` does (by the set's size for Sum, and by both scale factors)."""
    check_member(process_set)

    def gradient(_: Sequence[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor]:
        scale = reducescatter_grad_scale(op, prescale, postscale, process_set.size())
        gathered = _allgather_op(dys, collective_names("Allgather", dys, None), process_set)
        return [g * tf.cast(scale, g.dtype) for g in gathered]

    return _resizing_op(
        "reducescatter",
        tensors,
        names,
        lambda a, d, n, g: core.submit_reducescatter(a, d, n, op, prescale, postscale, process_set, group=g),
        gradient,
    )


def _reducescatter_op_of(op: ReduceOp | None) -> ReduceOp:
    """The op, or the error Horovod's TF op fails with for Adasum (its enqueue returns Aborted), raised here on
    every rank before anything is submitted. Min, Max and Product are hvdplus's additions."""
    op = core.resolve_op(None, op)
    if op == ReduceOp.ADASUM:
        raise tf.errors.AbortedError(
            None,
            None,
            "Reducescatter currently only supports AVERAGE and SUM (hvdplus also Min, Max and Product), not Adasum",
        )
    return op


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Compressor = Compression.none,
    op: ReduceOp = ReduceOp.AVERAGE,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce `tensor` over the ranks and return this rank's rows of the result (Horovod's uneven split).

    Differentiable. Collective: every rank in the process set must call this, in the same order."""
    op = _reducescatter_op_of(op)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    inputs = as_tensors([compressed])
    names = collective_names("Reducescatter", inputs, name, ignore_name_scope)
    [shard] = _reducescatter_op(inputs, names, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(shard, ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Compressor = Compression.none,
    op: ReduceOp = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    """Reduce-scatter a list of tensors in one op. Differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    op = _reducescatter_op_of(op)
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    inputs = as_tensors([p[0] for p in pairs])
    shards = _reducescatter_op(
        inputs, collective_names("Reducescatter", inputs, None), op, prescale_factor, postscale_factor, process_set
    )
    return [compression.decompress(s, ctx) for s, (_, ctx) in zip(shards, pairs)]


# ----------------------------------------------------------------------------- join and barrier
def join() -> tf.Tensor:
    """Declare that this rank has no more batches; block until every rank has joined.

    Meanwhile this rank contributes zeros to the allreduces of the ranks still training.
    Returns the rank that joined last. Collective: every rank must call it once per epoch."""
    return execute(
        lambda: Completion([core.submit_join()], lambda results: [np.int32(results[0])]),
        [],
        [tf.int32],
        [tf.TensorShape([])],
    )[0]


def barrier(process_set: ProcessSet = global_process_set) -> tf.Operation | None:
    """Block until every rank of the process set reaches the barrier (in a graph: return the op that does)."""
    [done] = execute(
        lambda: Completion([core.submit_barrier(process_set)], lambda _: [np.int32(0)]),
        [],
        [tf.int32],
        [tf.TensorShape([])],
    )
    return None if tf.executing_eagerly() else done.op
