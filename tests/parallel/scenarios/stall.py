"""Rank 1 is late for a collective: rank 0 logs a warning naming it, then both complete."""

import time

import torch

import hvdplus.torch as hvd

hvd.init()
if hvd.rank() == 1:
    time.sleep(4)
out = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="late.tensor")
assert out.item() == hvd.size()
print(f"rank {hvd.rank()}: completed after the stall")
hvd.shutdown()
