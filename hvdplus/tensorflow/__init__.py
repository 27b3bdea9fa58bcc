"""hvdplus.tensorflow: horovod.tensorflow's API on TensorFlow 2 (`import hvdplus.tensorflow as hvd`)."""

from typing import TYPE_CHECKING, Any

from hvdplus.common.basics import (
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hvdplus.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from hvdplus.common.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from hvdplus.tensorflow import _half_kernels, elastic, util
from hvdplus.tensorflow.compression import Compression, Compressor
from hvdplus.tensorflow.functions import (
    allgather_object,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    gpu_available,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from hvdplus.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from hvdplus.tensorflow.mpi_ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reducescatter,
)
from hvdplus.tensorflow.optimizer import DistributedOptimizer
from hvdplus.tensorflow.util import _cache, _executing_eagerly, _make_subgraph, refs_to_vars, vars_to_refs

if TYPE_CHECKING:  # what the lazy attribute below gives, for type checkers
    from hvdplus.tensorflow.sync_batch_norm import SyncBatchNormalization

_half_kernels.register()


def __getattr__(name: str) -> Any:
    """`hvd.SyncBatchNormalization` is imported on first use: it loads Keras, which TF-only programs need not."""
    if name == "SyncBatchNormalization":
        from hvdplus.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
