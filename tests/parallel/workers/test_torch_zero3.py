"""ZeRO-3 (hvd.shard_parameters + hvd.ZeroOptimizer) against DistributedOptimizer at the same N and against one
process on the combined batch; its memory promise, checkpoints and errors.

Written to pass at any world size; run by tests/parallel/test_jobs.py on 2 and 3 ranks over each engine.
Tolerances: against DistributedOptimizer at the same N, 1e-6 (both average the same N float32 gradients; the
reduce-scatter may add them in another order: a few ulps, which 4 AdamW steps at lr 1e-3 keep below 1e-6).
Against one process, 2e-5: the N-way sum of partial gradients differs from one backward by ulps, and Adam divides
the tiny gradients of some elements by their own magnitude (FIELD-NOTES: ~4e-6 at 2 ranks, more at 3 with lr
1e-2; at lr 1e-3 and 4 steps measured below 1e-5).

The same tests run with HVDPLUS_DEVICE_PATH_ON_CPU=1, where the gathers take the device plane's code (the one CUDA
tensors take on NCCL) on CPU tensors; test_gathers_run_on_the_device_plane_when_there_is_one counts them there.
The CUDA tests are test_torch_cuda_zero3.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hvdplus.common.basics import runtime
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.torch.zero.zero3_init import check_same_everywhere, default_init
from tests.parallel.process_sets import pset, rest  # noqa: F401 (fixtures)

VOCAB, WIDTH, BLOCKS, ROWS, STEPS = 32, 16, 3, 2, 4
EXACT = {"rtol": 0, "atol": 1e-6}
ONE_PROCESS = {"rtol": 0, "atol": 2e-5}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyGPT(torch.nn.Module):
    """Embedding tied to the output layer (shared by the root and no unit), BLOCKS residual blocks."""

    def __init__(self, order: list[int] | None = None) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.order = order if order is not None else list(range(BLOCKS))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(self.norm(x))


def build(seed: int = 0, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def data(size: int, steps: int = STEPS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (size * ROWS, 9), generator=generator) for _ in range(steps)]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def optimizer_for(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def train(hvd, model, optimizer, steps=STEPS, passes=1, clip=None, first=0, rows_of=None):
    """This rank's rows of each global batch, in `passes` micro-batches; returns the clipped norms."""
    size, rank = (hvd.size(), hvd.rank()) if rows_of is None else rows_of
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    norms = []
    for tokens in data(size, steps)[first:]:
        optimizer.zero_grad()
        for part in tokens[rows].chunk(passes):
            (loss_of(model, part) / passes).backward()
        if clip is not None:
            norms.append(float(optimizer.clip_grad_norm_(clip)))
        optimizer.step()
    return norms


def reference(size: int, kind: str = "adamw", steps=STEPS, clip=None, model=None):
    """One process, the whole batch, the plain optimizer."""
    model = model if model is not None else build()
    optimizer = optimizer_for(kind, model.parameters())
    norms = []
    for tokens in data(size, steps):
        optimizer.zero_grad()
        loss_of(model, tokens).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
    return model, optimizer, norms


def sharded(hvd, model=None, kind="adamw", passes=1, offload_optimizer=False, **options):
    model = model if model is not None else build()
    hvd.shard_parameters(model, units=options.pop("units", [Block]), **options)
    process_set = options.get("process_set", hvd.global_process_set)
    optimizer = hvd.ZeroOptimizer(
        optimizer_for(kind, model.parameters()),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        process_set=process_set,
        offload="optimizer" if offload_optimizer else None,
    )
    return model, optimizer


def whole(hvd, model) -> dict[str, torch.Tensor]:
    with hvd.gathered_parameters(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_close_to(hvd, model, expected: torch.nn.Module, **tolerance) -> None:
    got = whole(hvd, model)
    for name, p in expected.named_parameters():
        torch.testing.assert_close(got[name].float(), p.detach().float(), **tolerance)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_stage3_trains_as_distributed_optimizer_and_one_process_do(hvd, kind):
    model, optimizer = sharded(hvd, kind=kind)
    train(hvd, model, optimizer)
    positions = model._hvdplus_zero3.position
    dense = build()
    train(
        hvd,
        dense,
        hvd.DistributedOptimizer(optimizer_for(kind, dense.parameters()), named_parameters=dense.named_parameters()),
    )
    assert_close_to(hvd, model, dense, **EXACT)
    assert_close_to(hvd, model, reference(hvd.size(), kind)[0], **ONE_PROCESS)
    assert isinstance(optimizer, type(optimizer_for(kind, [torch.zeros(1, requires_grad=True)])))
    # The pass ran each unit's gathers and reduce-scatters under positional names: the root and 3 blocks gathered
    # for forward, the blocks again for backward (reshard_after_forward), and 4 reduce-scatters.
    assert positions == 4 + 3 + 4


def test_between_steps_each_rank_holds_one_nth_of_parameters_gradients_and_state(hvd):
    model, optimizer = sharded(hvd)
    train(hvd, model, optimizer, steps=2)
    units = model._hvdplus_zero3.units
    assert all(p.numel() == 0 for p in model.parameters())  # no whole parameter stays
    assert all(buffer.untyped_storage().nbytes() == 0 for u in units for buffer in u.full)
    total = sum(p.numel() for p in build().parameters()) * 4
    held = sum(u.nbytes() for u in units)
    grads = sum(flat.grad.numel() * 4 for flat in optimizer._zero.flats)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    slack = 4 * len(units)  # a flat sequence's shards differ by at most one element between ranks
    assert held <= total / hvd.size() + slack and grads <= total / hvd.size() + slack
    assert state <= 2 * total / hvd.size() + 2 * slack  # AdamW: two moments per element
    assert all(bucket.buffer is None for bucket in optimizer._zero.buckets)  # no gradient buffer survives a step


def test_accumulation_and_global_norm_clipping(hvd):
    model, optimizer = sharded(hvd, passes=2)
    norms = train(hvd, model, optimizer, passes=2, clip=0.5)
    expected, _, expected_norms = reference(hvd.size(), clip=0.5)
    assert norms == pytest.approx(expected_norms, rel=1e-4)
    assert all(norm > 0.5 for norm in norms)  # the clipping really scaled the gradients
    assert_close_to(hvd, model, expected, **ONE_PROCESS)


def test_bf16_parameters_for_compute_with_fp32_shards(hvd):
    seen = []
    model, optimizer = sharded(hvd, kind="sgd", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.blocks[0].up.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    train(hvd, model, optimizer)
    assert set(seen) == {torch.bfloat16}  # the forward computed in bf16
    assert all(shard.dtype == torch.float32 for u in model._hvdplus_zero3.units for shard in u.shards)
    exact = reference(hvd.size(), "sgd")[0]
    full = hvd.full_state_dict(model, to=0)  # from the fp32 shards (the gathered bf16 copies round to 2^-8)
    if full is not None:
        assert full["blocks.0.up.weight"].dtype == torch.float32
        # bf16 keeps 8 bits of mantissa: weights, activations and gradients carry relative errors of 2^-9 each,
        # a few of them through a block. SGD's update is linear in the gradient, and 4 steps (lr 0.05, momentum
        # 0.9) move a weight by up to 0.6 (measured), so the rounding changes it by about 0.6 * 2^-8 = 2.3e-3
        # (measured: 1.1e-3 at 3 ranks). 5e-3 is a hundred times smaller than the training's own movement.
        for name, p in exact.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=5e-3)
        assert any(not torch.equal(full[name], p.detach()) for name, p in exact.named_parameters())  # it rounded


def test_frozen_parameters_stay_put_and_the_rest_trains(hvd):
    model = build()
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    model.blocks[0].norm.weight.requires_grad_(False)  # a unit with trainable and frozen parameters
    model, optimizer = sharded(hvd, model=model)
    train(hvd, model, optimizer)
    expected = build()
    for p in [*expected.blocks[1].parameters(), expected.blocks[0].norm.weight]:
        p.requires_grad_(False)
    expected, _, _ = reference(hvd.size(), model=expected)
    assert_close_to(hvd, model, expected, **ONE_PROCESS)
    assert torch.equal(whole(hvd, model)["blocks.1.up.weight"], build().blocks[1].up.weight.detach())


def test_a_model_built_on_the_meta_device_gets_the_slices_of_a_normally_built_one(hvd):
    torch.manual_seed(3)
    with torch.device("meta"):
        model = TinyGPT()
    hvd.shard_parameters(model, units=[Block])
    normal = build(3)
    units = model._hvdplus_zero3.units
    for unit in units:  # this rank's shard is its slice of the normally built values
        for k, part in enumerate(unit.plan):
            flat = torch.cat([dict(normal.named_parameters())[unit.names[i]].detach().reshape(-1) for i in part.params])
            torch.testing.assert_close(unit.shards[k], flat[slice(*part.shard(unit.index))], rtol=0, atol=0)
    assert all(not p.is_meta for p in model.parameters())
    optimizer = hvd.ZeroOptimizer(optimizer_for("adamw", model.parameters()), named_parameters=model.named_parameters())
    train(hvd, model, optimizer)
    assert_close_to(hvd, model, reference(hvd.size(), model=build(3))[0], **ONE_PROCESS)


def test_a_parameter_tied_across_two_units_belongs_to_their_enclosing_unit(hvd):
    """The embedding and the output layer are units of their own here, sharing one weight (FSDP2 in torch 2.13
    refuses this with a ValueError): the weight goes to the root, gathered for the whole pass."""
    model, optimizer = sharded(hvd, units=lambda name, module: isinstance(module, Block) or name in ("embed", "head"))
    units = {unit.name: unit for unit in model._hvdplus_zero3.units}
    assert "embed.weight" in units["<root>"].names and "embed" not in units and "head" not in units
    train(hvd, model, optimizer)
    assert_close_to(hvd, model, reference(hvd.size())[0], **ONE_PROCESS)


def test_persistent_small_parameters_and_keeping_units_until_backward(hvd):
    model, optimizer = sharded(hvd, persist_below=WIDTH, reshard_after_forward=False)
    persistent = [u for u in model._hvdplus_zero3.units if u.persistent]
    assert persistent and all(p.numel() <= WIDTH for p in persistent[0].params)  # the norms and the biases of 16
    train(hvd, model, optimizer)
    assert all(p.numel() > 0 for p in persistent[0].params)  # whole on every rank between steps
    # No backward re-gather: 3 forward gathers of units with sharded parameters plus the root, 4 reduce-scatters.
    assert model._hvdplus_zero3.position == 4 + 4
    assert_close_to(hvd, model, reference(hvd.size())[0], **ONE_PROCESS)


def test_gathered_parameters_reads_and_changes_the_whole_weights(hvd):
    model, _ = sharded(hvd)
    with hvd.gathered_parameters(model.blocks[1], modify=True), torch.no_grad():
        assert model.blocks[1].up.weight.shape == (4 * WIDTH, WIDTH)
        model.blocks[1].up.weight.fill_(0.25)
    assert model.blocks[1].up.weight.numel() == 0  # released again
    assert torch.all(whole(hvd, model)["blocks.1.up.weight"] == 0.25)
    with hvd.gathered_parameters(model, rank0_only=True):
        assert (model.head.weight.numel() > 0) == (hvd.rank() == 0)


def test_checkpoints_load_into_a_plain_model_and_resume_exactly(hvd, tmp_path_factory):
    model, optimizer = sharded(hvd)
    train(hvd, model, optimizer, steps=2)
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("zero3") / "full.pt"), root_rank=0)
    hvd.save_full_checkpoint(path, model, optimizer)
    directory = hvd.broadcast_object(str(tmp_path_factory.mktemp("zero3-sharded")), root_rank=0)
    hvd.save_sharded_checkpoint(directory, model, optimizer)
    hvd.barrier()
    saved = torch.load(path, weights_only=True)
    plain = build(seed=5)
    plain.load_state_dict(saved["model"])  # a plain, unsharded model takes the file
    plain_optimizer = optimizer_for("adamw", plain.parameters())
    plain_optimizer.load_state_dict(saved["optimizer"])
    assert_close_to(hvd, model, plain, rtol=0, atol=0)
    uninterrupted, uninterrupted_optimizer = sharded(hvd)
    train(hvd, uninterrupted, uninterrupted_optimizer)
    for load in (hvd.load_full_checkpoint, hvd.load_sharded_checkpoint):
        for offload in (False, True):  # an offloaded optimizer steps host copies of the shards the load wrote
            resumed, resumed_optimizer = sharded(hvd, model=build(seed=9), offload_optimizer=offload)
            load(path if load is hvd.load_full_checkpoint else directory, resumed, resumed_optimizer)
            train(hvd, resumed, resumed_optimizer, first=2)
            assert_close_to(hvd, resumed, whole_model(hvd, uninterrupted), rtol=0, atol=0)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("write", ["load_full_state_dict", "gathered_parameters"])
def test_weights_written_after_wrapping_are_the_ones_trained(hvd, write, offload):
    """A load or a modifying gather after the optimizer is wrapped writes the units' shards; the steps, with the
    optimizer offloaded to host copies too, go on from those weights as one process does."""
    model, optimizer = sharded(hvd, model=build(seed=9), offload_optimizer=offload)
    start = build(seed=4)
    if write == "load_full_state_dict":
        hvd.load_full_state_dict(model, start.state_dict())
    else:
        with hvd.gathered_parameters(model, modify=True), torch.no_grad():
            for p, q in zip(model.parameters(), start.parameters()):
                p.copy_(q)
    train(hvd, model, optimizer)
    assert_close_to(hvd, model, reference(hvd.size(), model=build(seed=4))[0], **ONE_PROCESS)


def whole_model(hvd, model) -> torch.nn.Module:
    copy = build(seed=1)
    copy.load_state_dict(whole(hvd, model), strict=False)
    return copy


def test_a_process_set_without_rank_0(hvd, rest):
    if hvd.rank() == 0:
        return
    model, optimizer = sharded(hvd, process_set=rest)
    index = rest.ranks.index(hvd.rank())
    train(hvd, model, optimizer, rows_of=(rest.size(), index))
    assert_close_to(hvd, model, reference(rest.size())[0], **ONE_PROCESS)


def test_parameters_that_differ_between_ranks_raise_on_every_rank(hvd):
    model = build(seed=hvd.rank())
    with pytest.raises(CollectiveMismatchError, match="differs between ranks"):
        hvd.shard_parameters(model, units=[Block])


def test_units_run_in_another_order_raise_on_every_rank(hvd):
    order = [0, 1, 2] if hvd.rank() == 0 else [1, 0, 2]
    model, _ = sharded(hvd, model=build(order=order))
    with pytest.raises(CollectiveMismatchError, match="blocks.0.*blocks.1|blocks.1.*blocks.0"):
        model(data(hvd.size())[0][:, :-1])


def test_a_rank_that_skips_a_unit_raises_on_every_rank(hvd):
    order = [0, 1, 2] if hvd.rank() == 0 else [0, 2]
    model, _ = sharded(hvd, model=build(order=order), prefetch=0)
    with pytest.raises(CollectiveMismatchError, match="unit"):
        loss_of(model, data(hvd.size())[0]).backward()


def test_misuse_is_refused(hvd):
    model, _ = sharded(hvd)
    with pytest.raises(ValueError, match="already sharded"):
        hvd.shard_parameters(model)
    with pytest.raises(ValueError, match="hvd.ZeroOptimizer"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    other = build()
    hvd.shard_parameters(other, units=[Block])
    with pytest.raises(ValueError, match="lacks"):
        hvd.ZeroOptimizer(torch.optim.SGD(list(other.blocks[0].parameters()), lr=0.1))


class Adapted(torch.nn.Module):
    """A frozen Linear with a trainable low-rank adapter beside it (LoRA's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(WIDTH, WIDTH)
        self.base.requires_grad_(False)
        self.down = torch.nn.Linear(WIDTH, 2, bias=False)
        self.up = torch.nn.Linear(2, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.base(x)) + self.up(self.down(x))


def test_units_with_frozen_parameters_are_released_right_after_their_own_backward(hvd):
    """LoRA-like units (frozen weights, trainable adapters) do not pile up until the backward's end."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Adapted() for _ in range(5)])
    expected = torch.nn.Sequential(*[Adapted() for _ in range(5)])
    expected.load_state_dict(model.state_dict())
    hvd.shard_parameters(model, units=[Adapted])
    optimizer = hvd.ZeroOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        named_parameters=[(n, p) for n, p in model.named_parameters() if p.requires_grad],
    )
    live, runtime_ = [], model._hvdplus_zero3
    gather_for_backward = runtime_.before_backward

    def spy(unit):  # how many units are whole as each unit's backward starts
        gather_for_backward(unit)
        live.append(runtime_.live())

    runtime_.before_backward = spy
    reference_optimizer = torch.optim.SGD([p for p in expected.parameters() if p.requires_grad], lr=0.1)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(hvd.size() * ROWS, WIDTH, generator=generator, requires_grad=True)
        mine = x[hvd.rank() * ROWS : (hvd.rank() + 1) * ROWS]
        optimizer.zero_grad()
        model(mine).pow(2).mean().backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        expected(x).pow(2).mean().backward()
        reference_optimizer.step()
    assert live and max(live) <= model._hvdplus_zero3.max_live_units  # without the release: all 5 by the end
    assert_close_to(hvd, model, expected, rtol=0, atol=1e-5)


def test_bf16_casts_the_models_floating_inputs(hvd):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    hvd.shard_parameters(model, units=[Block], param_dtype=torch.bfloat16)
    output = model(torch.randn(2, WIDTH))  # a float32 input into bf16 weights
    assert output.dtype == torch.bfloat16


def test_two_sharded_models_interleave_without_sharing_collective_names(hvd):
    teacher, _ = sharded(hvd, model=build(seed=0))
    student, optimizer = sharded(hvd, model=build(seed=0), passes=2)
    assert teacher._hvdplus_zero3.id != student._hvdplus_zero3.id
    rows = slice(hvd.rank() * ROWS, (hvd.rank() + 1) * ROWS)
    for tokens in data(hvd.size(), 2):
        optimizer.zero_grad()
        for part in tokens[rows].chunk(2):
            with torch.no_grad():
                target = teacher(part[:, :-1]).softmax(-1)
            logits = student(part[:, :-1])
            (torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1, VOCAB)) / 2).backward()
        optimizer.step()
    assert whole(hvd, student)["blocks.0.up.weight"].shape == (4 * WIDTH, WIDTH)


def test_a_sharded_checkpoint_directory_keeps_one_world_size(hvd, tmp_path_factory):
    model, optimizer = sharded(hvd)
    directory = Path(hvd.broadcast_object(str(tmp_path_factory.mktemp("zero3-sizes")), root_rank=0))
    if hvd.rank() == 0:
        (directory / "rank-0-of-7.pt").write_bytes(b"from an earlier save at 7 ranks")
    hvd.barrier()
    hvd.save_sharded_checkpoint(directory, model, optimizer)
    assert sorted(p.name for p in directory.iterdir()) == [f"rank-{r}-of-{hvd.size()}.pt" for r in range(hvd.size())]
    hvd.barrier()
    if hvd.rank() == 0:
        (directory / "rank-0-of-7.pt").write_bytes(b"again")
    hvd.barrier()
    with pytest.raises(ValueError, match="holds sharded checkpoints of"):
        hvd.load_sharded_checkpoint(directory, model, optimizer)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_stages_sharded_over_their_data_parallel_set(hvd, schedule):
    """Each stage's layers sharded over the stage's replicas (one replica at 2 and 3 ranks, two in the 4-rank
    pipeline job): the pipeline trains as one process does."""
    from tests.parallel.workers.test_torch_pipeline import batches, make_model, mse, reference

    stages = hvd.size() // (2 if hvd.size() % 4 == 0 else 1)
    pipe = hvd.pipeline.Pipeline(make_model(), num_stages=stages, micro_batches=2 * stages, schedule=schedule)
    hvd.shard_parameters(pipe.stage_module, units=[torch.nn.Linear], process_set=pipe.data_parallel_set)
    optimizer = hvd.ZeroOptimizer(
        torch.optim.SGD(pipe.parameters(), lr=0.1),
        named_parameters=pipe.named_parameters(),
        process_set=pipe.data_parallel_set,
    )
    rows = slice(pipe.replica * 12, (pipe.replica + 1) * 12)
    for x, y in batches(pipe.replicas):
        optimizer.zero_grad()
        pipe.train_step(x[rows], y[rows], mse)
        optimizer.step()
    expected = dict(reference(pipe.replicas)[0].named_parameters())
    with hvd.gathered_parameters(pipe.stage_module):
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.detach(), expected[name].detach(), rtol=1e-5, atol=1e-5)
    hvd.barrier()  # the stages' sets finish at different times; a control round needs every rank until then


def plane_tensors() -> int:
    """Requests the CPU simulation of the device plane has carried so far."""
    return runtime().coordinator.counters.plane_tensors.get("torchgloo", 0)


def test_gathers_run_on_the_device_plane_when_there_is_one(hvd, pset):
    """Under HVDPLUS_DEVICE_PATH_ON_CPU=1 each gather is a request of the plane (the one CUDA tensors take);
    otherwise none is. On the whole job and on a set without rank 0."""
    if pset is not hvd.global_process_set and hvd.rank() == 0:
        return
    model, _ = sharded(hvd, process_set=pset)
    runtime_ = model._hvdplus_zero3
    assert all(u.device == torch.device("cpu") and u.offload is None for u in runtime_.units)
    names = []
    next_name = runtime_.next_name
    runtime_.next_name = lambda: names.append(next_name()) or names[-1]
    before = plane_tensors()
    with torch.no_grad():  # gathers only: no reduce-scatter
        model(data(hvd.size())[0][:, :-1])
    assert len(names) == 4  # the root and 3 blocks
    on_plane = os.environ.get("HVDPLUS_DEVICE_PATH_ON_CPU") == "1"
    assert plane_tensors() - before == (len(names) if on_plane else 0)


def test_offloaded_shards_live_on_the_host_and_train_as_one_process_does(hvd):
    model, optimizer = sharded(hvd, offload="parameters", persist_below=WIDTH)
    units = model._hvdplus_zero3.units
    assert all(u.offload == ("parameters" if not u.persistent else None) for u in units)
    # In host memory (the CPU here, so also): storage of their own, which each gather copies to the device.
    assert all(shard.device.type == "cpu" for u in units for shard in u.shards)
    offloaded = [shard for u in units if u.offload for shard in u.shards]
    assert offloaded and len({shard.untyped_storage().data_ptr() for shard in offloaded}) == len(offloaded)
    copies = []
    stream = units[0].copies
    copy_in = stream.after_current
    stream.after_current = lambda: copies.append(1) or copy_in()  # each gather copies the shard to the device
    train(hvd, model, optimizer)
    # 2 units gathered in forward and backward per step for each offloaded unit (the root once), per partition
    assert len(copies) == STEPS * (1 + 2 * BLOCKS)
    assert_close_to(hvd, model, reference(hvd.size())[0], **ONE_PROCESS)


@pytest.mark.parametrize("parameters", [False, True])
def test_an_offloaded_optimizer_steps_the_units_shards_on_the_host(hvd, parameters):
    """ZeroOptimizer(offload="optimizer") over a sharded model: the optimizer steps host copies of the units'
    shards (or, with the parameters offloaded too, the host shards themselves), and training equals one
    process's."""
    options = {"offload": "parameters"} if parameters else {}
    model, optimizer = sharded(hvd, offload_optimizer=True, persist_below=WIDTH, **options)
    flats = optimizer._zero.flats
    # A unit offloaded with its parameters is stepped where it lives; any other shard through a host copy.
    assert all(flat.offloaded == (flat.unit.offload is None) for flat in flats)
    assert all(shard.device.type == "cpu" for shard in optimizer._zero.shard_params)
    # Host copies (the CPU here, so: not views of the units' shards), or the offloaded shards themselves.
    stepped = {shard.untyped_storage().data_ptr() for shard in optimizer._zero.shard_params}
    units_shards = {flat.master.untyped_storage().data_ptr(): flat for flat in flats}
    assert all(units_shards[ptr].unit.offload == "parameters" for ptr in stepped & units_shards.keys())
    train(hvd, model, optimizer)
    assert_close_to(hvd, model, reference(hvd.size())[0], **ONE_PROCESS)


def saved_bytes(model, tokens) -> int:
    """Bytes autograd saves for backward in one forward (outside activation checkpoints, which hold theirs)."""
    total = []

    def pack(tensor):
        total.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(model, tokens)
    loss.backward()
    return sum(total)


def test_checkpointed_units_train_alike_save_less_and_are_whole_when_recomputed(hvd):
    probes = [hvd.shard_parameters(build(), units=[Block], checkpoint_activations=c) for c in (True, False)]
    tokens = data(hvd.size())[0][:ROWS]
    assert saved_bytes(probes[0], tokens) < saved_bytes(probes[1], tokens) / 2
    model, optimizer = sharded(hvd, checkpoint_activations=True)
    plain, plain_optimizer = sharded(hvd)
    runs = []  # (in backward, weight whole) at each run of a block's inner Linear
    model.blocks[1].up.register_forward_pre_hook(
        lambda m, args: runs.append((torch._C._current_graph_task_id() != -1, m.weight.numel() > 0))
    )
    train(hvd, model, optimizer)
    positions = model._hvdplus_zero3.position
    train(hvd, plain, plain_optimizer)
    assert runs == [(False, True), (True, True)] * STEPS  # each forward recomputed once, on the gathered unit
    assert positions == plain._hvdplus_zero3.position == 4 + 3 + 4  # no extra gather: the backward's is used
    assert_close_to(hvd, model, whole_model(hvd, plain), **EXACT)


def test_checkpointed_units_regather_the_units_inside_them_for_the_recomputation(hvd):
    """Linear units inside checkpointed Block units: released after their forward, whole again when the Block
    recomputes in backward (the backward's prefetch brought each `down`; their forward hooks gather each `up`)."""
    model, optimizer = sharded(hvd, units=[Block, torch.nn.Linear], checkpoint_activations=True)
    runtime_ = model._hvdplus_zero3
    regathered, whole_when_recomputed = [], []
    gather = runtime_.gather

    def spy(unit):
        if runtime_.recomputing and not unit.gathered:
            regathered.append(unit.name)
        gather(unit)

    runtime_.gather = spy
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not model.head:
            module.register_forward_pre_hook(
                lambda m, args: whole_when_recomputed.append(m.weight.numel() > 0) if runtime_.recomputing else None
            )
    train(hvd, model, optimizer)
    assert whole_when_recomputed == [True] * (STEPS * 2 * BLOCKS)
    assert sorted(set(regathered)) == [f"blocks.{i}.up" for i in range(BLOCKS)]
    assert_close_to(hvd, model, reference(hvd.size())[0], **ONE_PROCESS)


def test_out_of_memory_in_a_gather_raises_on_every_rank_naming_the_unit(hvd):
    """The last rank cannot allocate blocks.1's buffer when it prefetches it: it raises the OutOfMemoryError
    naming the unit, and the other ranks, whose gather of blocks.1 it tagged as failed, raise instead of waiting."""
    if hvd.size() == 1:
        pytest.skip("needs another rank to be left waiting")
    model, optimizer = sharded(hvd)
    train(hvd, model, optimizer, steps=1)  # the order prefetch follows
    unit = next(u for u in model._hvdplus_zero3.units if u.name == "blocks.1")
    if hvd.rank() == hvd.size() - 1:

        def out_of_memory(k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

        unit._allocate = out_of_memory
        with pytest.raises(torch.OutOfMemoryError, match="gathering ZeRO-3 unit 'blocks.1'.*Tried to allocate"):
            model(data(hvd.size())[0][:, :-1])
    else:
        with pytest.raises(CollectiveMismatchError, match="blocks.1.*out of memory on rank"):
            model(data(hvd.size())[0][:, :-1])
    hvd.barrier()


def test_a_meta_model_is_materialised_one_unit_at_a_time_on_the_given_device(hvd):
    torch.manual_seed(3)
    with torch.device("meta"):
        model = TinyGPT()
    live = []

    def init(module):  # the parameters that exist whole (not meta, not released) as each module initialises
        seen = {id(p): p for p in [*module.parameters(recurse=False), *model.parameters()]}  # a tie's stand-in too
        live.append(sum(p.numel() for p in seen.values() if not p.is_meta))
        default_init(module)

    hvd.shard_parameters(model, units=[Block], init=init, device=torch.device("cpu"))
    units = {u.name: u for u in model._hvdplus_zero3.units}
    assert all(u.device == torch.device("cpu") for u in units.values())
    root, block = (sum(shape.numel() for shape in units[name].shapes) for name in ("<root>", "blocks.0"))
    whole_model = sum(p.numel() for p in build().parameters())
    assert max(live) <= root + block < whole_model  # never more than the root's and one unit's parameters
    optimizer = hvd.ZeroOptimizer(optimizer_for("adamw", model.parameters()), named_parameters=model.named_parameters())
    train(hvd, model, optimizer)
    assert_close_to(hvd, model, reference(hvd.size(), model=build(3))[0], **ONE_PROCESS)


class Rotary(torch.nn.Module):
    """A buffer computed in __init__ (a rotary embedding's inverse frequencies), and running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, WIDTH, 2).float() / WIDTH)))
        self.norm = torch.nn.BatchNorm1d(WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.inv_freq.repeat(2)


def test_meta_buffers_are_set_by_their_initialisation_or_raise_naming_them(hvd):
    """A meta-built buffer takes its value from init=, reset_parameters() or reset_running_stats(); one that none
    of them sets (a rotary inv_freq computed in __init__) raises at shard_parameters, naming it, instead of
    holding uninitialised memory. The ranks' buffers are digested with the parameters."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(Rotary(), torch.nn.Linear(WIDTH, WIDTH))
    with pytest.raises(ValueError, match=r"buffer '0.inv_freq' of Rotary was built on the meta device.*init="):
        hvd.shard_parameters(model, units=[Rotary])

    def init(module, through_data):
        default_init(module)
        if isinstance(module, Rotary):  # computed on the device, as in __init__
            inv_freq = 1.0 / (10000 ** (torch.arange(0, WIDTH, 2).float() / WIDTH))
            if through_data:  # a write that bumps no version counter
                module.inv_freq.data.copy_(inv_freq)
            else:
                module.inv_freq = inv_freq

    for through_data in (False, True):
        torch.manual_seed(0)  # the same draws on every rank
        with torch.device("meta"):
            model = torch.nn.Sequential(Rotary(), torch.nn.Linear(WIDTH, WIDTH))
        for name, buffer in model.named_buffers():  # what an uninitialised allocation could hold
            assert buffer.is_meta, name
        hvd.shard_parameters(model, units=[Rotary], init=lambda m: init(m, through_data), device=torch.device("cpu"))
        torch.testing.assert_close(model[0].inv_freq, Rotary().inv_freq, rtol=0, atol=0)
    norm = model[0].norm  # reset_running_stats(): zeros and ones, whatever the allocation held
    assert torch.equal(norm.running_mean, torch.zeros(WIDTH)) and torch.equal(norm.running_var, torch.ones(WIDTH))
    assert int(norm.num_batches_tracked) == 0


def test_buffers_that_differ_between_ranks_raise_on_every_rank(hvd):
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    model = torch.nn.Sequential(Rotary(), torch.nn.Linear(WIDTH, WIDTH))
    if hvd.rank() == hvd.size() - 1:
        model[0].norm.running_mean.fill_(1.0)
    with pytest.raises(CollectiveMismatchError, match=r"Buffer '0.norm.running_mean' differs between ranks"):
        hvd.shard_parameters(model, units=[Rotary])


def test_ranks_that_shard_on_different_kinds_of_device_raise_on_every_rank(hvd):
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    model, _ = sharded(hvd)
    units = model._hvdplus_zero3.units
    device = torch.device("cuda" if hvd.rank() == 1 else "cpu")  # as a rank would report a GPU model
    with pytest.raises(CollectiveMismatchError, match="same kind of device on every rank.*has cuda"):
        check_same_everywhere(units, {u.name: [b""] * len(u.params) for u in units}, hvd.global_process_set, device, [])
