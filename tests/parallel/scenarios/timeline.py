"""HOROVOD_TIMELINE: rank 0 writes a Chrome trace with Horovod's phases per tensor, valid JSON after every write.

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
hvd.allreduce(torch.ones(4), name="after.flush")
if hvd.rank() == 0:  # the job is still running: what is on disk parses and soon shows the last collective
    deadline, events = time.monotonic() + 10, []
    while not any(e.get("args", {}).get("name") == "allreduce.after.flush" for e in events):
        assert time.monotonic() < deadline, events[-20:]
        time.sleep(0.01)
        try:
            events = json.loads(open(os.environ["HOROVOD_TIMELINE"]).read())
        except json.JSONDecodeError:  # read in the middle of a write
            pass
    assert any(e.get("name") == "HIERARCHICAL_ALLREDUCE" for e in events), events[:20]
    print("valid while running:", len(events), "events")
hvd.shutdown()
print("timeline job done")
