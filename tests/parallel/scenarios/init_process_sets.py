"""hvd.init(process_sets=...) as Horovod's test_process_sets_static and _multi_comm use it: duplicates raise
ValueError (after the others are registered), a second init with valid sets gets their ids, sets built from
MPI communicators (their ranks differ by rank) are registered once per group, and the same ProcessSet objects
work again in a later init after a shutdown."""

import os

import torch

on_mpi = os.environ.get("HOROVOD_CPU_OPERATIONS") == "mpi"
if on_mpi:
    import mpi4py

    mpi4py.rc.initialize = False  # as Horovod's test: hvdplus initializes MPI

import hvdplus.torch as hvd  # noqa: E402


def raises_value_error(**kwargs) -> str:
    try:
        hvd.init(**kwargs)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"init({kwargs}) accepted duplicates")


size = int(os.environ["TEST_SIZE"])
first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(range(size - 1, 0, -1))  # listed in any order
everyone = hvd.ProcessSet(range(size))  # the global set's ranks
message = raises_value_error(process_sets=[first, rest, everyone, hvd.ProcessSet([0])])
assert "entry number 2 is a duplicate" in message, message
hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet(range(1, size))])  # registered by the first call
again_first, again_rest = hvd.ProcessSet([0]), hvd.ProcessSet(range(1, size))
hvd.init(process_sets=[again_first, again_rest])
assert (again_first.process_set_id, again_rest.process_set_id) == (1, 2), (again_first, again_rest)
mine = again_first if hvd.rank() == 0 else again_rest
assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine).item() == mine.size()
hvd.shutdown()

if on_mpi:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    half = world.Split(color=world.rank % 2, key=world.rank)
    evens = list(range(0, size, 2))
    message = raises_value_error(comm=world, process_sets=[hvd.ProcessSet(half), hvd.ProcessSet(half.Dup())])
    assert "entry number 1 is a duplicate" in message, message
    message = raises_value_error(comm=world, process_sets=[hvd.ProcessSet(half), hvd.ProcessSet(world.Dup())])
    assert "entry number 1 is a duplicate" in message, message
    mine_by_comm = hvd.ProcessSet(half)
    if hvd.rank() % 2 == 0:  # [0, 2, ...] is this rank's communicator's group: a duplicate here only
        assert "duplicate" in raises_value_error(comm=world, process_sets=[mine_by_comm, hvd.ProcessSet(evens)])
    else:
        hvd.init(comm=world, process_sets=[mine_by_comm, hvd.ProcessSet(evens)])
    assert mine_by_comm.ranks == list(range(hvd.rank() % 2, size, 2)), mine_by_comm
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine_by_comm).item()
    assert total == mine_by_comm.size(), total
    hvd.shutdown()  # MPI stays initialized until the process exits
    hvd.init()  # a later init cannot gather every rank's communicator: one not registered yet is refused
    message = raises_value_error(comm=world, process_sets=[hvd.ProcessSet(half)])
    assert "built from an MPI communicator and is not registered" in message, message
    hvd.shutdown()

hvd.init()
hvd.init(process_sets=[again_first, again_rest])  # the same objects, in a later init of a new job: registered
assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine).item() == mine.size()
hvd.shutdown()
print("init process sets ok")
