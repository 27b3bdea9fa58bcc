"""hvd.shard_parameters (ZeRO-3) on CUDA parameters: shards and gathered buffers on the GPU, gathers on the device
plane, a meta model materialised on the GPU one unit at a time, offload to pinned host memory, activation
checkpointing, an out-of-memory gather that every rank raises, GPU memory within the promise, and checkpoints that
load on the CPU.

Needs a CUDA device (skips elsewhere; CI runs the same code on CPU tensors through HVDPLUS_DEVICE_PATH_ON_CPU=1 in
test_torch_zero3.py). Run like test_torch_cuda.py: 1 rank on NCCL, 2 and 3 ranks sharing a GPU over Gloo
(HOROVOD_GPU_OPERATIONS=gloo). Tolerances: against the one-process CPU reference, rtol 1e-4 / atol 5e-5: the
GPU's float32 kernels sum in other orders than the CPU's (a few ulps), which 4 AdamW steps at lr 1e-3 carry
through Adam's 1/sqrt(v) (test_torch_cuda_zero.py measures the same for stage 2)."""

from __future__ import annotations

import gc

import pytest
import torch
from test_torch_cuda import cuda, cuda_plane  # noqa: F401 (fixture)
from test_torch_zero3 import ROWS, STEPS, Block, TinyGPT, build, data, loss_of, optimizer_for, reference

from hvdplus.common.basics import runtime
from hvdplus.common.exceptions import CollectiveMismatchError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU = {"rtol": 1e-4, "atol": 5e-5}


def plane_tensors() -> int:
    """Requests the CUDA tensors' plane (NCCL, or Gloo on the GPU) has carried so far."""
    return runtime().coordinator.counters.plane_tensors.get(cuda_plane(), 0)


def sharded_on(hvd, device: torch.device, model: torch.nn.Module | None = None, **options):
    model = model if model is not None else build()
    hvd.shard_parameters(model, units=options.pop("units", [Block]), device=device, **options)
    optimizer = hvd.ZeroOptimizer(optimizer_for("adamw", model.parameters()), named_parameters=model.named_parameters())
    return model, optimizer


def train_on(hvd, device: torch.device, model, optimizer, steps: int = STEPS) -> None:
    rows = slice(hvd.rank() * ROWS, (hvd.rank() + 1) * ROWS)
    for tokens in data(hvd.size(), steps):
        optimizer.zero_grad()
        loss_of(model, tokens[rows].to(device)).backward()
        optimizer.step()


def whole_on_cpu(hvd, model) -> dict[str, torch.Tensor]:
    with hvd.gathered_parameters(model):
        return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def assert_close_to_reference(hvd, model, expected: torch.nn.Module | None = None) -> None:
    got = whole_on_cpu(hvd, model)
    expected = expected if expected is not None else reference(hvd.size())[0]
    for name, p in expected.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **GPU)


def test_shards_and_gathers_live_on_the_gpu_and_run_on_the_plane(hvd, cuda):
    model, optimizer = sharded_on(hvd, cuda, model=build().to(cuda))
    units = model._hvdplus_zero3.units
    assert all(u.device == cuda for u in units)
    assert all(shard.is_cuda for u in units for shard in u.shards)
    assert all(buffer.is_cuda for u in units for buffer in u.full)
    before = plane_tensors()
    train_on(hvd, cuda, model, optimizer)
    assert plane_tensors() - before >= STEPS * (4 + 3)  # the gathers (and the reduce-scatters) ran on the plane
    assert all(p.is_cuda and p.numel() == 0 for p in model.parameters())  # released between steps, on the GPU
    assert all(buffer.untyped_storage().nbytes() == 0 for u in units for buffer in u.full)
    assert_close_to_reference(hvd, model)


def test_a_cpu_model_is_moved_to_the_given_device_unit_by_unit(hvd, cuda):
    model, optimizer = sharded_on(hvd, cuda)  # built on the CPU, sharded onto the GPU
    assert all(shard.is_cuda for u in model._hvdplus_zero3.units for shard in u.shards)
    train_on(hvd, cuda, model, optimizer)
    assert_close_to_reference(hvd, model)


def test_a_cpu_parameter_in_a_gpu_model_is_named(hvd, cuda):
    model = build().to(cuda)
    model.blocks[1].up.bias.data = model.blocks[1].up.bias.data.cpu()
    with pytest.raises(ValueError, match="blocks.1.up.bias.*cpu"):
        hvd.shard_parameters(model, units=[Block])


class Layer(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


WIDE, LAYERS = 512, 6  # 2.1M parameters (8.4 MB) a layer, 50 MB in all: allocator rounding is noise beside them


def wide_model() -> torch.nn.Module:
    return torch.nn.Sequential(*[Layer(WIDE) for _ in range(LAYERS)])


def unit_bytes() -> int:
    return sum(p.numel() for p in Layer(WIDE).parameters()) * 4


def fresh_peak() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def test_a_meta_model_is_materialised_on_the_gpu_one_unit_at_a_time(hvd, cuda):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = wide_model()
    base = fresh_peak()
    hvd.shard_parameters(model, units=[Layer], device=cuda)
    torch.cuda.synchronize()
    whole = LAYERS * unit_bytes()
    # All shards (1/N of the model) plus the one unit being initialised, never the whole model (at N > 1).
    assert torch.cuda.max_memory_allocated() - base <= whole / hvd.size() + unit_bytes() + (1 << 20)
    assert all(shard.is_cuda for u in model._hvdplus_zero3.units for shard in u.shards)
    torch.manual_seed(0)
    with torch.device(cuda):  # a normal build on the same device draws from the same (CUDA) generator
        expected = wide_model()
    got = whole_on_cpu(hvd, model)
    for name, p in expected.named_parameters():  # each rank's slice of what a normal build with the seed makes
        torch.testing.assert_close(got[name], p.detach().cpu(), rtol=0, atol=0)


def test_model_state_per_rank_is_one_nth_plus_the_units_in_use(hvd, cuda):
    """Between steps a rank holds 1/N of the parameters, gradients and AdamW's two moments (16 bytes an element);
    during a step, at most two units gathered (max_live_units), a unit's gradient buffers and AdamW's
    temporaries besides."""
    torch.manual_seed(0)
    model = wide_model().to(cuda)
    hvd.shard_parameters(model, units=[Layer])  # frees the whole parameters: only the shards stay
    optimizer = hvd.ZeroOptimizer(torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters())
    shards = LAYERS * unit_bytes() // hvd.size() + LAYERS * 4 * 4  # a flat range differs by one element a rank
    base = fresh_peak() - shards  # what the GPU held before the model
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.ones(4, WIDE, device=cuda)).square().mean().backward()
        optimizer.step()
    torch.cuda.synchronize()
    state, activations = 4 * shards, 1 << 20  # parameters, gradients, two moments
    assert torch.cuda.memory_allocated() - base <= state + activations
    # gathered: 2 units; gradients: a unit's bucket filling, one in flight, a spare, and p.grad of one parameter;
    # AdamW's foreach temporaries: up to two shards' worth
    assert torch.cuda.max_memory_allocated() - base <= state + 2 * shards + (2 + 4) * unit_bytes() + activations


def test_offloaded_shards_live_in_pinned_host_memory(hvd, cuda):
    model, optimizer = sharded_on(hvd, cuda, offload="parameters")
    units = model._hvdplus_zero3.units
    assert all(u.device == cuda for u in units)
    assert all(s.device.type == "cpu" and s.is_pinned() for u in units if not u.persistent for s in u.shards)
    assert all(buffer.is_cuda for u in units for buffer in u.full)
    train_on(hvd, cuda, model, optimizer)
    assert all(state["exp_avg"].device.type == "cpu" for state in optimizer.state.values())  # stepped on the host
    assert_close_to_reference(hvd, model)


def test_checkpointed_units_train_as_one_process_does(hvd, cuda):
    model, optimizer = sharded_on(hvd, cuda, checkpoint_activations=True)
    train_on(hvd, cuda, model, optimizer)
    assert model._hvdplus_zero3.position == 4 + 3 + 4  # the recomputation used the backward's gathers
    assert_close_to_reference(hvd, model)


def test_a_gather_out_of_gpu_memory_raises_on_every_rank(hvd, cuda):
    """The last rank's allocator has less room than one unit's buffer: its gather raises OutOfMemoryError naming
    the unit, and every other rank's gather of that unit raises instead of waiting. Units of 34 MB: above the
    caching allocator's 10 MB, each buffer (and each shard) is a segment of its own, so no free end of another
    segment can hold it."""
    if hvd.size() == 1:
        pytest.skip("needs another rank to be left waiting")
    torch.manual_seed(0)
    model = torch.nn.Sequential(Layer(1024), Layer(1024))
    hvd.shard_parameters(model, units=[Layer], device=cuda)
    x = torch.ones(4, 1024, device=cuda)
    with torch.no_grad():
        model(x)  # the order prefetch follows
    limited = hvd.rank() == hvd.size() - 1
    if limited:
        gc.collect()
        torch.cuda.empty_cache()
        room = torch.cuda.memory_reserved() + 4 * sum(p.numel() for p in Layer(1024).parameters()) // 2
        torch.cuda.set_per_process_memory_fraction(room / torch.cuda.get_device_properties(cuda).total_memory)
    try:
        with torch.no_grad():
            if limited:
                with pytest.raises(torch.OutOfMemoryError, match=r"gathering ZeRO-3 unit '\d'"):
                    model(x)
            else:
                with pytest.raises(CollectiveMismatchError, match=r"unit '\d' \(out of memory on rank"):
                    model(x)
    finally:
        if limited:
            torch.cuda.set_per_process_memory_fraction(1.0)
    hvd.barrier()


def test_checkpoints_of_a_gpu_run_load_on_the_cpu_and_back(hvd, cuda, tmp_path_factory):
    model, optimizer = sharded_on(hvd, cuda)
    train_on(hvd, cuda, model, optimizer, steps=2)
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("zero3-gpu") / "full.pt"), root_rank=0)
    directory = hvd.broadcast_object(str(tmp_path_factory.mktemp("zero3-gpu-sharded")), root_rank=0)
    hvd.save_full_checkpoint(path, model, optimizer)
    hvd.save_sharded_checkpoint(directory, model, optimizer)
    hvd.barrier()
    saved = torch.load(path, weights_only=True)
    assert all(t.device.type == "cpu" for t in saved["model"].values())
    plain = TinyGPT()
    plain.load_state_dict(saved["model"])  # a plain CPU model takes a GPU run's file
    expected = whole_on_cpu(hvd, model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0)
    for load in (hvd.load_full_checkpoint, hvd.load_sharded_checkpoint):
        on_cpu, cpu_optimizer = sharded_on(hvd, torch.device("cpu"), model=build(seed=9))
        load(path if load is hvd.load_full_checkpoint else directory, on_cpu, cpu_optimizer)
        got = whole_on_cpu(hvd, on_cpu)
        assert all(torch.equal(got[name], expected[name]) for name in expected)
        back = hvd.broadcast_object(str(tmp_path_factory.mktemp("zero3-cpu-sharded")), root_rank=0)
        hvd.save_sharded_checkpoint(back, on_cpu, cpu_optimizer)  # and a CPU run's files into a GPU model
        hvd.barrier()
        on_gpu, gpu_optimizer = sharded_on(hvd, cuda, model=build(seed=7))
        hvd.load_sharded_checkpoint(back, on_gpu, gpu_optimizer)
        assert all(torch.equal(whole_on_cpu(hvd, on_gpu)[name], expected[name]) for name in expected)
