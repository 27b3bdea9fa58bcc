"""hvd.pipeline.Pipeline on CUDA tensors: each stage on its rank's GPU, activations and gradients handed on as CUDA
tensors (on the device plane's own point-to-point channels), training equal to one process's on the CPU.

Needs a CUDA device; elsewhere every test skips with that reason (the same code runs on CPU tensors in
test_torch_pipeline.py under HVDPLUS_DEVICE_PATH_ON_CPU=1). NCCL refuses two ranks on one GPU: on a one-GPU machine
the multi-stage tests run at 2 and 3 ranks with HOROVOD_GPU_OPERATIONS=gloo (the plane's channels stage the GPU's
tensors through pinned host memory), and at 1 rank only the single-stage test runs; with a GPU per rank they also
run on NCCL. With HOROVOD_GPU_OPERATIONS=mpi (no plane for CUDA tensors) they pass through host staging, and the
test that counts the plane's transfers skips."""

from __future__ import annotations

import pytest
import torch
from test_torch_pipeline import LR, ROWS, STEPS, batches, mse  # the CPU suite's data and loss

from hvdplus.common.basics import runtime
from hvdplus.common.plans.pipeline_schedules import Op

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cuda(hvd):
    if runtime().settings.gpu_operations not in ("gloo", "mpi"):  # NCCL
        if not torch.distributed.is_nccl_available():
            pytest.skip("torch has no NCCL")
        if torch.cuda.device_count() < hvd.local_size():
            pytest.skip(
                f"NCCL needs a GPU per rank: {hvd.local_size()} ranks on this host, {torch.cuda.device_count()} "
                "GPU(s); HOROVOD_GPU_OPERATIONS=gloo shares them"
            )
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def make_model() -> torch.nn.Sequential:
    """Built on the CPU the same way on every rank: the Pipeline keeps this rank's layers, which pipe.to moves."""
    torch.manual_seed(0)
    modules: list[torch.nn.Module] = [torch.nn.Linear(5, 12)]
    for _ in range(6):
        modules += [torch.nn.Tanh(), torch.nn.Linear(12, 12)]
    modules += [torch.nn.Tanh(), torch.nn.Linear(12, 3)]
    return torch.nn.Sequential(*modules)


def reference(replicas: int) -> torch.nn.Sequential:
    """One process on the CPU, the unpartitioned model, every replica's rows."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(replicas):
        optimizer.zero_grad()
        mse(model(x), y).backward()
        optimizer.step()
    return model


def stages_for(size: int) -> int:
    if size < 2:
        pytest.skip("a pipeline of several stages needs 2 or more ranks")
    return 2 if size % 2 == 0 else size


def cuda_pipeline(hvd, cuda, stages: int, schedule: str = "1f1b", virtual: int = 1):
    pipe = hvd.pipeline.Pipeline(
        make_model(), num_stages=stages, micro_batches=2 * stages, schedule=schedule, virtual_stages=virtual
    )
    pipe.to(cuda)  # this rank's layers only
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(pipe.parameters(), lr=LR),
        named_parameters=pipe.named_parameters(),
        process_set=pipe.data_parallel_set,
    )
    return pipe, optimizer


def train(pipe, optimizer, cuda) -> list[torch.Tensor]:
    rows = slice(pipe.replica * ROWS, (pipe.replica + 1) * ROWS)
    losses = []
    for x, y in batches(pipe.replicas):
        optimizer.zero_grad()
        losses.append(pipe.train_step(x[rows].to(cuda), y[rows].to(cuda), mse))
        optimizer.step()
    return losses


def assert_matches(pipe, model) -> None:
    expected = dict(model.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.is_cuda
        torch.testing.assert_close(p.detach().cpu(), expected[name].detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("zero-bubble", 2)])
def test_stages_on_cuda_train_as_one_process_does(hvd, cuda, schedule, virtual):
    pipe, optimizer = cuda_pipeline(hvd, cuda, stages_for(hvd.size()), schedule, virtual)
    assert pipe.device == cuda
    losses = train(pipe, optimizer, cuda)
    assert all(loss.device == cuda and loss.dim() == 0 for loss in losses)  # on every stage
    assert_matches(pipe, reference(pipe.replicas))
    out = pipe.eval_step(batches(1)[0][0].to(cuda) if pipe.is_first_stage else None)
    if pipe.is_last_stage:
        assert out.is_cuda
        torch.testing.assert_close(out.cpu(), reference(pipe.replicas)(batches(1)[0][0]).detach(), rtol=1e-4, atol=1e-5)


def test_activations_and_gradients_arrive_as_cuda_tensors(hvd, cuda):
    pipe, optimizer = cuda_pipeline(hvd, cuda, stages_for(hvd.size()))
    arrived: list[torch.device] = []
    pipe.stage_module[0].register_forward_pre_hook(lambda module, args: arrived.append(args[0].device))
    grads: list[torch.device] = []
    pipe.stage_module[-1].register_full_backward_hook(lambda module, gin, gout: grads.append(gout[0].device))
    train(pipe, optimizer, cuda)
    assert arrived and all(device == cuda for device in arrived)  # the first stage's inputs, the others' received
    assert grads and all(device == cuda for device in grads)  # the last stage's from its loss, the others' received


def test_the_device_plane_carries_every_message(hvd, cuda):
    if "cuda" not in runtime().coordinator.device_kinds:
        pytest.skip(
            "no device plane for CUDA tensors (HOROVOD_GPU_OPERATIONS=mpi): they are staged through host memory"
        )
    pipe, optimizer = cuda_pipeline(hvd, cuda, stages_for(hvd.size()))
    train(pipe, optimizer, cuda)  # the first step agrees on the plane and opens its channels
    engine = runtime().coordinator.plane_engine("cuda")
    before = engine.p2p_transfers
    train(pipe, optimizer, cuda)
    moves = (Op.SEND_ACTIVATION, Op.RECV_ACTIVATION, Op.SEND_GRAD, Op.RECV_GRAD)
    messages = sum(action.op in moves for action in pipe.actions_by_stage[pipe.stage])
    assert pipe.plane == "cuda"
    assert engine.p2p_transfers - before == STEPS * messages


def test_a_single_stage_on_cuda_keeps_its_loss_on_the_gpu(hvd, cuda):
    """At any size (1 rank included): every rank is its own one-stage pipeline, replicas of one another."""
    pipe, optimizer = cuda_pipeline(hvd, cuda, 1)
    losses = train(pipe, optimizer, cuda)
    assert all(loss.device == cuda for loss in losses)
    assert_matches(pipe, reference(pipe.replicas))
