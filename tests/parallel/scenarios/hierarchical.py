"""Hierarchical allreduce over two (simulated) hosts equals the flat result, fused or not."""

import torch

import hvdplus.torch as hvd

hvd.init()
assert hvd.local_size() == 2 and hvd.cross_size() == 2, (hvd.local_size(), hvd.cross_size())
for count in (1, 7, 1000):
    x = torch.arange(count, dtype=torch.float32) * (hvd.rank() + 1)
    expected = torch.arange(count, dtype=torch.float32) * sum(r + 1 for r in range(hvd.size()))
    torch.testing.assert_close(hvd.allreduce(x, op=hvd.Sum, name=f"h{count}"), expected)
    torch.testing.assert_close(hvd.allreduce(x, name=f"avg{count}"), expected / hvd.size())
handles = [hvd.allreduce_async(torch.full((5,), float(i)), op=hvd.Sum, name=f"fused{i}") for i in range(20)]
for i, handle in enumerate(handles):
    assert torch.all(hvd.synchronize(handle) == i * hvd.size())
print(f"rank {hvd.rank()} local {hvd.local_rank()} cross {hvd.cross_rank()}: hierarchical ok")
hvd.shutdown()
