"""Running a core collective from TensorFlow: numpy buffers in eager mode, one `tf.numpy_function` op in graphs.

Inside tf.function every collective is one stateful op; automatic control dependencies run stateful ops in
program order, so the collectives of a graph start in the same order on every rank (the core negotiates the
order anyway). Default names in graphs are `Horovod<Kind>` made unique in the graph being built, so they agree
across ranks without depending on execution order, tensor names or Keras' per-process layer counters. Eager
collectives without a name are numbered by the core in call order. Two tf.functions running concurrently must
not both use default names (each graph numbers its own); give one of them `name=`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from hvdplus.common.naming import member_names

__all__ = ["dtype_name", "storage", "values", "execute", "graph_name", "collective_names"]

_DTYPE_NAMES = {tf.uint8: "uint8", tf.int8: "int8", tf.uint16: "uint16", tf.int16: "int16", tf.int32: "int32",
                tf.int64: "int64", tf.float16: "float16", tf.bfloat16: "bfloat16", tf.float32: "float32",
                tf.float64: "float64", tf.bool: "bool"}
_BFLOAT16 = tf.bfloat16.as_numpy_dtype

Run = Callable[..., Sequence[np.ndarray]]


def dtype_name(dtype: tf.DType) -> str:
    """The core's name for a TensorFlow dtype, or TypeError naming the supported ones."""
    try:
        return _DTYPE_NAMES[tf.as_dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(f"hvdplus collectives do not support dtype {dtype}; supported: "
                        f"{', '.join(d.name for d in _DTYPE_NAMES)}") from None


def storage(array: np.ndarray) -> np.ndarray:
    """A contiguous host array the core can move (bfloat16 as its uint16 bits)."""
    array = np.asarray(array, order="C")
    return array.view(np.uint16) if array.dtype == _BFLOAT16 else array


def values(array: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of `storage`: the array as TensorFlow expects `dtype`."""
    return array.view(_BFLOAT16) if dtype == "bfloat16" else array


def execute(run: Run, inputs: Sequence[tf.Tensor], dtypes: Sequence[tf.DType],
            shapes: Sequence[tf.TensorShape]) -> list[tf.Tensor]:
    """`run(*numpy inputs) -> numpy outputs` now (eager) or as one graph op whose outputs get static `shapes`."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(run(*(t.numpy() for t in inputs)), dtypes)]
    outputs = tf.numpy_function(run, list(inputs), list(dtypes), stateful=True)
    for output, shape in zip(outputs, shapes):
        output.set_shape(shape)
    return outputs


def graph_name(base: str, ignore_name_scope: bool = True) -> str:
    """`base` made unique in the graph being built (prefixed by the current name scope unless ignored)."""
    graph = tf.compat.v1.get_default_graph()
    if not ignore_name_scope:
        return graph.unique_name(base)
    with graph.name_scope(None):
        return graph.unique_name(base)


def collective_names(kind: str, tensors: Sequence[tf.Tensor], name: str | None,
                     ignore_name_scope: bool = False) -> list[str | None]:
    """One name per tensor: in eager mode `name` (members numbered) or None for the core to number; in graphs
    `name` in the current name scope, or `Horovod<kind>` in the root scope, made unique in the graph.

    Default graph names use neither tensor names (a captured eager tensor is named after its id, which differs
    between ranks) nor name scopes (Keras scopes carry per-process layer counters)."""
    if tf.executing_eagerly():
        return member_names(name, len(tensors))
    if name is None:
        return [graph_name(f"Horovod{kind}") for _ in tensors]
    return member_names(graph_name(name, ignore_name_scope), len(tensors))
