"""Horovod's semantics, as horovod.torch 0.28.1's sources define them, on every process set that matters.

Each test names the Horovod source it follows. Process sets: the global one and `rest`, every rank but 0
(at 2 ranks the odd one-member set {1}; at 3 ranks {1, 2}), so that a set's index and a global rank differ.
Written to pass at any world size >= 2; ranks outside a set only take part in the collectives of the job.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from hvdplus.common.exceptions import HorovodInternalError
from tests.parallel.horovod_messages import JOIN_ERRORS
from tests.parallel.process_sets import global_ranks, pset, rest  # noqa: F401 (fixtures)


def _job_still_works(hvd):
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name=None).item() == hvd.size()


# ----------------------------------------------------------------------------- 1. root ranks are global
def test_broadcast_roots_are_global_ranks(hvd, pset):
    """horovod/common/operations.cc EnqueueTensorBroadcast: root_rank is translated from a global rank
    (GetGlobalRankToControllerRank), whatever the process set."""
    if not pset.included():
        return
    root = global_ranks(hvd, pset)[-1]  # the highest member: a global rank, not an index into the set
    mine = torch.arange(4, dtype=torch.float32) + 10 * hvd.rank()
    expected = torch.arange(4, dtype=torch.float32) + 10 * root
    assert torch.equal(hvd.broadcast(mine, root_rank=root, process_set=pset), expected)
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(mine, root, process_set=pset)), expected)
    inplace = mine.clone()
    hvd.broadcast_(inplace, root_rank=root, process_set=pset)
    assert torch.equal(inplace, expected)
    inplace = mine.clone()
    hvd.synchronize(hvd.broadcast_async_(inplace, root, process_set=pset))
    assert torch.equal(inplace, expected)
    assert hvd.broadcast_object({"from": hvd.rank()}, root_rank=root, process_set=pset) == {"from": root}


def test_broadcast_parameters_and_optimizer_state_take_a_global_root(hvd, pset):
    if not pset.included():
        return
    root = global_ranks(hvd, pset)[-1]
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (hvd.rank() + 1), momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=root, process_set=pset)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root, process_set=pset)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (root + 1))
    state = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    gathered = hvd.allgather_object(([p.detach() for p in model.parameters()], state), process_set=pset)
    for params, buffers in gathered:
        for got, want in zip(params + buffers, gathered[0][0] + gathered[0][1]):
            assert torch.equal(got, want)


def test_broadcast_gradient_lands_on_the_global_root(hvd, pset):
    """HorovodBroadcast.backward: the averaged gradient where rank() == root_rank, zeros elsewhere."""
    if not pset.included():
        return
    root = global_ranks(hvd, pset)[-1]
    x = torch.full((3,), float(hvd.rank()), requires_grad=True)
    (hvd.broadcast(x, root_rank=root, process_set=pset) * (hvd.rank() + 1)).sum().backward()
    members = global_ranks(hvd, pset)
    average = sum(r + 1 for r in members) / len(members)
    assert x.grad.tolist() == [average if hvd.rank() == root else 0.0] * 3


def test_a_root_outside_the_set_raises_on_every_member(hvd, rest):
    """A root that is not a member raises ValueError naming the set's global ranks, on every member, before
    anything is submitted: the job goes on (no member waits for a peer that raised)."""
    if rest.included():
        for call in (
            lambda: hvd.broadcast(torch.ones(2), root_rank=0, process_set=rest),
            lambda: hvd.broadcast_(torch.ones(2), root_rank=0, process_set=rest),
            lambda: hvd.broadcast_async(torch.ones(2), root_rank=0, process_set=rest),
            lambda: hvd.broadcast_object("x", root_rank=0, process_set=rest),
            lambda: hvd.broadcast_parameters([torch.ones(1)], root_rank=0, process_set=rest),
            lambda: hvd.broadcast_optimizer_state(
                torch.optim.SGD([torch.ones(1, requires_grad=True)], lr=1), root_rank=0, process_set=rest
            ),
        ):
            with pytest.raises(ValueError, match=r"global .*ranks are \[" + ", ".join(map(str, rest.ranks))):
                call()
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=rest).item() == len(rest.ranks)
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.ones(2), root_rank=hvd.size())  # not a rank of the job at all
    _job_still_works(hvd)


# ----------------------------------------------------------------------------- 2. optimizer state, no gradients
class _ModelNoGrad(torch.nn.Module):
    """Horovod's test_broadcast_state_no_grad model: one parameter that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([0, 1, 1]), requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.a.long()) * x


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "distributed"])
def test_broadcast_optimizer_state_with_a_parameter_without_gradient(hvd, wrap):
    """horovod/torch/functions.py broadcast_optimizer_state: a new optimizer is initialized by a step on zero
    gradients of the parameters that require one; a frozen parameter keeps grad None and has no state."""
    torch.manual_seed(7)
    model = _ModelNoGrad()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    if wrap:
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=[(f"nograd.{n}", p) for n, p in model.named_parameters()]
        )
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    frozen, trained = optimizer.param_groups[0]["params"]
    assert frozen.grad is None and frozen not in optimizer.state
    assert torch.equal(trained.grad, torch.zeros_like(trained))
    assert torch.equal(hvd.broadcast(trained.grad, root_rank=0), trained.grad)
    assert float(optimizer.state[trained]["step"]) == 1.0
    before = trained.detach().clone()
    optimizer.zero_grad()
    model(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    assert not torch.equal(trained, before) and frozen.grad is None


def test_broadcast_optimizer_state_keeps_none_entries(hvd):
    """Optimizer state may hold None (here: a value the root set by hand); it travels as it is."""
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.5)
    param.grad = torch.ones(2)
    optimizer.step()
    optimizer.state[param]["extra"] = None if hvd.rank() == 0 else torch.ones(1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert optimizer.state[param]["extra"] is None
    assert torch.equal(optimizer.state[param]["momentum_buffer"], torch.ones(2))


def test_lbfgs_state_cannot_be_broadcast(hvd):
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(lbfgs, root_rank=0)


# ----------------------------------------------------------------------------- 3. reducescatter gradients
@pytest.mark.parametrize(
    "op_name,prescale,postscale", [("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Sum", 0.5, 3.0), ("Average", 2.0, 0.25)]
)
def test_reducescatter_gradient_follows_horovod(hvd, pset, op_name, prescale, postscale):
    """HorovodReducescatter.backward: grad *= size for Sum; *= prescale; *= postscale; then allgather."""
    if not pset.included():
        return
    op, n = getattr(hvd, op_name), len(global_ranks(hvd, pset))
    expected = (n if op_name == "Sum" else 1) * prescale * postscale
    x = torch.ones(2 * n + 1, 2, requires_grad=True)
    shard = hvd.reducescatter(x, op=op, process_set=pset, prescale_factor=prescale, postscale_factor=postscale)
    shard.sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, expected)), (x.grad, expected)

    xs = [torch.ones(n, 3, requires_grad=True), torch.ones(n + 2, requires_grad=True)]
    shards = hvd.grouped_reducescatter(
        xs, op=op, process_set=pset, prescale_factor=prescale, postscale_factor=postscale
    )
    sum(s.sum() for s in shards).backward()
    for tensor in xs:
        assert torch.allclose(tensor.grad, torch.full_like(tensor, expected))


def test_reducescatter_gradient_is_this_ranks_rows_of_the_allgather(hvd, pset):
    """The allgather in the gradient puts each member's output gradient at that member's rows."""
    if not pset.included():
        return
    members = global_ranks(hvd, pset)
    x = torch.zeros(len(members) + 1, requires_grad=True)  # member 0 gets two rows (Horovod's uneven split)
    shard = hvd.reducescatter(x, op=hvd.Average, process_set=pset)
    (shard * (hvd.rank() + 1)).sum().backward()
    rows = [2 if i == 0 else 1 for i in range(len(members))]
    expected = [float(r + 1) for r, count in zip(members, rows) for _ in range(count)]
    assert x.grad.tolist() == expected


# ----------------------------------------------------------------------------- 4. reducescatter with Adasum
def test_reducescatter_adasum_raises_horovods_error(hvd):
    """Horovod's enqueue returns Aborted("Reducescatter currently only supports AVERAGE and SUM"), which
    horovod.torch raises as HorovodInternalError. Raised at the call on every rank; the job goes on."""
    for call in (
        lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum),
        lambda: hvd.reducescatter_async(torch.ones(4), op=hvd.Adasum),
        lambda: hvd.grouped_reducescatter([torch.ones(4)], op=hvd.Adasum),
        lambda: hvd.grouped_reducescatter_async([torch.ones(4)], op=hvd.Adasum),
    ):
        with pytest.raises(HorovodInternalError, match="Adasum"):
            call()
    _job_still_works(hvd)


# ----------------------------------------------------------------------------- 5. sparse gradients
def _embedding_reference_step(hvd, sparse_as_dense: bool, steps: int = 3):
    """Train an Embedding with SparseAdam on every rank's indices; the same on one model with the loss of every
    rank averaged (the combined batch). Returns (distributed weight, reference weight, last gradient)."""
    torch.manual_seed(3)
    distributed, reference = torch.nn.Embedding(7, 3, sparse=True), torch.nn.Embedding(7, 3, sparse=True)
    reference.load_state_dict(distributed.state_dict())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(distributed.parameters(), lr=0.1),
        named_parameters=[(f"sparse.{sparse_as_dense}.w", distributed.weight)],
        sparse_as_dense=sparse_as_dense,
    )
    reference_optimizer = torch.optim.SparseAdam(reference.parameters(), lr=0.1)
    indices = [torch.tensor([r % 7, (r + step) % 7, 6]) for r in range(hvd.size()) for step in range(steps)]
    for step in range(steps):
        optimizer.zero_grad()
        distributed(indices[hvd.rank() * steps + step]).pow(2).sum().backward()
        optimizer.step()
        gradient = distributed.weight.grad
        reference_optimizer.zero_grad()
        loss = sum(reference(indices[r * steps + step]).pow(2).sum() for r in range(hvd.size())) / hvd.size()
        loss.backward()
        reference_optimizer.step()
    return distributed.weight.detach(), reference.weight.detach(), gradient


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_optimizer_gets_sparse_gradients(hvd, sparse_as_dense):
    """horovod/torch/optimizer.py synchronize: a sparse p.grad gets a sparse result (sparse_as_dense reduces a
    dense copy and converts it back), so SparseAdam steps; the result equals one model on the combined batch."""
    weight, reference, gradient = _embedding_reference_step(hvd, sparse_as_dense)
    assert gradient.is_sparse
    torch.testing.assert_close(weight, reference, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- 6. join with other collectives
# horovod/common/controller.cc ConstructResponse: once a rank of the set has joined, allgather, alltoall,
# reducescatter and broadcast fail on the ranks that submit them, with JOIN_ERRORS' messages; join() then completes.


def _collective(hvd, kind, pset, root):
    """Named: the joined rank skips it, so unnamed calls would get other automatic names on the other ranks."""
    tensor = torch.ones(2 * len(global_ranks(hvd, pset)), 3) * hvd.rank()
    name = f"join.{kind}.{root}"
    if kind == "broadcast":
        return hvd.broadcast(tensor, root_rank=root, process_set=pset, name=name)
    return getattr(hvd, kind)(tensor, process_set=pset, name=name)


@pytest.mark.parametrize("kind", sorted(JOIN_ERRORS))
def test_join_fails_other_collectives_and_the_runtime_goes_on(hvd, pset, kind):
    """Each member joins first in turn; every other member's collective fails with Horovod's message (a
    RuntimeError), every rank's join() returns the same last rank, and the next collective succeeds."""
    members = global_ranks(hvd, pset)
    for first in members:
        if pset.included() and hvd.rank() != first:
            root = next(r for r in members if r != first)
            with pytest.raises(RuntimeError, match=re.escape(JOIN_ERRORS[kind])) as raised:
                _collective(hvd, kind, pset, root)
            assert f"rank {first} called join()" in str(raised.value), str(raised.value)
        last = hvd.join()
        assert hvd.allgather_object(last) == [last] * hvd.size()
        _job_still_works(hvd)


# ----------------------------------------------------------------------------- the rest of the rank-dependent API
def _values(hvd, rank: int) -> torch.Tensor:
    return torch.tensor([rank + 1.0, 2.0 - rank, 0.5 * rank])


@pytest.mark.parametrize("op_name", ["Average", "Sum", "Min", "Max", "Product"])
def test_allreduce_family_on_every_set(hvd, pset, op_name):
    """mpi_ops.py allreduce*: op over the set's members; Average = postscale * sum(prescale * x) / size."""
    if not pset.included():
        return
    members, op = global_ranks(hvd, pset), getattr(hvd, op_name)
    stacked = torch.stack([_values(hvd, r) * 0.5 for r in members])  # prescale 0.5 applied per rank
    expected = {
        "Average": stacked.mean(0),
        "Sum": stacked.sum(0),
        "Min": stacked.min(0).values,
        "Max": stacked.max(0).values,
        "Product": stacked.prod(0),
    }[op_name] * 3.0
    kwargs = dict(op=op, prescale_factor=0.5, postscale_factor=3.0, process_set=pset)
    mine = _values(hvd, hvd.rank())
    torch.testing.assert_close(hvd.allreduce(mine, **kwargs), expected)
    torch.testing.assert_close(hvd.synchronize(hvd.allreduce_async(mine, **kwargs)), expected)
    inplace = mine.clone()
    hvd.allreduce_(inplace, **kwargs)
    torch.testing.assert_close(inplace, expected)
    inplace = mine.clone()
    hvd.synchronize(hvd.allreduce_async_(inplace, **kwargs))
    torch.testing.assert_close(inplace, expected)
    for result in (
        hvd.grouped_allreduce([mine, mine * 0 + 1], **kwargs),
        hvd.synchronize(hvd.grouped_allreduce_async([mine, mine * 0 + 1], **kwargs)),
    ):
        torch.testing.assert_close(result[0], expected)
    pair = [mine.clone(), mine.clone()]
    hvd.grouped_allreduce_(pair, **kwargs)
    torch.testing.assert_close(pair[1], expected)


def test_allreduce_average_flag_and_gradient(hvd, pset):
    """The deprecated average= flag means Average/Sum; HorovodAllreduce.backward allreduces the gradient with
    the same op and scale factors."""
    if not pset.included():
        return
    members, mine = global_ranks(hvd, pset), _values(hvd, hvd.rank())
    total = torch.stack([_values(hvd, r) for r in members]).sum(0)
    torch.testing.assert_close(hvd.allreduce(mine, average=False, process_set=pset), total)
    torch.testing.assert_close(hvd.allreduce(mine, average=True, process_set=pset), total / len(members))
    with pytest.raises(ValueError, match="average and op"):
        hvd.allreduce(mine, average=True, op=hvd.Sum, process_set=pset)
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, process_set=pset) * (hvd.rank() + 1)).sum().backward()
    expected = 2.0 * sum(r + 1 for r in members)
    torch.testing.assert_close(x.grad, torch.full((3,), expected))


def test_allgather_family_and_gradient(hvd, pset):
    """allgather concatenates members' rows (first dimensions may differ); HorovodAllgather.backward averages
    the gradient over the set and returns this rank's rows."""
    if not pset.included():
        return
    members = global_ranks(hvd, pset)
    mine = torch.full((hvd.rank() + 1, 2), float(hvd.rank()))
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in members])
    assert torch.equal(hvd.allgather(mine, process_set=pset), expected)
    assert torch.equal(hvd.synchronize(hvd.allgather_async(mine, process_set=pset)), expected)
    pair = hvd.grouped_allgather([mine, mine[:, :1]], process_set=pset)
    assert torch.equal(pair[0], expected) and torch.equal(pair[1], expected[:, :1])
    assert torch.equal(hvd.synchronize(hvd.grouped_allgather_async([mine], process_set=pset))[0], expected)
    x = torch.ones(hvd.rank() + 1, 2, requires_grad=True)
    weights = torch.cat([torch.full((r + 1, 2), float(hvd.rank() + 1)) for r in members])
    (hvd.allgather(x, process_set=pset) * weights).sum().backward()
    average = sum(r + 1 for r in members) / len(members)
    torch.testing.assert_close(x.grad, torch.full_like(x, average))
    assert hvd.allgather_object(("r", hvd.rank()), process_set=pset) == [("r", r) for r in members]


def test_alltoall_returns_received_splits_only_when_given_splits(hvd, pset):
    """alltoall(tensor) returns the output; alltoall(tensor, splits) returns (output, received_splits);
    HorovodAlltoall.backward is the alltoall of the gradient with the received splits."""
    if not pset.included():
        return
    members, me = global_ranks(hvd, pset), pset.rank()
    n = len(members)
    even = torch.arange(2 * n, dtype=torch.float32) + 100 * hvd.rank()
    out = hvd.alltoall(even, process_set=pset)
    assert torch.is_tensor(out) and out.tolist() == [100.0 * r + 2 * me + k for r in members for k in range(2)]
    splits = [i + 1 for i in range(n)]  # member i receives i + 1 rows from everyone
    rows = torch.full((sum(splits),), float(hvd.rank()), requires_grad=True)
    output, received = hvd.alltoall(rows, splits=splits, process_set=pset)
    assert received.tolist() == [me + 1] * n
    assert output.tolist() == [float(r) for r in members for _ in range(me + 1)]
    (output * (hvd.rank() + 1)).sum().backward()
    assert rows.grad.tolist() == [float(r + 1) for i, r in enumerate(members) for _ in range(splits[i])]
    output, received = hvd.synchronize(hvd.alltoall_async(rows.detach(), splits=torch.tensor(splits), process_set=pset))
    assert received.tolist() == [me + 1] * n


def test_reducescatter_splits_rows_as_horovod(hvd, pset):
    """The first dim0 % size members get one row more (Horovod's uneven split); Average by default."""
    if not pset.included():
        return
    members, me = global_ranks(hvd, pset), pset.rank()
    n = len(members)
    rows = 2 * n + 1
    mine = torch.arange(rows, dtype=torch.float32).unsqueeze(1) * (hvd.rank() + 1)
    counts = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
    start = sum(counts[:me])
    scale = sum(r + 1 for r in members) / n
    expected = torch.arange(start, start + counts[me], dtype=torch.float32).unsqueeze(1) * scale
    torch.testing.assert_close(hvd.reducescatter(mine, process_set=pset), expected)
    torch.testing.assert_close(hvd.synchronize(hvd.reducescatter_async(mine, process_set=pset)), expected)
    [grouped] = hvd.grouped_reducescatter([mine], process_set=pset)
    torch.testing.assert_close(grouped, expected)
    [grouped] = hvd.synchronize(hvd.grouped_reducescatter_async([mine], process_set=pset))
    torch.testing.assert_close(grouped, expected)


def test_barrier_poll_and_synchronize_on_a_set(hvd, pset):
    if not pset.included():
        return
    """poll() turns True once the collective is done; synchronize() releases the handle (Horovod's handle
    manager then raises ValueError for it)."""
    hvd.barrier(process_set=pset)
    handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, process_set=pset)
    deadline = time.monotonic() + 30
    while not hvd.poll(handle):
        assert time.monotonic() < deadline, "poll() never turned True"
        time.sleep(0.001)
    assert hvd.synchronize(handle).tolist() == [float(len(global_ranks(hvd, pset)))] * 2
    with pytest.raises(ValueError, match="unknown or was already synchronized"):
        hvd.poll(handle)
