"""hvdplus.torch: horovod.torch's API on current PyTorch (`import hvdplus.torch as hvd`)."""

import importlib
import os
from typing import Any

# torch's CPU allocator keeps large tensors on 4 KiB pages unless THP_MEM_ALLOC_ENABLE=1 (numpy asks for huge pages
# by default): MPI moved a 16 MiB gradient 1.5x slower from such memory (docs/performance.md). torch reads the variable
# at its first allocation, so it is set on import, before any model exists; a value the user set wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
from hvdplus.common.collectives import allgather_object, broadcast_object
from hvdplus.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from hvdplus.common.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from hvdplus.torch import _half_kernels, device_plane, elastic
from hvdplus.torch.compression import Compression, Compressor
from hvdplus.torch.functions import broadcast_optimizer_state, broadcast_parameters
from hvdplus.torch.mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from hvdplus.torch.optimizer import DistributedOptimizer
from hvdplus.torch.sparse import sparse_allreduce_async
from hvdplus.torch.sync_batch_norm import SyncBatchNorm
from hvdplus.torch.zero.optimizer import ZeroOptimizer
from hvdplus.torch.zero.zero3 import gathered_parameters, shard_parameters
from hvdplus.torch.zero.zero3_checkpoint import (
    full_state_dict,
    load_full_checkpoint,
    load_full_state_dict,
    load_sharded_checkpoint,
    save_full_checkpoint,
    save_sharded_checkpoint,
)

_half_kernels.register()
device_plane.register()


def __getattr__(name: str) -> Any:
    """`hvd.pipeline` is imported on first use: torch.distributed.pipelining (for its B/W split) takes ~1.5 s."""
    if name == "pipeline":
        return importlib.import_module("hvdplus.torch.pipeline")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
