"""The device plane (issue 15's GPU path) on CPU tensors over Gloo: the code CUDA tensors take on NCCL.

Run by tests/parallel/test_jobs.py with HVDPLUS_DEVICE_PATH_ON_CPU=1, beside the op and optimizer worker tests,
which then go through the same plane. These tests check that the plane really carried the tensors (torch buffers
end to end, the plane's engine calls counted, fusion on the plane) and the cases it handles differently from the
host path. Without the setting they do not apply and skip."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hvdplus.common.basics import runtime

pytestmark = pytest.mark.skipif(
    os.environ.get("HVDPLUS_DEVICE_PATH_ON_CPU") != "1", reason="the device-plane job sets HVDPLUS_DEVICE_PATH_ON_CPU=1"
)


def plane_runs() -> int:
    return runtime().coordinator.counters.plane_runs.get("torchgloo", 0)


def plane_tensors() -> int:
    return runtime().coordinator.counters.plane_tensors.get("torchgloo", 0)


@pytest.fixture
def plane_calls(monkeypatch) -> list[tuple[str, list[torch.Tensor]]]:
    """Every collective the plane's engine starts during the test, from any thread (the negotiated rounds' executor
    and the planned groups call the same methods): its kind and copies of its tensors as they were at its start (an
    allreduce's last one is what it sends: `send`, else the buffer it reduces in place).
    (Over Gloo a reduce-scatter is an allreduce inside: both are counted.)"""
    from hvdplus.common.engines.nccl import TorchTensorEngine

    calls: list[tuple[str, list[torch.Tensor]]] = []

    def spy(kind: str, start):
        def started(self, *args, **kwargs):
            calls.append((kind, [a.clone() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]))
            return start(self, *args, **kwargs)

        return started

    for kind in ("allreduce", "allgather", "broadcast", "reducescatter"):
        name = f"start_{kind}"
        monkeypatch.setattr(TorchTensorEngine, name, spy(kind, getattr(TorchTensorEngine, name)))
    return calls


def test_the_plane_is_built_at_its_first_collective(hvd):
    """Every rank agreed at init that it can use the plane; it is built (groups, engine) when the first
    collective of its device kind arrives, so a job that never sends such a tensor never builds it."""
    coordinator = runtime().coordinator
    assert coordinator.device_kinds == ("torchcpu",)
    hvd.allreduce(torch.ones(1), op=hvd.Sum, name="plane.first")
    assert coordinator.counters.built_planes == ("torchgloo",)


def test_allreduce_runs_on_the_plane_in_place(hvd):
    before = plane_runs()
    x = torch.full((6,), float(hvd.rank() + 1))
    pointer = x.data_ptr()
    out = hvd.allreduce_(x, op=hvd.Sum, name="plane.inplace")
    assert out.data_ptr() == pointer  # in place on the caller's tensor: no host copy in between
    assert out.tolist() == [hvd.size() * (hvd.size() + 1) / 2] * 6
    assert plane_runs() == before + 1


def test_grouped_allreduce_is_one_fused_call_on_the_plane(hvd):
    before = plane_runs()
    tensors = [torch.full((k + 1,), float(hvd.rank() + k)) for k in range(5)]
    results = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="plane.grouped")
    ranks = range(hvd.size())
    for k, result in enumerate(results):
        assert result.tolist() == [float(sum(r + k for r in ranks))] * (k + 1)
    assert plane_runs() == before + 1  # one packed request, one engine call


def test_async_allreduces_fuse_on_the_plane(hvd):
    runs, tensors = plane_runs(), plane_tensors()
    handles = [
        hvd.allreduce_async(torch.full((3,), float(i)), name=f"plane.fuse.{i}", op=hvd.Average) for i in range(16)
    ]
    assert [hvd.synchronize(h).tolist() for h in handles] == [[float(i)] * 3 for i in range(16)]
    assert plane_tensors() - tensors == 16
    assert plane_runs() - runs < 16  # some engine call on the plane carried several of them


def test_uneven_allgather_and_fused_allgathers(hvd):
    before = plane_runs()
    rows = hvd.rank() + 1
    out = hvd.allgather(torch.full((rows, 2), float(hvd.rank())), name="plane.gather")
    expected = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(hvd.size())])
    np.testing.assert_array_equal(out.numpy(), expected)
    gathered = hvd.grouped_allgather(
        [torch.full((rows,), float(hvd.rank())), torch.arange(2) + hvd.rank()], name="plane.gathers"
    )
    np.testing.assert_array_equal(gathered[1].numpy(), np.concatenate([np.arange(2) + r for r in range(hvd.size())]))
    assert plane_runs() >= before + 2


def test_reducescatter_alone_and_fused(hvd):
    before = plane_runs()
    n = hvd.size()
    x = torch.arange(2 * n + 1, dtype=torch.float32) + hvd.rank()
    full = sum(torch.arange(2 * n + 1, dtype=torch.float32) + r for r in range(n))
    counts = [len(part) for part in np.array_split(np.arange(2 * n + 1), n)]
    start = sum(counts[: hvd.rank()])
    mine = hvd.reducescatter(x, op=hvd.Sum, name="plane.rs")
    torch.testing.assert_close(mine, full[start : start + counts[hvd.rank()]])
    pair = hvd.grouped_reducescatter([x, x * 2], op=hvd.Average, name="plane.rs.group")
    torch.testing.assert_close(pair[1], 2 * full[start : start + counts[hvd.rank()]] / n)
    assert plane_runs() >= before + 2


def test_broadcast_from_a_nonzero_root(hvd):
    root = hvd.size() - 1
    x = torch.full((4,), float(hvd.rank()))
    assert hvd.broadcast(x, root_rank=root, name="plane.bcast").tolist() == [float(root)] * 4
    hvd.broadcast_(x, root_rank=0, name="plane.bcast_")
    assert x.tolist() == [0.0] * 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int16, torch.int32])
def test_half_and_narrow_integer_types_with_scaling(hvd, dtype):
    before = plane_runs()
    x = (torch.arange(5) + hvd.rank() * 2).to(dtype)
    out = hvd.allreduce(x, op=hvd.Average, name=f"plane.avg.{dtype}")
    assert plane_runs() == before + 1
    expected = sum((torch.arange(5) + r * 2).double() for r in range(hvd.size())) / hvd.size()
    if not dtype.is_floating_point:
        expected = expected.trunc()
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


def test_max_keeps_a_nan_from_any_rank(hvd):
    x = torch.tensor([1.0, float("nan") if hvd.rank() == hvd.size() - 1 else 2.0])
    before = plane_runs()
    out = hvd.allreduce(x, op=hvd.Max, name="plane.nan")
    assert out[0].item() == 1.0 and torch.isnan(out[1])
    assert plane_runs() == before + 1


def test_adasum_and_alltoall_stage_through_the_host(hvd):
    """Adasum and alltoall have no device-plane code: they stay on the host engine and still work."""
    x = torch.arange(2 * hvd.size(), dtype=torch.float32)
    out = hvd.alltoall(x, name="plane.alltoall")
    assert out.tolist() == [float(2 * hvd.rank() + k) for _ in range(hvd.size()) for k in range(2)]
    if hvd.size() & (hvd.size() - 1) == 0:  # Adasum needs a power-of-two set
        same = torch.ones(3)
        torch.testing.assert_close(hvd.allreduce(same, op=hvd.Adasum, name="plane.adasum"), same)


def test_sparse_allreduce_on_the_plane(hvd):
    before = plane_runs()
    dense = torch.zeros(4, 2)
    dense[hvd.rank() % 4] = 1.0
    out = hvd.sparse_allreduce_async(dense.to_sparse(), name="plane.sparse", op=hvd.Sum)
    expected = sum(torch.zeros(4, 2).index_fill_(0, torch.tensor([r % 4]), 1.0) for r in range(hvd.size()))
    torch.testing.assert_close(hvd.synchronize(out).to_dense(), expected)
    assert plane_runs() >= before + 1


def test_join_contributes_zeros_on_the_plane(hvd, plane_calls):
    """Rank 0 allreduces while the others have joined: every rank's part in it is an allreduce on the plane's
    engine, the joined ranks' of zeros the plane made (torch tensors, as rank 0's ones)."""
    if hvd.rank() == 0:
        out = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="plane.join")
        assert out.tolist() == [1.0] * 3  # the joined ranks sent zeros
    assert hvd.join() in range(hvd.size())
    assert plane_calls, "no collective started on the plane"
    kind, tensors = plane_calls[0]  # (once every rank joined, each runs the cached allreduces with zeros too)
    assert kind == "allreduce" and tensors[-1].tolist() == [1.0 if hvd.rank() == 0 else 0.0] * 3, plane_calls


def test_a_process_set_without_rank_0_on_the_plane(hvd):
    """The plane's groups exist for every process set: one of ranks 1.. (rank 0 outside) reduces, gathers,
    broadcasts and reduce-scatters on it."""
    rest = hvd.add_process_set(list(range(1, hvd.size())))
    try:
        if rest.included():
            before, members = plane_runs(), rest.ranks
            out = hvd.allreduce(
                torch.full((3,), float(hvd.rank())), op=hvd.Sum, name="plane.rest.sum", process_set=rest
            )
            assert out.tolist() == [float(sum(members))] * 3
            gathered = hvd.allgather(
                torch.full((hvd.rank(),), float(hvd.rank())), name="plane.rest.gather", process_set=rest
            )
            assert gathered.tolist() == [float(r) for r in members for _ in range(r)]
            root = members[-1]
            assert (
                hvd.broadcast(
                    torch.full((2,), float(hvd.rank())), root_rank=root, name="plane.rest.bcast", process_set=rest
                ).tolist()
                == [float(root)] * 2
            )
            shard = hvd.reducescatter(torch.ones(2 * len(members)), op=hvd.Sum, name="plane.rest.rs", process_set=rest)
            assert shard.tolist() == [float(len(members))] * 2
            assert plane_runs() == before + 4
        total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="plane.rest.after")  # the global set still works
        assert total.item() == hvd.size()
    finally:
        assert hvd.remove_process_set(rest)


@pytest.mark.parametrize("offload", [None, "optimizer"])
@pytest.mark.parametrize("without_rank_0", [False, True])
def test_zero_optimizer_reduces_and_gathers_on_the_plane(hvd, plane_calls, without_rank_0, offload):
    """ZeroOptimizer's bucket reduce-scatters and its parameters' allgathers travel on the plane, as CUDA
    parameters' do, on the whole job and on a process set without rank 0, with the optimizer offloaded or not;
    its steps equal DistributedOptimizer's on the same set (1e-6: SGD with momentum, the sums differ in order
    only)."""
    members = list(range(1, hvd.size())) if without_rank_0 else list(range(hvd.size()))
    process_set = hvd.add_process_set(members) if without_rank_0 else hvd.global_process_set
    try:
        if not process_set.included():
            return
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)))
        sharded, replicated = models
        tag = f"plane.zero.{int(without_rank_0)}.{offload}"
        zero = hvd.ZeroOptimizer(
            torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9),
            named_parameters=[(f"{tag}.{n}", p) for n, p in sharded.named_parameters()],
            process_set=process_set,
            offload=offload,
        )
        assert all(flat.offloaded == (offload is not None) for flat in zero._zero.flats)
        dist = hvd.DistributedOptimizer(
            torch.optim.SGD(replicated.parameters(), lr=0.1, momentum=0.9),
            named_parameters=[(f"{tag}.dist.{n}", p) for n, p in replicated.named_parameters()],
            process_set=process_set,
        )
        for step in range(3):
            torch.manual_seed(10 * step + hvd.rank())
            batch = torch.randn(4, 6)
            plane_calls.clear()
            zero.zero_grad()
            sharded(batch).square().mean().backward()
            zero.step()
            # Each step (the first negotiated, the next ones on the frozen plan's group) reduce-scatters its one
            # bucket and allgathers its one flat buffer on the plane's engine.
            kinds = [kind for kind, _ in plane_calls]
            assert kinds.count("reducescatter") == 1 and kinds.count("allgather") == 1, (step, kinds)
            dist.zero_grad()
            replicated(batch).square().mean().backward()
            dist.step()
        for a, b in zip(sharded.parameters(), replicated.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        plan = zero._zero.frozen
        assert (plan is not None) == (len(members) > 1)  # planned on the plane
        # its guard is a host word summed on the host engine: no read of a device element holds the step
        assert plan is None or (plan._guard is None and plan._guard_group is not None)
    finally:
        if without_rank_0:
            assert hvd.remove_process_set(process_set)
