"""Horovod's own error texts that the worker tests of both frameworks expect, copied from its sources."""

# horovod/common/controller.cc ConstructResponse: once a rank of the set has joined, these collectives fail.
JOIN_ERRORS = {
    "allgather": "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using "
    "DistributedOptimizer",
    "alltoall": "Alltoall is not supported with Join at this time.",
    "reducescatter": "Reducescatter is not supported with Join at this time.",
    "broadcast": "Broadcast is not supported with Join at this time.",
}
