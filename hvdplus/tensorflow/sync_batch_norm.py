"""horovod.tensorflow.SyncBatchNormalization on Keras 3: batch statistics averaged over every rank in training."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvdplus.common.basics import size
from hvdplus.common.ops import ReduceOp
from hvdplus.tensorflow.mpi_ops import allreduce

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Synchronous batch normalization: in training, each batch is normalized with the mean and variance of the
    ranks' batches together (the average of their means and of their mean squares, as Horovod computes them).

    `fused` is Keras 2's argument, kept for scripts written for it: Keras 3 has no fused kernel, so `False` is
    accepted and ignored; `True` or `None` raise ValueError, as in Horovod.
    Collective in training: every rank must call the layer, in the same order."""

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        """This rank's moments (Keras' own computation), then averaged over the ranks: Var[X] = E[X^2] - E[X]^2."""
        mean, variance = super()._moments(inputs, mask)
        if size() == 1:
            return mean, variance
        stacked = tf.stack([mean, variance + tf.square(mean)])
        group_mean, group_mean_of_square = tf.unstack(allreduce(stacked, op=ReduceOp.SUM) / size())
        return group_mean, group_mean_of_square - tf.square(group_mean)
