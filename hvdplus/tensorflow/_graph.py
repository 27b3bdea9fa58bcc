"""Running a core collective from TensorFlow: numpy buffers in eager mode, a submit op and a wait op in graphs.

A collective is started by `start(*numpy inputs)`, which submits it to the core without blocking and returns its
`Completion` (common/handles.py, the handle the torch adapter returns too), whose `wait()` waits and returns the
numpy outputs. Eagerly both run at once. In a graph (tf.function, or a
tf.compat.v1 graph run by a Session) they are two stateful ops: a *submit* op returning an int64 token and a
*wait* op that takes the token and returns the outputs, then a *check* op that fails the step with Horovod's
FailedPrecondition when the ranks disagreed (see `_fail_on_mismatch`); the outputs depend on the check. Each wait
op has a control dependency on the previous check op of its chain: the collectives of one graph and control-flow
context, in creation order (so no wait starts after a collective of its chain failed).

Why: a `tf.numpy_function` is synchronous. An op that submitted and then waited held one of TensorFlow's
inter-op threads until its peers came; with several independent collectives in one `session.run`, each rank
could fill its threads with waits for collectives that the other rank, its own threads full of other waits,
had not submitted: both hung (with one thread at once, with TF's default count too). Horovod's kernels are
asynchronous and hold no thread while they wait.

Why one chain cannot deadlock, whatever order TF runs ready ops in and whatever its thread count, when every
rank runs the same graph with the same fetches (Horovod's rule): submit ops never block; only wait ops do, and
the chain runs its waits one at a time, in creation order. Suppose no rank can progress, and let rank A be
blocked in the wait at the smallest position w of any rank's blocked wait. Collective w is incomplete, so
some rank B has not submitted it. B is blocked in no wait: at a position p > w it would have finished wait w
(so w completed), and at p = w it would have run submit w (the wait consumes the submit's token). So no
thread of B is blocked. Submit w depends only on ops created before it; the waits among them are at positions
below w, whose collectives completed (A has passed their waits), so they return at once on B. B thus submits
w, the core completes it on its own thread (not TensorFlow's), and A moves on: a contradiction.
Inside a tf.function, TensorFlow's automatic control dependencies already run stateful ops in creation order;
the chain matters for tf.compat.v1 graphs and for graphs built without them (such as the backward function of
a tf.function differentiated by an outer tape).

What chains cost: fetching a collective also runs the collectives created before it in its chain (a control
dependency cannot be conditional). Broadcasts of variables are usually fetched on their own (`sess.run(bcast)`
before training), so they form a chain of their own, and the training step neither pulls them in nor is
pulled in by them. The argument above is per chain: a `session.run` that fetches collectives of several
chains (a variable broadcast together with other collectives, collectives inside a tf.compat.v1 cond or
while context) needs at least as many inter-op threads as chains.

Names: default names in graphs are `Horovod<Kind>` made unique in the graph being built, so they agree across
ranks without depending on execution order, tensor names or Keras' per-process layer counters. Eager
collectives without a name are numbered by the core in call order. Two tf.functions running concurrently must
not both use default names (each graph numbers its own); give one of them `name=`.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvdplus.common.exceptions import CollectiveMismatchError, HorovodInternalError
from hvdplus.common.handles import Completion
from hvdplus.common.naming import member_names

__all__ = [
    "dtype_name",
    "storage",
    "values",
    "Finish",
    "execute",
    "differentiable",
    "graph_name",
    "collective_names",
    "VARIABLES_CHAIN",
    "as_tf_error",
    "InvalidArgument",
]

_DTYPE_NAMES = {
    tf.uint8: "uint8",
    tf.int8: "int8",
    tf.uint16: "uint16",
    tf.int16: "int16",
    tf.int32: "int32",
    tf.int64: "int64",
    tf.float16: "float16",
    tf.bfloat16: "bfloat16",
    tf.float32: "float32",
    tf.float64: "float64",
    tf.bool: "bool",
}
_BFLOAT16 = tf.bfloat16.as_numpy_dtype

try:  # TensorFlow's own test of whether any GradientTape or forward accumulator records now (not a public API)
    from tensorflow.python.eager.record import could_possibly_record as _tape_may_record
except ImportError:  # another TensorFlow: every eager call keeps tf.custom_gradient
    _tape_may_record = None

Finish = Completion[Sequence[np.ndarray]]  # the core's handle shape, as in the torch adapter
Start = Callable[..., Finish]

VARIABLES_CHAIN = "variables"  # the chain of variable broadcasts (see the module docstring)

_pending: dict[int, Finish] = {}  # token -> the completion of a collective submitted by a graph's submit op
_tokens = itertools.count(1)
_last_wait: weakref.WeakKeyDictionary[Any, dict[Any, tf.Operation]] = weakref.WeakKeyDictionary()


def dtype_name(dtype: tf.DType) -> str:
    """The core's name for a TensorFlow dtype, or TypeError naming the supported ones."""
    try:
        return _DTYPE_NAMES[tf.as_dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(
            f"hvdplus collectives do not support dtype {dtype}; supported: {', '.join(d.name for d in _DTYPE_NAMES)}"
        ) from None


def storage(array: np.ndarray) -> np.ndarray:
    """A contiguous host array the core can move (bfloat16 as its uint16 bits)."""
    array = np.asarray(array, order="C")
    return array.view(np.uint16) if array.dtype == _BFLOAT16 else array


def values(array: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of `storage`: the array as TensorFlow expects `dtype`."""
    return array.view(_BFLOAT16) if dtype == "bfloat16" else array


def differentiable(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`tf.custom_gradient(forward)` (`forward(*inputs)` returns the outputs and their gradient function), except
    for an eager call that no tape or forward accumulator can record: that one runs `forward` alone and returns its
    outputs, sparing tf.custom_gradient's own cost (0.15-0.25 ms an eager call here, more than the rest of the
    op's TensorFlow work).

    The gradient function gets each output's gradient in that output's dtype: TensorFlow passes `output_gradients`
    of another dtype (float32 ones for a float64 output, as Horovod's tests do) through unchanged."""

    def with_output_dtypes(*inputs: Any) -> Any:
        outputs, gradient = forward(*inputs)
        dtypes = [output.dtype for output in tf.nest.flatten(outputs)]

        def cast_gradient(*dys: Any) -> Any:
            return gradient(*(dy if dy is None else tf.cast(dy, dtype) for dy, dtype in zip(dys, dtypes)))

        return outputs, cast_gradient

    def call(*inputs: Any) -> Any:
        if _tape_may_record is not None and tf.executing_eagerly() and not _tape_may_record():
            return forward(*inputs)[0]
        return tf.custom_gradient(with_output_dtypes)(*inputs)

    return call


def execute(
    start: Start,
    inputs: Sequence[tf.Tensor],
    dtypes: Sequence[tf.DType],
    shapes: Sequence[tf.TensorShape],
    chain: str = "",
) -> list[tf.Tensor]:
    """Run a collective now (eager), or add its submit and wait ops to the graph (outputs get static `shapes`);
    `chain` names the chain its wait joins (the default one, or VARIABLES_CHAIN)."""
    if tf.executing_eagerly():
        try:
            results = start(*(t.numpy() for t in inputs)).wait()
        except HorovodInternalError as exc:
            raise as_tf_error(exc) from exc
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, dtypes)]
    token = tf.numpy_function(
        functools.partial(_submit, start), list(inputs), tf.int64, stateful=True, name="HorovodSubmit"
    )
    token.set_shape([])
    graph = tf.compat.v1.get_default_graph()
    links = _last_wait.setdefault(graph, {})
    key = (graph._get_control_flow_context(), chain)  # v1 cond/while contexts cannot share control inputs
    with graph.control_dependencies([links[key]] if key in links else []):
        *outputs, keys, flags = tf.numpy_function(
            functools.partial(_wait, dtypes), [token], [*dtypes, tf.string, tf.int64], stateful=True, name="HorovodWait"
        )
        check = _fail_on_mismatch(keys, flags)
    links[key] = check  # the next wait of the chain runs only once this collective succeeded
    with graph.control_dependencies([check]):
        outputs = [tf.identity(output) for output in outputs]
    for output, shape in zip(outputs, shapes):
        output.set_shape(shape)
    return outputs


def _submit(start: Start, *arrays: np.ndarray) -> np.int64:
    """The submit op: start the collective, keep its completion under a new token."""
    finish = start(*arrays)
    token = next(_tokens)
    _pending[token] = finish
    return np.int64(token)


def _wait(dtypes: Sequence[tf.DType], token: np.ndarray) -> list[np.ndarray]:
    """The wait op: finish the collective that `token` stands for. Returns its outputs, then the keys and values
    for `_fail_on_mismatch`: the error's message twice with values 0 and 1 (and empty outputs) when the ranks
    disagreed, else two empty keys with values 0 and 0. Other errors raise."""
    try:
        return [*_pending.pop(int(token)).wait(), np.array([b"", b""]), np.zeros(2, np.int64)]
    except CollectiveMismatchError as exc:
        message = f"\n{exc}\n".encode()
        empty = (np.zeros(0, d.as_numpy_dtype) for d in dtypes)
        return [*empty, np.array([message, message]), np.array([0, 1], np.int64)]
    except HorovodInternalError as exc:
        raise as_tf_error(exc) from exc


def _fail_on_mismatch(keys: tf.Tensor, values: tf.Tensor) -> tf.Operation:
    """An op that fails with FailedPrecondition, naming the mismatch, when `_wait` reported one, as Horovod's
    kernels fail a collective the ranks disagreed on.

    Why a lookup table: a Python function in a graph can fail only with InvalidArgument (ValueError, TypeError),
    Unimplemented, OutOfRange, ResourceExhausted or Unknown (TensorFlow's py_func.cc). Initializing a fresh table
    with one key twice fails with FailedPrecondition whose message holds the key when the two values differ, and
    succeeds when they agree. The table does not depend on the wait, so only the initialization follows it."""
    table = tf.raw_ops.AnonymousHashTable(key_dtype=tf.string, value_dtype=tf.int64)
    return tf.raw_ops.InitializeTableV2(table_handle=table, keys=keys, values=values, name="HorovodCheck")


def as_tf_error(error: HorovodInternalError) -> HorovodInternalError:
    """A collective's error as TensorFlow raises a failed op's: Horovod's TF kernels fail with FailedPrecondition
    (its error responses), so `except tf.errors.OpError` works, and `except` of hvdplus's own class still does."""
    kind = _TF_ERRORS.get(type(error))
    if kind is None:
        kind = _TF_ERRORS[type(error)] = type(
            type(error).__name__, (tf.errors.FailedPreconditionError, type(error)), {"__module__": __name__}
        )
    converted = kind(None, None, str(error))
    converted.__traceback__ = error.__traceback__
    return converted


_TF_ERRORS: dict[type, type] = {}


class InvalidArgument(tf.errors.InvalidArgumentError, ValueError):
    """A bad argument found as a collective starts, as Horovod's enqueue reports one: tf.errors.InvalidArgumentError
    eagerly, and from a graph's op too (TensorFlow fails a Python op that raised a ValueError with InvalidArgument).
    A ValueError as well, hvdplus's type for bad input."""

    def __init__(self, message: str) -> None:
        super().__init__(None, None, message)


def graph_name(base: str, ignore_name_scope: bool = True) -> str:
    """`base` made unique in the graph being built (prefixed by the current name scope unless ignored)."""
    graph = tf.compat.v1.get_default_graph()
    if not ignore_name_scope:
        return graph.unique_name(base)
    with graph.name_scope(None):
        return graph.unique_name(base)


def collective_names(
    kind: str, tensors: Sequence[tf.Tensor], name: str | None, ignore_name_scope: bool = False
) -> list[str | None]:
    """One name per tensor: in eager mode `name` (members numbered) or None for the core to number; in graphs
    `name` in the current name scope, or `Horovod<kind>` in the root scope, made unique in the graph.

    Default graph names use neither tensor names (a captured eager tensor is named after its id, which differs
    between ranks) nor name scopes (Keras scopes carry per-process layer counters)."""
    if tf.executing_eagerly():
        return member_names(name, len(tensors))
    if name is None:
        return [graph_name(f"Horovod{kind}") for _ in tensors]
    return member_names(graph_name(name, ignore_name_scope), len(tensors))
