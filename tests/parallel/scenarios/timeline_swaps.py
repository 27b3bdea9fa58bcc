"""hvd.start_timeline()/stop_timeline() from a thread of rank 0, 30 times to 30 files, while every rank keeps
async allreduces and allgathers in flight: every result is right, every file is a valid Chrome trace, and the
job ends normally (the coordinator thread swaps timelines between its cycles and never writes a closed one)."""

import json
import os
import threading

import torch

import hvdplus.torch as hvd

SWAPS = 30
hvd.init()
rank, size = hvd.rank(), hvd.size()
folder = os.environ["TIMELINE_DIR"]
toggling = threading.Event()


def toggle() -> None:
    try:
        for i in range(SWAPS):
            hvd.start_timeline(os.path.join(folder, f"timeline{i}.json"), mark_cycles=i % 2 == 0)
            hvd.stop_timeline()
    finally:
        toggling.clear()


if rank == 0:
    toggling.set()
    toggler = threading.Thread(target=toggle)
    toggler.start()
steps = 0
while True:  # until rank 0's swaps are over: the ranks agree through the last allreduce of each step
    reduced = [
        hvd.allreduce_async(torch.full((3,), float(rank + k)), op=hvd.Sum, name=f"r{steps}.{k}") for k in range(3)
    ]
    gathered = hvd.allgather_async(torch.full((rank + 1, 2), float(rank)), name=f"g{steps}")
    go = hvd.allreduce(torch.tensor([float(rank == 0 and toggling.is_set())]), op=hvd.Sum, name=f"go{steps}")
    for k, handle in enumerate(reduced):
        assert torch.equal(hvd.synchronize(handle), torch.full((3,), float(sum(range(size)) + size * k)))
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
    assert torch.equal(hvd.synchronize(gathered), expected)
    steps += 1
    if go.item() == 0:
        break
if rank == 0:
    toggler.join()
    events = [json.load(open(os.path.join(folder, f"timeline{i}.json"))) for i in range(SWAPS)]
    print(
        f"{SWAPS} timelines valid over {steps} steps, "
        f"{sum(e.get('ph') == 'B' for trace in events for e in trace)} spans"
    )
hvd.shutdown()
print(f"rank {rank}: timeline swaps done")
