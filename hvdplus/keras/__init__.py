"""hvdplus.keras: horovod.keras's API on Keras 3 with the TensorFlow backend (`import hvdplus.keras as hvd`)."""

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
from hvdplus.keras import callbacks, elastic
from hvdplus.keras.functions import (
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    broadcast_model,
    load_model,
)
from hvdplus.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hvdplus.keras.zero import ZeroOptimizer
from hvdplus.tensorflow.compression import Compression, Compressor
from hvdplus.tensorflow.functions import allgather_object, broadcast_object
