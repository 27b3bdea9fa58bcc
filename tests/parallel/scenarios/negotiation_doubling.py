"""New collectives negotiated by recursive doubling (HVDPLUS_NEGOTIATION_DOUBLING_RANKS=2) over a real engine:
sums, allgathers of different lengths, broadcasts, process sets and mismatch errors all behave as with the
allgather exchange, and the doubling path really ran."""

import torch

import hvdplus.common.control.announcements as announcements
import hvdplus.torch as hvd

calls = []
real_doubling = announcements._recursive_doubling


def counted(*args):
    calls.append(1)
    return real_doubling(*args)


announcements._recursive_doubling = counted  # instrument the real function: count, then run it

pair = hvd.ProcessSet([1, 2])
hvd.init(process_sets=[pair])
rank, size = hvd.rank(), hvd.size()
names = [f"grad.{i}" for i in range(20)]
order = names[rank:] + names[:rank]  # each rank submits in its own order
handles = {
    name: hvd.allreduce_async(torch.full((3,), float(int(name.split(".")[1]) + rank)), op=hvd.Sum, name=name)
    for name in order
}
for name, handle in handles.items():
    index = int(name.split(".")[1])
    assert hvd.synchronize(handle).tolist() == [float(size * index + sum(range(size)))] * 3, name
gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="ragged")
assert gathered.shape == (sum(range(1, size + 1)), 2)
assert hvd.broadcast(torch.tensor([float(rank)]), root_rank=size - 1, name="b").item() == size - 1
if rank in (1, 2):
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="pair", process_set=pair).item() == 2
try:
    hvd.allreduce(torch.ones(2 if rank == 1 else 3), name="mismatch")
except Exception as exc:  # CollectiveMismatchError on every rank, naming rank 1
    assert "rank 1 has (2,)" in str(exc), exc
    print(f"rank {rank}: mismatch raised")
assert calls, "recursive doubling never ran"
print(f"rank {rank}: doubling ok after {len(calls)} exchanges")
hvd.shutdown()
