"""The last rank dies without a word; the others must raise HorovodInternalError, not hang."""

import os
import time

import torch

import hvdplus.torch as hvd

hvd.init()
hvd.allreduce(torch.ones(1), name="warmup")
if hvd.rank() == hvd.size() - 1:
    os._exit(3)
start = time.monotonic()
try:
    hvd.allreduce(torch.ones(1), name="after.death")
except hvd.HorovodInternalError as exc:
    print(f"rank {hvd.rank()}: raised HorovodInternalError after {time.monotonic() - start:.1f} s: {exc}")
    os._exit(0)
print(f"rank {hvd.rank()}: no error")
os._exit(1)
