"""ZeroOptimizer (stages 1 and 2) on CUDA parameters: buffers on the GPU, collectives on the device plane, the
reduce-scatters started during backward, offload to pinned host memory, and checkpoints that load on the CPU.

Needs a CUDA device (skips elsewhere; CI runs the same code on CPU tensors through HVDPLUS_DEVICE_PATH_ON_CPU=1 in
test_torch_zero.py). Run like test_torch_cuda.py: 1 rank on NCCL, 2 and 3 ranks sharing a GPU over Gloo.
Tolerances: the GPU's float32 kernels sum in other orders than the CPU's, so 5 AdamW steps of lr 1e-2 agree with
the CPU run to rtol 1e-4 / atol 1e-5 (a few float32 ulps through Adam's 1/sqrt(v))."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from test_torch_cuda import cuda, nccl_runs  # noqa: F401 (fixture)
from test_torch_zero import PER_RANK, STEPS, assert_state_is_one_nth, batches, make_model, make_optimizer, reference

from hvdplus.common.basics import runtime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def train_on(hvd, device: torch.device, steps: int = STEPS, **kwargs):
    model = make_model().to(device)
    optimizer = hvd.ZeroOptimizer(make_optimizer(model, False), named_parameters=model.named_parameters(), **kwargs)
    rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
    for x, y in batches(hvd.size(), steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows].to(device)), y[rows].to(device)).backward()
        optimizer.step()
    return model, optimizer


def assert_close_to_reference(hvd, model) -> None:
    for got, want in zip(model.parameters(), reference(hvd.size())[0].parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-4, atol=1e-5)


def test_zero_optimizer_keeps_its_buffers_on_the_gpu_and_reduces_on_the_plane(hvd, cuda):
    before = nccl_runs()
    model, optimizer = train_on(hvd, cuda)
    assert_close_to_reference(hvd, model)
    shards = optimizer._zero
    assert all(flat.master.is_cuda and flat.grad.is_cuda for flat in shards.flats)
    assert all(p.is_cuda for p in model.parameters()) and all(s.is_cuda for s in shards.shard_params)
    assert all(state["exp_avg"].is_cuda for state in optimizer.state.values())
    assert nccl_runs() > before  # the reduce-scatters and allgathers ran on the device plane
    assert (shards.frozen is not None) == (hvd.size() > 1)  # the planned path applies as on the CPU


def test_reduce_scatters_start_while_backward_runs(hvd, cuda, monkeypatch):
    """Small buckets: the first bucket's reduce-scatter is submitted before backward returns."""
    monkeypatch.setattr(runtime(), "bucket_bytes", 1024)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(cuda)
    optimizer = hvd.ZeroOptimizer(torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters())
    sent: list[float] = []
    send = type(optimizer._zero)._send
    monkeypatch.setattr(type(optimizer._zero), "_send", lambda self, b: sent.append(time.monotonic()) or send(self, b))
    for _ in range(2):  # the negotiated first step, then the planned one
        sent.clear()
        optimizer.zero_grad()
        model(torch.randn(8, 64, device=cuda)).square().mean().backward()
        backward_done = time.monotonic()
        optimizer.step()
        assert len(optimizer._zero.buckets) > 2 and len(sent) == len(optimizer._zero.buckets)
        assert sent[0] < backward_done  # overlapped with the rest of the backward


def test_offload_keeps_the_optimizer_in_pinned_host_memory_and_steps_there(hvd, cuda):
    model, optimizer = train_on(hvd, cuda, offload="optimizer")
    assert_close_to_reference(hvd, model)
    shards = optimizer._zero
    assert all(p.is_cuda for p in model.parameters())
    assert all(s.device.type == "cpu" and s.is_pinned() for s in shards.shard_params)
    assert all(flat.grad.device.type == "cpu" and flat.grad.is_pinned() for flat in shards.flats)
    assert all(state["exp_avg"].device.type == "cpu" for state in optimizer.state.values())


def test_model_state_on_the_gpu_is_the_parameters_plus_one_nth(hvd, cuda):
    """Stage 2 holds the parameters, 1/N of the gradients and 1/N of Adam's two moments (plus bucket buffers);
    with offload only the parameters and the buckets. The 1/N is counted exactly, from the storages that hold the
    state (as the CPU suites count it); the allocator's total bounds the rest."""
    for offload, per_element in ((None, 4 + 12 / hvd.size()), ("optimizer", 4)):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).to(cuda)
        optimizer = hvd.ZeroOptimizer(
            torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters(), offload=offload
        )
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(4, 256, device=cuda)).sum().backward()
            optimizer.step()
        assert_state_is_one_nth(hvd, model, optimizer, "cpu" if offload else "cuda")
        elements = sum(p.numel() for p in model.parameters())
        buckets = 3 * runtime().bucket_bytes + (1 << 20)  # two in flight and a spare, and the activations
        assert torch.cuda.memory_allocated() - base <= elements * per_element + buckets
        del model, optimizer


def test_checkpoints_of_a_gpu_run_hold_cpu_tensors_and_load_into_a_cpu_run(hvd, cuda):
    _, optimizer = train_on(hvd, cuda, steps=2)
    shard = optimizer.sharded_state_dict()
    assert all(t.device.type == "cpu" for flat in shard["flats"] for t in flat["per_element"].values())
    full = hvd.broadcast_object(optimizer.consolidated_state_dict(to=0), root_rank=0)
    tensors = [v for state in full["state"].values() for v in state.values() if torch.is_tensor(v)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    on_cpu = make_model()
    cpu_optimizer = hvd.ZeroOptimizer(make_optimizer(on_cpu, False), named_parameters=on_cpu.named_parameters())
    cpu_optimizer.load_sharded_state_dict(shard)  # a GPU run's shard, loaded by a CPU one
    for state, mine in zip(cpu_optimizer.state.values(), optimizer.state.values()):
        torch.testing.assert_close(state["exp_avg"], mine["exp_avg"].cpu())
