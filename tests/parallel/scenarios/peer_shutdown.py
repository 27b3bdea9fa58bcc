"""Rank 0 shuts down early; the others still know their rank and size, and a collective raises."""

import time

import torch

import hvdplus.torch as hvd

hvd.init()
hvd.allreduce(torch.ones(1), name="warmup")
if hvd.rank() == 0:
    hvd.shutdown()
else:
    deadline = time.monotonic() + 10
    while hvd.is_initialized() and time.monotonic() < deadline:  # the peer's shutdown stops our thread too
        time.sleep(0.05)
    try:
        hvd.allreduce(torch.ones(1), name="after.shutdown")
        print(f"rank {hvd.rank()}: no error")
    except hvd.HorovodInternalError as exc:
        print(f"rank {hvd.rank()}/{hvd.size()}: raised HorovodInternalError: {exc}")
