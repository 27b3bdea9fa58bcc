"""TensorFlow's float16/bfloat16 arithmetic for the core's reductions and scaling (numpy's is ~10x slower)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from hvdplus.common.data.halfops import has_fast_kernels, register_half_kernels
from hvdplus.common.ops import ReduceOp
from hvdplus.tensorflow._graph import values

_COMBINE: dict[ReduceOp, Callable[..., tf.Tensor]] = {
    ReduceOp.SUM: tf.add,
    ReduceOp.MIN: tf.minimum,
    ReduceOp.MAX: tf.maximum,
    ReduceOp.PRODUCT: tf.multiply,
}


def _write(result: tf.Tensor, storage: np.ndarray) -> None:
    """Copy a float16/bfloat16 result into the storage array (bfloat16 as its uint16 bits)."""
    np.copyto(storage, result.numpy().view(storage.dtype))


def _combiner(function: Callable[..., tf.Tensor], dtype: str) -> Callable[[np.ndarray, np.ndarray], None]:
    def combine(incoming: np.ndarray, inout: np.ndarray) -> None:
        _write(function(values(inout, dtype), values(incoming, dtype)), inout)

    return combine


def _scaler(dtype: str) -> Callable[[np.ndarray, float], None]:
    def scale(buf: np.ndarray, factor: float) -> None:
        flat = buf.reshape(-1)
        half = tf.constant(values(flat, dtype))
        _write(tf.cast(tf.cast(half, tf.float32) * np.float32(factor), half.dtype), flat)  # one rounding

    return scale


def register() -> None:
    """Hand TensorFlow's kernels to the core, unless another adapter's (torch's are faster) are there; idempotent."""
    for name in ("float16", "bfloat16"):
        if not has_fast_kernels(name, ReduceOp.SUM):
            register_half_kernels(name, {op: _combiner(fn, name) for op, fn in _COMBINE.items()}, _scaler(name))
