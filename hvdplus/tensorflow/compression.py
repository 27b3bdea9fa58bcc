"""`hvd.Compression` for TensorFlow tensors (none, fp16, and bf16 beyond Horovod)."""

from __future__ import annotations

import tensorflow as tf

from hvdplus.common.compression import Compressor, make_compression

__all__ = ["Compression", "Compressor"]


@tf.autograph.experimental.do_not_convert
def _is_floating(tensor: tf.Tensor) -> bool:
    return tensor.dtype.is_floating


@tf.autograph.experimental.do_not_convert
def _dtype_of(tensor: tf.Tensor) -> tf.DType:
    return tensor.dtype


@tf.autograph.experimental.do_not_convert
def _cast(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.cast(tensor, dtype)


Compression = make_compression(tf.float16, tf.bfloat16, _is_floating, _dtype_of, _cast)
"""Gradient compression for the wire: `Compression.none`, `Compression.fp16` (float16) and `Compression.bf16`
(bfloat16). Floating tensors are cast before the collective and back after it; other dtypes pass unchanged."""
