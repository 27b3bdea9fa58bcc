"""op=Adasum in allreduce and DistributedOptimizer, against Horovod's formula applied in one process.

On a power-of-two number of ranks the results must equal the recursive pairing (rank ^ 1, then rank ^ 2, ...);
on any other size every rank must get the same ValueError naming the size, and the job must go on."""

from __future__ import annotations

import pytest
import torch


def power_of_two(size: int) -> bool:
    return size & (size - 1) == 0


def formula(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Horovod's Adasum of two tensors, in float64: (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b."""
    a, b = a.double().flatten(), b.double().flatten()
    dot = a @ b
    return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b


def reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Recursive doubling: neighbours first (0+1, 2+3, ...), then the pairs of results, and so on."""
    while len(tensors) > 1:
        tensors = [formula(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]
    return tensors[0].flatten()


def rank_tensor(hvd, shape: tuple[int, ...], seed: int, dtype=torch.float32) -> tuple[torch.Tensor, list]:
    """This rank's random tensor and every rank's (generated locally from the rank's seed)."""
    every = [torch.randn(shape, generator=torch.Generator().manual_seed(seed + r)).to(dtype) for r in range(hvd.size())]
    return every[hvd.rank()], every


@pytest.fixture
def adasum_ok(hvd):
    if not power_of_two(hvd.size()):
        pytest.skip("Adasum runs on power-of-two rank counts")


def test_allreduce_matches_the_recursive_formula(hvd, adasum_ok):
    mine, every = rank_tensor(hvd, (4, 5), seed=10)
    got = hvd.allreduce(mine, op=hvd.Adasum, name="adasum.single")
    # float32 result of a float64 computation: one rounding (~6e-8 relative) per level.
    torch.testing.assert_close(got.double().flatten(), reference(every), rtol=1e-6, atol=1e-6)


def test_fused_tensors_keep_per_tensor_dots(hvd, adasum_ok):
    pairs = [rank_tensor(hvd, (n,), seed=100 * n) for n in (3, 17, 64)]
    handles = [hvd.allreduce_async(mine, op=hvd.Adasum, name=f"adasum.fused.{i}") for i, (mine, _) in enumerate(pairs)]
    for handle, (_, every) in zip(handles, pairs):
        torch.testing.assert_close(hvd.synchronize(handle).double(), reference(every), rtol=1e-6, atol=1e-6)


def test_fp16_adasum(hvd, adasum_ok):
    mine, every = rank_tensor(hvd, (32,), seed=7, dtype=torch.float16)
    got = hvd.allreduce(mine, op=hvd.Adasum, name="adasum.fp16")
    assert got.dtype == torch.float16
    # Each level rounds its float64 result to fp16 (2^-11 relative); two levels at most on 4 ranks.
    torch.testing.assert_close(got.double(), reference(every), rtol=2e-3, atol=2e-3)


def test_non_power_of_two_raises_on_every_rank(hvd):
    if power_of_two(hvd.size()):
        pytest.skip("needs a rank count that is not a power of two")
    for call in (
        lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="adasum.bad"),
        lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), op=hvd.Adasum),
    ):
        with pytest.raises(ValueError, match=f"power-of-two number of ranks in the process set, got {hvd.size()}"):
            call()
    torch.testing.assert_close(
        hvd.allreduce(torch.ones(3), op=hvd.Sum, name="adasum.after"), torch.full((3,), float(hvd.size()))
    )


def test_distributed_optimizer_applies_the_adasum_of_local_updates(hvd, adasum_ok):
    # Horovod's Adasum optimizer: every rank steps its optimizer on its own gradient, then the parameter
    # moves by the Adasum of the ranks' deltas. With plain SGD the delta of rank r is -lr * g_r.
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    start = [p.detach().clone() for p in model.parameters()]
    lr = 0.1
    inputs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(50 + r)) for r in range(hvd.size())]

    def local_grads(x: torch.Tensor) -> list[torch.Tensor]:
        probe = torch.nn.Linear(6, 3)
        probe.load_state_dict(dict(zip(["weight", "bias"], start)))
        probe(x).pow(2).mean().backward()
        return [p.grad.clone() for p in probe.parameters()]

    every = [local_grads(x) for x in inputs]
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        op=hvd.Adasum,
        named_parameters=[(f"adasum.opt.{n}", p) for n, p in model.named_parameters()],
    )
    assert isinstance(optimizer, torch.optim.SGD)
    optimizer.zero_grad()
    model(inputs[hvd.rank()]).pow(2).mean().backward()
    optimizer.step()
    for index, (param, origin) in enumerate(zip(model.parameters(), start)):
        delta = reference([-lr * grads[index] for grads in every]).view_as(origin)
        torch.testing.assert_close(param.detach().double(), origin.double() + delta, rtol=1e-6, atol=1e-6)
