"""horovod.keras's helpers for Keras 3: broadcast a model, reload a saved model wrapped, value collectives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.ops import ReduceOp
from hvdplus.keras.optimizer import DistributedOptimizer
from hvdplus.tensorflow import mpi_ops
from hvdplus.tensorflow.compression import Compression, Compressor
from hvdplus.tensorflow.functions import broadcast_assign

__all__ = ["broadcast_model", "broadcast_global_variables", "load_model", "allreduce", "allgather", "broadcast"]


def broadcast_model(
    model: keras.Model,
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    local_variables: Sequence[Any] = (),
) -> None:
    """Give every rank the root's model variables and optimizer state (building the optimizer if needed);
    `local_variables` of the model are left out (each rank keeps its own).

    Collective: every rank in the process set must call this, in the same order, with as many local variables."""
    local = {id(v) for v in local_variables}
    variables = [v for v in model.variables if id(v) not in local]
    broadcast_assign(variables, root_rank, process_set, "broadcast_model.variables")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        # A ZeroOptimizer's slots are this rank's shard: only its replicated variables (iterations, ...) travel.
        variables = getattr(optimizer, "replicated_variables", optimizer.variables)
        broadcast_assign(variables, root_rank, process_set, "broadcast_model.optimizer")


def broadcast_global_variables(root_rank: int, model: keras.Model | None = None) -> None:
    """Broadcast `model`'s variables and optimizer state from the root (Keras 3 has no global variables).

    Collective: every rank must call this, in the same order."""
    if model is None:
        raise RuntimeError(
            "Keras 3 keeps no global variable collection: call "
            "hvd.broadcast_global_variables(root_rank, model) or use "
            "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in model.fit"
        )
    broadcast_model(model, root_rank)


def load_model(
    filepath: str,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Compressor = Compression.none,
) -> keras.Model:
    """`keras.models.load_model`, then the model's optimizer (with its loaded state) wrapped in DistributedOptimizer.

    `custom_optimizers` are optimizer classes the file needs (added to `custom_objects` by class name)."""
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    model = keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression)
    return model


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: ReduceOp | None = None,
    compression: Compressor = Compression.none,
) -> np.ndarray:
    """Reduce a value (array, tensor or number) over the ranks and return it as a numpy array.

    Collective: every rank must call this, in the same order."""
    return np.asarray(
        mpi_ops.allreduce(
            tf.constant(value),
            average,
            compression=compression,
            op=op,
            name=name,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
    )


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    """Concatenate every rank's value along its first dimension; returns a numpy array.

    Collective: every rank must call this, in the same order."""
    return np.asarray(mpi_ops.allgather(tf.constant(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    """Return root's value on every rank as a numpy array. Collective: every rank must call this, in the same order."""
    return np.asarray(mpi_ops.broadcast(tf.constant(value), root_rank, name=name))
