"""Rank 1 never submits 'late.tensor': with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS set, every rank's collectives fail
with an error that names the tensor and the missing rank."""

import time

import torch

import hvdplus.torch as hvd

hvd.init()
try:
    if hvd.rank() == 1:
        time.sleep(8)  # its background thread keeps answering control rounds; it just never submits
        hvd.allreduce(torch.ones(1), name="after.the.stall")
    else:
        hvd.allreduce(torch.ones(1), name="late.tensor")
    print(f"rank {hvd.rank()}: no error")
except hvd.HorovodInternalError as exc:
    print(f"rank {hvd.rank()}: raised {exc}")
