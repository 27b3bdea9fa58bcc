"""HOROVOD_TIMELINE: rank 0 writes a Chrome trace with Horovod's phases per tensor, valid JSON at every flush.

Run on 2 simulated hosts with HOROVOD_HIERARCHICAL_ALLREDUCE=1, so the allreduce shows its sub-steps."""

import json
import os
import time

import torch

import hvdplus.torch as hvd

hvd.init()
for _ in range(3):
    hvd.allreduce(torch.ones(4), name="grad.w")
    hvd.allgather(torch.ones(1), name="gathered")
    handles = [hvd.allreduce_async(torch.ones(3), name=f"fused.{i}") for i in range(3)]
    [hvd.synchronize(h) for h in handles]
if hvd.rank() == 0:  # the job is still running: what is on disk already parses
    time.sleep(1.2)
hvd.allreduce(torch.ones(4), name="after.flush")  # a cycle after the flush interval writes the events
if hvd.rank() == 0:
    events = json.loads(open(os.environ["HOROVOD_TIMELINE"]).read())
    assert any(e.get("name") == "HIERARCHICAL_ALLREDUCE" for e in events), events[:20]
    print("valid while running:", len(events), "events")
hvd.shutdown()
print("timeline job done")
