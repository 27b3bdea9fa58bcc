"""A failure inside one rank's background thread, injected at the point named by argv[1]:

* `cycle`: rank 1's coordinator raises while it takes its queued work, before the control round (the peers wait
  for it in that round);
* `execute`: rank 1's executor raises while it runs an allgather, before its engine call (the peers wait for it
  inside the allgather).

Every rank prints how long its call took to raise and what it said, and that a later collective raises too (the
runtime stopped on every rank, and says why). The others exit 0; rank 1 exits 1 after 5 s, which under mpirun ends
the job: so are released the peers blocked inside an MPI data collective that rank 1 never joined."""

import os
import sys
import time

import torch

import hvdplus.torch as hvd
from hvdplus.common.basics import runtime

WHERE = sys.argv[1]


def injected(*args, **kwargs):
    raise RuntimeError(f"injected failure in {WHERE}")


hvd.init()
hvd.allreduce(torch.ones(1), name="warmup")
if hvd.rank() == 1:
    coordinator = runtime().coordinator
    if WHERE == "cycle":
        coordinator._world._agreement.announce = injected
    else:
        coordinator._world.executor.run_allgather = injected
start = time.monotonic()
try:
    hvd.allgather(torch.ones(2, 3), name="victim")
    print(f"rank {hvd.rank()}: no error", flush=True)
    os._exit(2)
except hvd.HorovodInternalError as exc:
    print(f"rank {hvd.rank()}: raised after {time.monotonic() - start:.1f} s: {exc}", flush=True)
try:
    hvd.allreduce(torch.ones(1), name="later")
    print(f"rank {hvd.rank()}: later call ran", flush=True)
except hvd.HorovodInternalError as exc:
    print(f"rank {hvd.rank()}: later call raised: {exc}", flush=True)
if hvd.rank() == 1:
    time.sleep(5)
    os._exit(1)
os._exit(0)
