"""horovod.tensorflow's helpers: broadcast variables and Python objects, ops for ranks and sizes."""

from __future__ import annotations

import importlib.util
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set, local_rank, local_size, rank
from hvdplus.common.data.pickled import pickled
from hvdplus.tensorflow._graph import VARIABLES_CHAIN, collective_names
from hvdplus.tensorflow.mpi_ops import broadcast_op

if TYPE_CHECKING:
    from tensorflow.compat.v1 import Session

__all__ = [
    "broadcast_variables",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
    "size_op",
    "process_set_included_op",
    "local_size_op",
    "rank_op",
    "local_rank_op",
    "gpu_available",
]


def broadcast_assign(
    variables: Sequence[Any], root_rank: int, process_set: ProcessSet, prefix: str | None
) -> tf.Operation | None:
    """Assign the root's values to `variables` with one broadcast op (in graphs on the chain of variable
    broadcasts, see _graph.py); returns the group of assignments in graphs."""
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    tensors = [tf.convert_to_tensor(v) for v in variables]
    received = broadcast_op(
        tensors, collective_names("Broadcast", tensors, prefix), root_rank, process_set, VARIABLES_CHAIN
    )
    return tf.group(*[v.assign(value) for v, value in zip(variables, received)])


def broadcast_variables(
    variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set, inplace: bool = False
) -> tf.Operation | None:
    """Overwrite each variable with the root's value (tf.Variable or Keras variable); returns the op in graphs.

    `root_rank` is a global rank (`hvd.rank()`), also with `process_set`.
    Collective: every rank in the process set must call this with the same variables, in the same order."""
    return broadcast_assign(variables, root_rank, process_set, None)


def broadcast_(
    variables: Sequence[Any], root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[tf.Tensor]:
    """In-place broadcast of variables: each receives the root's value (a global rank). Returns the variables'
    new values, as Horovod does: in a graph, tensors read after the assignments (fetching them broadcasts).

    Collective: every rank in the process set must call this, in the same order."""
    assigned = broadcast_assign(variables, root_rank, process_set, name)
    with tf.control_dependencies([] if assigned is None else [assigned]):
        return [tf.identity(v) for v in variables]


def broadcast_global_variables(root_rank: int) -> tf.Operation | None:
    """Broadcast every global variable of a TF1-style graph (tf.compat.v1); returns the op to run.

    Like Horovod, this needs graph mode: in eager mode (TF2's default) there is no global variable
    collection, so it raises with the replacement to use."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please use "
            "`hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Session | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Return a copy of the root's picklable `obj` on every member (the root is a global rank; `session` is
    accepted for Horovod and unused).

    Collective: every rank in the process set must call this, in the same order."""
    return core.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(
    root_rank: int = 0,
    session: Session | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Callable[[Any], Any]:
    """Build, once, the graph ops that broadcast a picklable object in a tf.compat.v1 session, and return the
    function `bcast(obj)` that runs them (the root's `obj` comes back on every member), as Horovod's TF1 elastic
    state does: one pair of broadcast ops fed through placeholders, however often it is called (each op on a
    chain of its own, see _graph.py, so that running one does not pull in the other's feed).

    `session` defaults to the default session. Collective: every member must call `bcast`, in the same order."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_object_fn() builds tf.compat.v1 graph ops and does not support eager execution; "
            "use hvd.broadcast_object(obj, root_rank) instead"
        )
    session = session or tf.compat.v1.get_default_session()
    if session is None:
        raise ValueError(
            "broadcast_object_fn needs a session: pass session=, or call it inside `with session.as_default():`"
        )
    root_rank = core.check_root(root_rank, process_set)
    name = name or "broadcast_object_fn"
    with session.graph.as_default():
        size_feed = tf.compat.v1.placeholder(tf.int64, [1], name="bcast_object_size")
        data_feed = tf.compat.v1.placeholder(tf.uint8, [None], name="bcast_object_data")
        [size_bcast, data_bcast] = [
            broadcast_op([feed], [f"{name}.{part}"], root_rank, process_set, chain=f"{name}.{part}")[0]
            for feed, part in ((size_feed, "sz"), (data_feed, "t"))
        ]

    def bcast(obj: Any) -> Any:
        payload = pickled(obj) if rank() == root_rank else None
        size = session.run(size_bcast, {size_feed: [0 if payload is None else payload.size]})
        data = session.run(data_bcast, {data_feed: payload if payload is not None else np.zeros(size, np.uint8)})
        return obj if payload is not None else pickle.loads(data.tobytes())

    return bcast


def allgather_object(
    obj: Any, session: Session | None = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Return the list of every rank's picklable `obj`, in rank order (`session` is unused).

    Collective: every rank in the process set must call this, in the same order."""
    return core.allgather_object(obj, name, process_set)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks of a process set (the global one by default) as an int32 tensor."""
    return tf.constant(core.process_set_size(process_set_id), tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this process is a member of a process set (the global one by default), else 0, as an int32 tensor;
    ValueError for an id that is not registered (Horovod's op returns an error code there)."""
    included = rank() in core.process_set_ranks(process_set_id)
    return tf.constant(int(included), tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this host as an int32 tensor."""
    return tf.constant(local_size(), tf.int32, name=name)


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank as an int32 tensor."""
    return tf.constant(rank(), tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host as an int32 tensor."""
    return tf.constant(local_rank(), tf.int32, name=name)


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework `ext_base_name` ("tensorflow", "torch" or "mxnet") sees a GPU in this process, as
    Horovod's `gpu_available` asks its extension for that framework (hvdplus stages TensorFlow tensors through host
    memory either way). `verbose` prints the answer, as Horovod does."""
    if ext_base_name not in ("tensorflow", "torch", "mxnet"):
        raise ValueError(f"ext_base_name must be 'tensorflow', 'torch' or 'mxnet', got {ext_base_name!r}")
    if ext_base_name == "tensorflow":
        available = bool(tf.config.list_physical_devices("GPU"))
    elif ext_base_name == "torch" and importlib.util.find_spec("torch") is not None:
        import torch

        available = torch.cuda.is_available()
    else:  # hvdplus has no MXNet adapter; torch not installed
        available = False
    if verbose:
        print(f"Extension {ext_base_name} {'was' if available else 'was NOT'} running with GPU.")
    return available
