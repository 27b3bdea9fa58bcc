"""A rank pauses between planned steps for longer than HVDPLUS_TIMEOUT (a checkpoint, say) while the others start
the next step's buckets: the step waits for it and completes, and the stall check names the wait."""

import time

import torch

import hvdplus.torch as hvd

hvd.init()
model = torch.nn.Linear(4, 2)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
for step in range(4):
    if step == 2 and hvd.rank() == 1:
        time.sleep(4)  # longer than the job's engine timeout
    optimizer.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
planned = optimizer._reducer is not None
mine = model.weight.detach().clone()
agree = torch.allclose(hvd.allreduce(mine, op=hvd.Average, name="check"), mine)
print(f"rank {hvd.rank()}: planned {planned}, steps done, weights agree {agree}")
hvd.shutdown()
