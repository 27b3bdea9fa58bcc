"""HOROVOD_TIMELINE: rank 0 writes a Chrome trace with negotiation and op spans per tensor."""

import torch

import hvdplus.torch as hvd

hvd.init()
for step in range(3):
    hvd.allreduce(torch.ones(4), name="grad.w")
    hvd.allgather(torch.ones(1), name="gathered")
hvd.shutdown()
print("timeline job done")
