"""ZeroOptimizer as the job's first collective with HVDPLUS_DEVICE_PATH_ON_CPU=1: no negotiated step has built the
device plane yet, so its plan cannot freeze there (before, the freeze agreement died on an AssertionError on every
rank). Its steps must equal DistributedOptimizer's from the same start on the same data. Prints one JSON line per
rank: {"rank", "max_diff"}."""

import json

import torch

import hvdplus.torch as hvd


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for step in range(4):
        torch.manual_seed(100 * step + hvd.rank())  # each rank its own batch
        optimizer.zero_grad()
        net(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()


hvd.init()
sharded, replicated = model(), model()
train(sharded, hvd.ZeroOptimizer(torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9)))
train(
    replicated,
    hvd.DistributedOptimizer(
        torch.optim.SGD(replicated.parameters(), lr=0.1, momentum=0.9), named_parameters=replicated.named_parameters()
    ),
)
diff = max((a - b).abs().max().item() for a, b in zip(sharded.parameters(), replicated.parameters()))
print(json.dumps({"rank": hvd.rank(), "max_diff": diff}), flush=True)
hvd.shutdown()
