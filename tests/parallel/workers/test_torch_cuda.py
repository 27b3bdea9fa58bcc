"""CUDA tensors on the NCCL device plane: results stay on the GPU, ordered by CUDA events, not host staging.

Needs a CUDA device; elsewhere every test skips with that reason (CI has no GPU; the same code runs on CPU tensors
in test_torch_device_plane.py). NCCL refuses two ranks on one GPU, so on a one-GPU machine run it at 1 rank
(tests/parallel/test_jobs.py::test_cuda_suite_on_one_rank), and at 2 and 3 ranks with HOROVOD_GPU_OPERATIONS=gloo
(Gloo on the GPU's tensors, which ranks may share); with a GPU per rank it also runs at 2 and 3 on NCCL."""

from __future__ import annotations

import pytest
import torch
from test_torch_planned import planned

from hvdplus.common.basics import runtime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_plane() -> str:
    """The plane of CUDA tensors: NCCL, or Gloo on the GPU with HOROVOD_GPU_OPERATIONS=gloo."""
    return "cudagloo" if runtime().settings.gpu_operations == "gloo" else "nccl"


@pytest.fixture
def cuda(hvd):
    if cuda_plane() == "nccl":
        if not torch.distributed.is_nccl_available():
            pytest.skip("torch has no NCCL")
        if torch.cuda.device_count() < hvd.local_size():
            pytest.skip(
                f"NCCL needs a GPU per rank: {hvd.local_size()} ranks on this host, {torch.cuda.device_count()} "
                "GPU(s); HOROVOD_GPU_OPERATIONS=gloo shares them"
            )
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def nccl_runs() -> int:
    return runtime().coordinator.counters.plane_runs.get(cuda_plane(), 0)


def test_nccl_is_the_plane_for_cuda(hvd, cuda):
    assert hvd.nccl_built() or cuda_plane() == "cudagloo"
    assert "cuda" in runtime().coordinator.device_kinds
    hvd.allreduce(torch.ones(1, device=cuda), name="cuda.first")
    assert cuda_plane() in runtime().coordinator.counters.built_planes


def test_fused_input_written_on_a_side_stream_is_waited_for(hvd, cuda):
    """Fused inputs are packed on the background thread's stream: it must wait for the submitter's writes first."""
    stream = torch.cuda.Stream(cuda)
    with torch.cuda.stream(stream):
        tensors = [torch.empty(1 << 16, device=cuda) for _ in range(8)]
        torch.cuda._sleep(10_000_000)
        for k, t in enumerate(tensors):
            t.fill_(float(k + hvd.rank()))
        handles = [hvd.allreduce_async(t, op=hvd.Sum, name=f"cuda.side.{k}") for k, t in enumerate(tensors)]
        sums = [hvd.synchronize(h).sum() for h in handles]
    stream.synchronize()
    ranks = range(hvd.size())
    assert [s.item() for s in sums] == [float((1 << 16) * sum(k + r for r in ranks)) for k in range(8)]


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8]
)
def test_allreduce_stays_on_the_gpu(hvd, cuda, dtype):
    before = nccl_runs()
    x = (torch.arange(6, device=cuda) % 3 + hvd.rank() + 1).to(dtype)
    out = hvd.allreduce(x, op=hvd.Sum, name=f"cuda.sum.{dtype}")
    expected = sum((torch.arange(6) % 3 + r + 1) for r in range(hvd.size())).to(dtype)
    assert out.device == cuda and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), expected)
    assert nccl_runs() == before + 1


def test_fused_allreduces_and_grouped_on_the_gpu(hvd, cuda):
    counters = runtime().coordinator.counters
    runs, tensors = nccl_runs(), counters.plane_tensors.get(cuda_plane(), 0)
    handles = [
        hvd.allreduce_async(torch.full((1000,), float(k), device=cuda), name=f"cuda.fuse.{k}", op=hvd.Average)
        for k in range(16)
    ]
    for k, handle in enumerate(handles):
        assert torch.equal(hvd.synchronize(handle).cpu(), torch.full((1000,), float(k)))
    assert counters.plane_tensors[cuda_plane()] - tensors == 16 and nccl_runs() - runs < 16  # fused on the GPU
    grouped = hvd.grouped_allreduce([torch.ones(3, device=cuda), torch.ones(5, device=cuda) * 2], op=hvd.Sum)
    assert [g.device for g in grouped] == [cuda, cuda]
    assert grouped[1].cpu().tolist() == [2.0 * hvd.size()] * 5


def test_work_on_a_side_stream_is_waited_for(hvd, cuda):
    """The tensor is written on a non-default stream just before the allreduce: the submit's event makes NCCL wait
    for that write, and the result's event makes the caller's stream wait for NCCL."""
    stream = torch.cuda.Stream(cuda)
    with torch.cuda.stream(stream):
        x = torch.empty(1 << 20, device=cuda)
        torch.cuda._sleep(10_000_000)  # keep the stream busy so an unordered read would see stale values
        x.fill_(float(hvd.rank() + 1))
        out = hvd.allreduce(x, op=hvd.Sum, name="cuda.stream")
        total = out.sum()
    stream.synchronize()
    assert total.item() == (1 << 20) * hvd.size() * (hvd.size() + 1) / 2


def test_allgather_broadcast_reducescatter_on_the_gpu(hvd, cuda):
    before = nccl_runs()
    gathered = hvd.allgather(torch.full((hvd.rank() + 1, 2), float(hvd.rank()), device=cuda))
    assert gathered.device == cuda and gathered.shape[0] == sum(r + 1 for r in range(hvd.size()))
    root = hvd.size() - 1
    assert (
        hvd.broadcast(torch.full((3,), float(hvd.rank()), device=cuda), root_rank=root).cpu().tolist()
        == [float(root)] * 3
    )
    shard = hvd.reducescatter(torch.ones(4 * hvd.size(), device=cuda), op=hvd.Sum)
    assert shard.device == cuda and shard.cpu().tolist() == [float(hvd.size())] * 4
    assert nccl_runs() == before + 3


def test_distributed_optimizer_on_the_gpu_matches_the_cpu(hvd, cuda):
    model, _, reference = _train_on_the_gpu(hvd, cuda, "gpu.sgd", 3, hvd.Compression.none)
    for gpu, cpu in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(gpu.detach().cpu(), cpu.detach(), rtol=1e-5, atol=1e-6)


def _train_on_the_gpu(hvd, cuda, name: str, steps: int, compression):
    """Rank r trains a copy of `reference` on the GPU with its rows of each batch; (model, optimizer, the
    one-process reference trained on the CPU with every rank's rows)."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(cuda)
    model.load_state_dict(reference.state_dict())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
        compression=compression,
    )
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batches = [torch.randn(4, 8, generator=generator) for _ in range(hvd.size())]
        optimizer.zero_grad()
        model(batches[hvd.rank()].to(cuda)).pow(2).mean().backward()
        optimizer.step()
        plain.zero_grad()
        (sum(reference(b).pow(2).mean() for b in batches) / hvd.size()).backward()
        plain.step()
    return model, optimizer, reference


@pytest.mark.parametrize("fp16", [False, True])
def test_planned_path_on_the_gpu(hvd, cuda, fp16):
    """After the first negotiated step the plan freezes on the CUDA plane's engine (at 2 ranks or more): the
    gradients live in bucket buffers on the GPU, are reduced from the hooks (fp16 on the wire: a half buffer on the
    GPU), and training gives what the negotiated path gives, and (fp32) what one process gives on the CPU."""
    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    with planned(True):
        model, optimizer, reference = _train_on_the_gpu(hvd, cuda, f"gpu.planned.{fp16}", 6, compression)
    with planned(False):
        negotiated, _, _ = _train_on_the_gpu(hvd, cuda, f"gpu.negotiated.{fp16}", 6, compression)
    reducer = optimizer._reducer
    if hvd.size() == 1:  # alone there is no backward to overlap: the optimizer stays on Horovod's path
        assert reducer is None
    else:
        assert reducer is not None, "the plan did not freeze on the GPU"
        assert not reducer.host and reducer.steps == 5 and reducer.copies == 0
        assert {bucket.flat.device for bucket in reducer._buckets} == {cuda}
        wires = [bucket.wire for bucket in reducer._buckets]
        if fp16:
            assert all(w is not None and w.dtype == torch.float16 and w.device == cuda for w in wires)
        else:
            assert not any(w is not None for w in wires)
        flats = {bucket.flat.untyped_storage().data_ptr() for bucket in reducer._buckets}
        assert all(p.grad.untyped_storage().data_ptr() in flats for p in model.parameters())
    # The same gradients summed on the same engine; in other buffers, so in another order, which costs a few ulps
    # of float32, or of float16 on the wire (as in test_torch_planned.py).
    same = {"rtol": 1e-3, "atol": 1e-4} if fp16 else {"rtol": 1e-5, "atol": 1e-6}
    for got, want in zip(model.parameters(), negotiated.parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), **same)
    if not fp16:
        for got, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-6)
