"""Sparse gradients (allgather path and sparse_as_dense) and gradient groups, against one process on the full batch.

Written to pass at any world size; every test names its collectives with its own prefix."""

from __future__ import annotations

import pytest
import torch
from test_torch_optimizer import EXACT, make_model, named, reference_params, train_distributed

STEPS = 4
PER_RANK = 3
VOCAB = 12


def make_embedding_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(VOCAB, 4, sparse=True), "out": torch.nn.Linear(4, 2)})


def forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model["out"](model["emb"](tokens).mean(1))


def token_batches(size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches on every rank: size * PER_RANK rows of 5 tokens (repeats included) and targets."""
    generator = torch.Generator().manual_seed(99)
    return [
        (
            torch.randint(0, VOCAB, (size * PER_RANK, 5), generator=generator),
            torch.randn(size * PER_RANK, 2, generator=generator),
        )
        for _ in range(STEPS)
    ]


def train_embedding(hvd, prefix: str | None, **kwargs) -> list[torch.Tensor]:
    """SGD on the embedding model: one process on whole batches (prefix None), else this rank's rows."""
    model = make_embedding_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = slice(None)
    if prefix is not None:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named(model, prefix), **kwargs)
        rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
    for tokens, target in token_batches(hvd.size()):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(forward(model, tokens[rows]), target[rows]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_matches_single_process(hvd, sparse_as_dense):
    # float32, 4 SGD steps: only the summation order differs from the reference (see EXACT).
    got = train_embedding(hvd, f"sparse.train.{sparse_as_dense}", sparse_as_dense=sparse_as_dense)
    for g, want in zip(got, train_embedding(hvd, None)):
        torch.testing.assert_close(g, want, **EXACT)


def test_sparse_path_keeps_the_gradient_sparse(hvd):
    model = make_embedding_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named(model, "sparse.kept")
    )
    forward(model, torch.tensor([[hvd.rank() % VOCAB, 1]])).sum().backward()
    with optimizer.skip_synchronize():
        optimizer.synchronize()
        assert model["emb"].weight.grad.is_sparse and model["emb"].weight.grad.is_coalesced()
        optimizer.step()


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_sparse_allreduce_async_equals_the_dense_allreduce(hvd, op):
    dense = torch.zeros(6, 3)
    dense[hvd.rank() % 6] = hvd.rank() + 1.0
    dense[5] = 1.0  # every rank has row 5: the duplicates must be summed
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name=f"sparse.direct.{op}", op=getattr(hvd, op))
    got = handle() if op == "Sum" else hvd.synchronize(handle)  # Horovod's callable handle, or hvdplus's
    want = hvd.allreduce(dense, op=getattr(hvd, op), name=f"sparse.dense.{op}")
    assert got.is_sparse
    torch.testing.assert_close(got.to_dense(), want, rtol=1e-6, atol=1e-6)


def test_sparse_allreduce_rejects_dense_input_and_other_ops(hvd):
    with pytest.raises(TypeError, match="sparse COO tensor"):
        hvd.sparse_allreduce_async(torch.ones(2), name="sparse.bad", op=hvd.Sum)
    with pytest.raises(ValueError, match="op=Average and op=Sum"):
        hvd.sparse_allreduce_async(torch.ones(2).to_sparse(), name="sparse.bad", op=hvd.Max)


@pytest.mark.parametrize("groups", [1, 2, 100])
def test_num_groups_give_the_same_training(hvd, groups):
    for got, want in zip(train_distributed(hvd, f"groups.n{groups}", groups=groups), reference_params(hvd.size())):
        torch.testing.assert_close(got, want, **EXACT)


def test_deprecated_num_groups_and_accumulation(hvd):
    with pytest.warns(DeprecationWarning, match="num_groups"):
        params = train_distributed(hvd, "groups.deprecated", passes=2, num_groups=2)
    for got, want in zip(params, reference_params(hvd.size())):
        torch.testing.assert_close(got, want, **EXACT)


def test_listed_groups_and_an_unused_member(hvd):
    model = make_model()
    extra = torch.nn.Parameter(torch.ones(3))
    first, second = model[0], model[2]
    params = named(model, "groups.list") + [("groups.list.extra", extra)]
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD([p for _, p in params], lr=0.1),
        named_parameters=params,
        groups=[[first.weight, extra], [second.weight, second.bias]],
    )
    x = torch.full((2, 4), float(hvd.rank() + 1))
    model(x).sum().backward()  # `extra` is unused: its group starts in synchronize, with zeros for it
    grads = {}
    with optimizer.skip_synchronize():
        optimizer.synchronize()
        grads = {name: p.grad.clone() for name, p in params}
        optimizer.step()
    torch.testing.assert_close(grads["groups.list.extra"], torch.zeros(3))
    reference = make_model()
    for rank in range(hvd.size()):
        reference(torch.full((2, 4), float(rank + 1))).sum().backward()
    for (name, _), p in zip(named(model, "groups.list"), reference.parameters()):
        torch.testing.assert_close(grads[name], p.grad / hvd.size(), **EXACT)


def test_bad_groups_raise(hvd):
    model = make_model()
    params = list(model.parameters())
    for groups, message in (
        (0, "positive integer"),
        ("two", "positive integer"),
        ([[params[0], params[0]]], "only appear once"),
        ([params[0]], "list of lists"),
    ):
        with pytest.raises(ValueError, match=message):
            hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), groups=groups)
