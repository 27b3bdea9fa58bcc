"""A rank dies on the planned path, at the point named by argv[1]:

* `open`: rank 1 exits inside the engine's `open_planned`, while DistributedOptimizer freezes its plan (its peers
  are waiting for it to arrive in the new group);
* `step`: rank 1 exits before a planned step (its peers' planned allreduces wait for its buckets);
* `join`: rank 1 stops training after 3 steps and joins, serving the planned steps with zeros; rank 0 exits before
  its 5th step (rank 1 waits for it in a joined step, rank 2 in a planned allreduce).

Each survivor prints how long its training (and join) took to raise and what it said; the dead rank exits 3. The
job is run by the test harness, which, unlike hvdplusrun or mpirun, does not stop the survivors: they must stop
themselves."""

import os
import sys
import time

import torch

import hvdplus.torch as hvd
from hvdplus.common.basics import runtime

WHERE = sys.argv[1]
DEAD = 0 if WHERE == "join" else 1


def die(*args, **kwargs):
    print(f"rank {hvd.rank()}: exits in {WHERE}", flush=True)
    os._exit(3)


hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
if hvd.rank() == DEAD and WHERE == "open":
    runtime().engine.open_planned = die
start = time.monotonic()
try:
    for step in range(3 if WHERE == "join" and hvd.rank() == 1 else 6):
        if hvd.rank() == DEAD and step == 4:
            die()
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    if WHERE == "join":
        hvd.join()
    print(f"rank {hvd.rank()}: no error", flush=True)
except hvd.HorovodInternalError as exc:
    print(f"rank {hvd.rank()}: raised after {time.monotonic() - start:.1f} s: {exc}", flush=True)
os._exit(0)
