"""A tour of hvdplus.torch's collectives; run it with `mpirun -np 2 python examples/pytorch_collectives.py`.

Every rank prints what it holds after each collective, so the output shows what moved where.
"""

import torch

import hvdplus.torch as hvd


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(rank)
    engine = "MPI" if hvd.mpi_enabled() else "Gloo" if hvd.gloo_enabled() else "single process"
    say = lambda *parts: print(" ".join([f"[rank {rank}/{size}, {engine}]", *map(str, parts)]), flush=True)  # noqa: E731

    x = hvd.allreduce(torch.ones(3) * rank, op=hvd.Sum, name="x")
    say("allreduce(Sum) of ones*rank:", x.tolist())
    say(
        "allreduce(Average, fp16 on the wire):",
        hvd.allreduce(torch.full((2,), float(rank)), compression=hvd.Compression.fp16).tolist(),
    )
    say("allgather of rank+1 rows:", hvd.allgather(torch.full((rank + 1,), rank)).tolist())
    say("broadcast from the last rank:", hvd.broadcast(torch.tensor([rank]), root_rank=size - 1).tolist())
    out, received = hvd.alltoall(torch.arange(size) + 10 * rank, splits=[1] * size)
    say("alltoall (one element to each rank):", out.tolist(), "received splits", received.tolist())
    say("reducescatter(Sum) of 5 rows of ones:", hvd.reducescatter(torch.ones(5), op=hvd.Sum).tolist())
    handles = [hvd.allreduce_async(torch.ones(1024) * i, op=hvd.Sum, name=f"grad.{i}") for i in range(100)]
    total = sum(hvd.synchronize(h)[0].item() for h in handles)
    say(f"100 async allreduces fused in the background, sum of firsts = {total:g}")
    say("allgather_object:", hvd.allgather_object({"rank": rank}))
    try:
        hvd.allreduce(torch.ones(2 + rank), name="deliberately.mismatched")
    except hvd.HorovodInternalError as error:
        say("mismatched shapes raise on every rank:", error)
    hvd.shutdown()


if __name__ == "__main__":
    main()
