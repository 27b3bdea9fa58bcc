"""Every horovod.torch collective, checked against numpy references built from all ranks' inputs.

Written to pass at any world size; run by tests/parallel/test_jobs.py on 2 and 3 ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def rank_tensor(rank: int, shape=(3, 4), dtype=torch.float32) -> torch.Tensor:
    """Small exact values that differ per rank (sums and products stay representable in every dtype)."""
    values = (torch.arange(int(np.prod(shape))) % 3 + rank + 1).reshape(shape)
    return values.to(dtype)


def all_inputs(hvd, **kwargs) -> list[torch.Tensor]:
    return [rank_tensor(r, **kwargs) for r in range(hvd.size())]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_name", ["Sum", "Min", "Max", "Product", "Average"])
def test_allreduce_ops_and_dtypes(hvd, dtype, op_name):
    op = getattr(hvd, op_name)
    inputs = [t.double() for t in all_inputs(hvd, dtype=dtype)]
    stacked = torch.stack(inputs)
    expected = {
        "Sum": stacked.sum(0),
        "Min": stacked.min(0).values,
        "Max": stacked.max(0).values,
        "Product": stacked.prod(0),
        "Average": stacked.mean(0),
    }[op_name]
    if not dtype.is_floating_point and op_name == "Average":
        expected = expected.trunc()
    result = hvd.allreduce(rank_tensor(hvd.rank(), dtype=dtype), op=op, name=f"ar.{op_name}.{dtype}")
    assert result.dtype == dtype and result.shape == (3, 4)
    tolerance = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    torch.testing.assert_close(result.double(), expected, rtol=tolerance, atol=tolerance)


def test_allreduce_average_flag_and_scales(hvd):
    x = rank_tensor(hvd.rank())
    expected = torch.stack(all_inputs(hvd)).sum(0)
    torch.testing.assert_close(hvd.allreduce(x, average=False), expected)
    torch.testing.assert_close(hvd.allreduce(x, average=True), expected / hvd.size())
    scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    torch.testing.assert_close(scaled, expected * 0.5)
    with pytest.raises(ValueError, match="average and op"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_allreduce_inplace_async_and_grouped(hvd):
    x = rank_tensor(hvd.rank())
    expected = torch.stack(all_inputs(hvd)).sum(0)
    original = x.clone()
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="async")
    out = hvd.synchronize(handle)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, original)  # out-of-place leaves the input alone
    y = rank_tensor(hvd.rank())
    assert hvd.allreduce_(y, op=hvd.Sum) is y
    torch.testing.assert_close(y, expected)
    z = rank_tensor(hvd.rank())
    handle = hvd.allreduce_async_(z, op=hvd.Sum)
    while not hvd.poll(handle):
        pass
    torch.testing.assert_close(hvd.synchronize(handle), expected)
    torch.testing.assert_close(z, expected)
    group = hvd.grouped_allreduce([rank_tensor(hvd.rank()), rank_tensor(hvd.rank(), shape=(5,))], op=hvd.Sum)
    torch.testing.assert_close(group[1], torch.stack(all_inputs(hvd, shape=(5,))).sum(0))
    tensors = [rank_tensor(hvd.rank()), rank_tensor(hvd.rank(), shape=(2,))]
    hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    torch.testing.assert_close(tensors[0], expected)


def test_grouped_allreduce_is_one_packed_request(hvd):
    """A group of one dtype travels as one flat buffer: one core handle, results unpacked per tensor, gradients
    by one grouped allreduce; a group of mixed dtypes falls back to one request per tensor."""
    shapes = [(2, 3), (5,), (1,)]
    inputs = [rank_tensor(hvd.rank(), shape=shape) for shape in shapes]
    handle = hvd.grouped_allreduce_async(inputs, op=hvd.Sum, name="packed")
    assert handle.collectives == 1
    for got, shape in zip(hvd.synchronize(handle), shapes):
        torch.testing.assert_close(got, torch.stack(all_inputs(hvd, shape=shape)).sum(0))
    inplace = [t.clone() for t in inputs]
    assert hvd.grouped_allreduce_(inplace, op=hvd.Average)[0] is inplace[0]
    torch.testing.assert_close(inplace[1], torch.stack(all_inputs(hvd, shape=(5,))).mean(0))
    leaves = [torch.ones(shape, requires_grad=True) for shape in shapes]
    outputs = hvd.grouped_allreduce(leaves, op=hvd.Sum)
    sum((out * (hvd.rank() + 1)).sum() for out in outputs).backward()
    for leaf in leaves:
        torch.testing.assert_close(leaf.grad, torch.full_like(leaf, float(sum(range(1, hvd.size() + 1)))))
    mixed = hvd.grouped_allreduce_async([torch.ones(2), torch.ones(2, dtype=torch.float64)], op=hvd.Sum)
    assert mixed.collectives == 2
    assert [t.tolist() for t in hvd.synchronize(mixed)] == [[float(hvd.size())] * 2] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_named_blocking_group_packs_into_the_buffer_it_kept(hvd, dtype):
    """A named blocking in-place group reuses the buffer its last call kept (torch/packing.py), with the right
    result at every call, Average and scaling included; new shapes under the name get a new buffer; an
    asynchronous group and an unnamed one keep nothing. Under the device plane's simulation (CPU tensors on a
    device plane) nothing is kept: the buffers are for host tensors."""
    from hvdplus.torch.buffers import plane_kind
    from hvdplus.torch.packing import kept_buffers

    size, shapes, name = hvd.size(), [(2, 3), (5,), (1,)], f"kept.group.{dtype}"
    host = plane_kind(torch.zeros(1, dtype=dtype)) is None
    reuses = kept_buffers.reuses
    for step in range(3):
        tensors = [torch.full(shape, float(hvd.rank() + step), dtype=dtype) for shape in shapes]
        assert hvd.grouped_allreduce_(tensors, op=hvd.Sum, name=name)[0] is tensors[0]
        for tensor in tensors:
            assert torch.all(tensor == float(sum(range(size)) + size * step)), tensor
    assert kept_buffers.reuses - reuses == (2 if host else 0)
    scaled = [torch.full(shape, 2.0, dtype=dtype) for shape in shapes]
    hvd.grouped_allreduce_(scaled, op=hvd.Average, name=name, prescale_factor=0.5, postscale_factor=3.0)
    assert all(torch.all(t == 3.0) for t in scaled)
    assert kept_buffers.reuses - reuses == (3 if host else 0)
    reshaped = [torch.ones(4, dtype=dtype), torch.ones(2, 2, dtype=dtype)]
    hvd.grouped_allreduce_(reshaped, op=hvd.Sum, name=name)
    assert all(torch.all(t == float(size)) for t in reshaped)
    assert kept_buffers.reuses - reuses == (3 if host else 0)
    groups = len(kept_buffers)
    for _ in range(2):
        asynchronous = [torch.ones(3, dtype=dtype), torch.ones(2, dtype=dtype)]
        hvd.synchronize(hvd.grouped_allreduce_async_(asynchronous, op=hvd.Sum, name=f"{name}.async"))
        unnamed = [torch.ones(3, dtype=dtype), torch.ones(2, dtype=dtype)]
        hvd.grouped_allreduce_(unnamed, op=hvd.Sum)
        assert all(torch.all(t == float(size)) for t in asynchronous + unnamed)
        (alone,) = hvd.grouped_allreduce_([torch.full((3,), float(hvd.rank()), dtype=dtype)], op=hvd.Sum, name=name)
        assert torch.all(alone == float(sum(range(size))))  # a group of one: the plain blocking call
    assert kept_buffers.reuses - reuses == (3 if host else 0)
    assert len(kept_buffers) == groups  # none of those kept a buffer


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("op_name", ["Min", "Max"])
def test_min_and_max_propagate_nan_on_every_engine(hvd, dtype, op_name):
    """IEEE's rule, as torch.maximum: a NaN on any rank makes that element NaN (MPI's MAX drops it, Gloo's keeps
    it only from the first rank), in allreduce, fused or not, and in reducescatter."""
    size = hvd.size()
    values = rank_tensor(hvd.rank(), shape=(2 * size, 3), dtype=dtype)
    values[hvd.rank() % 2, hvd.rank()] = float("nan")  # rank r: element (r % 2, r)
    expected = torch.stack([rank_tensor(r, shape=(2 * size, 3)).double() for r in range(size)])
    expected = expected.min(0).values if op_name == "Min" else expected.max(0).values
    for r in range(size):
        expected[r % 2, r] = float("nan")
    op = getattr(hvd, op_name)
    alone = hvd.allreduce(values, op=op, name=f"nan.{op_name}.{dtype}")
    handles = [hvd.allreduce_async(values, op=op, name=f"nan.fused.{i}.{op_name}.{dtype}") for i in range(3)]
    fused = [hvd.synchronize(handle) for handle in handles]
    for result in [alone, *fused]:
        torch.testing.assert_close(result.double(), expected, equal_nan=True)
    shard = hvd.reducescatter(values, op=op, name=f"nan.rs.{op_name}.{dtype}")
    torch.testing.assert_close(shard.double(), expected[2 * hvd.rank() : 2 * hvd.rank() + 2], equal_nan=True)


def test_allreduce_non_contiguous_inplace(hvd):
    x = rank_tensor(hvd.rank(), shape=(4, 3)).t()
    assert not x.is_contiguous()
    hvd.allreduce_(x, op=hvd.Sum)
    torch.testing.assert_close(x, torch.stack(all_inputs(hvd, shape=(4, 3))).sum(0).t())


def test_many_small_tensors_fuse(hvd):
    handles = [
        hvd.allreduce_async(torch.full((1024,), float(i + hvd.rank())), op=hvd.Sum, name=f"small.{i}")
        for i in range(100)
    ]
    for i, handle in enumerate(handles):
        expected = sum(i + r for r in range(hvd.size()))
        assert torch.all(hvd.synchronize(handle) == expected)


def test_allreduce_compression(hvd):
    x = rank_tensor(hvd.rank()) / 7
    expected = torch.stack([t / 7 for t in all_inputs(hvd)]).mean(0)
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        result = hvd.allreduce(x, compression=compression)
        assert result.dtype == torch.float32
        torch.testing.assert_close(result, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES + [torch.bool])
def test_allgather_variable_first_dimension(hvd, dtype):
    mine = torch.full((hvd.rank() + 1, 2), hvd.rank() + 1).to(dtype)
    gathered = hvd.allgather(mine, name=f"ag.{dtype}")
    expected = torch.cat([torch.full((r + 1, 2), r + 1).to(dtype) for r in range(hvd.size())])
    assert gathered.dtype == dtype
    assert torch.equal(gathered, expected)


def test_grouped_allgather(hvd):
    a, b = hvd.grouped_allgather([torch.tensor([hvd.rank()]), torch.ones(hvd.rank() + 1)])
    assert a.tolist() == list(range(hvd.size()))
    assert b.numel() == sum(r + 1 for r in range(hvd.size()))


@pytest.mark.parametrize("dtype", DTYPES + [torch.bool])
def test_broadcast_from_every_root(hvd, dtype):
    for root in range(hvd.size()):
        x = rank_tensor(hvd.rank(), dtype=dtype)
        out = hvd.broadcast(x, root_rank=root, name=f"bc.{root}.{dtype}")
        assert torch.equal(out, rank_tensor(root, dtype=dtype))
        assert torch.equal(x, rank_tensor(hvd.rank(), dtype=dtype))
        hvd.broadcast_(x, root_rank=root)
        assert torch.equal(x, rank_tensor(root, dtype=dtype))


def test_alltoall_uneven_splits(hvd):
    n, me = hvd.size(), hvd.rank()
    splits = [(me + dst) % 3 for dst in range(n)]  # rows rank `me` sends to rank dst
    rows = sum(splits)
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 100 * me
    out, received = hvd.alltoall(x, splits=splits)
    expected_parts, expected_splits = [], []
    for src in range(n):
        src_splits = [(src + dst) % 3 for dst in range(n)]
        src_rows = sum(src_splits)
        src_x = torch.arange(src_rows * 2, dtype=torch.float32).reshape(src_rows, 2) + 100 * src
        start = sum(src_splits[:me])
        expected_parts.append(src_x[start : start + src_splits[me]])
        expected_splits.append(src_splits[me])
    assert received.tolist() == expected_splits
    assert torch.equal(out, torch.cat(expected_parts))


def test_alltoall_even_without_splits(hvd):
    x = torch.arange(hvd.size() * 3) + 10 * hvd.rank()
    out = hvd.alltoall(x)
    assert out.tolist() == [
        v for src in range(hvd.size()) for v in range(3 * hvd.rank() + 10 * src, 3 * hvd.rank() + 10 * src + 3)
    ]


@pytest.mark.parametrize("rows", [1, 5, 7])
def test_reducescatter_uneven(hvd, rows):
    n, me = hvd.size(), hvd.rank()
    inputs = all_inputs(hvd, shape=(rows, 2))
    total = torch.stack(inputs).sum(0)
    sizes = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    start = sum(sizes[:me])
    shard = hvd.reducescatter(inputs[me], op=hvd.Sum, name=f"rs.{rows}")
    torch.testing.assert_close(shard, total[start : start + sizes[me]])
    average = hvd.reducescatter(inputs[me], name=f"rs.avg.{rows}")
    torch.testing.assert_close(average, total[start : start + sizes[me]] / n)
    shards = hvd.grouped_reducescatter([inputs[me], inputs[me]], op=hvd.Sum)
    torch.testing.assert_close(shards[1], total[start : start + sizes[me]])


def test_autograd(hvd):
    n, me = hvd.size(), hvd.rank()
    x = rank_tensor(me).requires_grad_()
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, float(n)))  # allreduce of ones

    x = torch.ones(me + 1, 2, requires_grad=True)
    (hvd.allgather(x) * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))  # averaged gradient, own slice

    x = torch.ones(3, requires_grad=True)
    hvd.broadcast(x, root_rank=0).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3) if me == 0 else torch.zeros(3))

    x = torch.ones(2 * n, requires_grad=True)
    (hvd.alltoall(x) * (me + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([float(dst + 1) for dst in range(n) for _ in range(2)]))

    x = torch.ones(2 * n, 2, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum) * (me + 1)).sum().backward()  # Horovod's rule: size x the gathered grads
    torch.testing.assert_close(x.grad, torch.tensor([[float(n * (r + 1))] * 2 for r in range(n) for _ in range(2)]))

    x = torch.ones(2 * n, 2, requires_grad=True)
    with pytest.raises(NotImplementedError, match="gradient of reducescatter is defined for Average and Sum"):
        hvd.reducescatter(x, op=hvd.Max).sum().backward()


def test_objects_and_barrier(hvd):
    assert hvd.broadcast_object({"from": hvd.rank()}, root_rank=hvd.size() - 1) == {"from": hvd.size() - 1}
    assert hvd.allgather_object(("r", hvd.rank())) == [("r", r) for r in range(hvd.size())]
    hvd.barrier()


def test_process_sets(hvd):
    evens = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    try:
        if evens.included():
            out = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, process_set=evens)
            assert out.item() == sum(r for r in range(hvd.size()) if r % 2 == 0)
            assert evens.rank() == hvd.rank() // 2
            gathered = hvd.allgather(torch.tensor([hvd.rank()]), process_set=evens)
            assert gathered.tolist() == evens.ranks
        else:
            with pytest.raises(ValueError, match="not a member"):
                hvd.allreduce(torch.ones(1), process_set=evens)
        total = hvd.allreduce(torch.ones(1), op=hvd.Sum)  # the global set still works
        assert total.item() == hvd.size()
    finally:
        assert hvd.remove_process_set(evens)


def test_join_with_uneven_batches(hvd):
    """Rank r trains r + 1 batches; joined ranks contribute zeros to the others' allreduces."""
    me, n = hvd.rank(), hvd.size()
    for step in range(me + 1):
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"join.step.{step}")
        assert out.tolist() == [float(n - step)] * 2  # ranks with more than `step` batches
    assert hvd.join() == n - 1
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # usable afterwards
