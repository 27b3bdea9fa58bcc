"""ZeroOptimizer, checked against single-process AdamW on the combined batch, and its checkpoints.

Written to pass at any world size; run by tests/parallel/test_jobs.py on 2 and 3 ranks. Tolerances: float32
sums of N partial gradients in another order than the one-process backward differ by a few ulps, and Adam's
update divides by sqrt(v), so 5 steps agree to rtol 1e-5 / atol 1e-6 (measured: ~1e-7)."""

from __future__ import annotations

import os

import pytest
import torch

from hvdplus.common.basics import runtime
from hvdplus.common.exceptions import CollectiveMismatchError, PlanMismatchError
from hvdplus.common.ops import OpKind
from tests.parallel.process_sets import rest  # noqa: F401 (fixture)

STEPS, PER_RANK = 5, 4
# HVDPLUS_STAGED_PATH_ON_CPU=1 (the path of CUDA tensors without a device plane, through host copies) never plans.
STAGED = os.environ.get("HVDPLUS_STAGED_PATH_ON_CPU") == "1"
planned_only = pytest.mark.skipif(STAGED, reason="the staged path is never planned (test_the_staged_path_...)")


def make_model(seed: int = 0, frozen: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    if frozen:
        model[0].bias.requires_grad_(False)
    return model


def batches(size: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(99)
    return [
        (torch.randn(size * PER_RANK, 6, generator=generator), torch.randn(size * PER_RANK, 3, generator=generator))
        for _ in range(steps)
    ]


def make_optimizer(model: torch.nn.Module, groups: bool) -> torch.optim.Optimizer:
    if not groups:
        return torch.optim.AdamW([p for p in model.parameters()], lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(
        [{"params": list(model[0].parameters()), "lr": 3e-2}, {"params": list(model[2].parameters())}],
        lr=1e-2,
        weight_decay=0.1,
    )


def reference(
    size: int,
    steps: int = STEPS,
    groups: bool = False,
    frozen: bool = False,
    clip: float | None = None,
    start: torch.nn.Module | None = None,
):
    """One process, the whole batch of all ranks, plain AdamW (from `start`, else make_model's weights)."""
    model = make_model(frozen=frozen) if start is None else start
    optimizer = make_optimizer(model, groups)
    norms = []
    for x, y in batches(size, steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
    return model, optimizer, norms


def train(
    hvd,
    steps: int = STEPS,
    passes: int = 1,
    groups: bool = False,
    frozen: bool = False,
    clip: float | None = None,
    model=None,
    optimizer=None,
    first_step: int = 0,
    **kwargs,
):
    """Rank r trains on its rows of each global batch, in `passes` micro-batches."""
    if model is None:
        model = make_model(seed=hvd.rank(), frozen=frozen)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.ZeroOptimizer(
            make_optimizer(model, groups),
            named_parameters=model.named_parameters(),
            backward_passes_per_step=passes,
            **kwargs,
        )
    rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
    norms = []
    for x, y in batches(hvd.size(), steps)[first_step:]:
        optimizer.zero_grad()
        for xm, ym in zip(x[rows].chunk(passes), y[rows].chunk(passes)):
            (torch.nn.functional.mse_loss(model(xm), ym) / passes).backward()
        if clip is not None:
            norms.append(float(optimizer.clip_grad_norm_(clip)))
        optimizer.step()
    return model, optimizer, norms


def assert_same_parameters(model, expected, **tolerance):
    for got, want in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), **(tolerance or {"rtol": 1e-5, "atol": 1e-6}))


def held_state_bytes(optimizer) -> dict[str, int]:
    """The bytes of the storages that hold ZeroOptimizer's state per element, by device type: the wrapped
    optimizer's state tensors (Adam's moments; not its step counts), the gradient shards it reduces into and,
    offloaded, its host copies of the master ranges. Each storage counted once and whole: a shard that is a view
    of a full-size buffer counts as that buffer."""
    tensors = [v for state in optimizer.state.values() for k, v in state.items() if torch.is_tensor(v) and k != "step"]
    tensors += [flat.grad for flat in optimizer._zero.flats]
    tensors += [flat.stepped for flat in optimizer._zero.flats if flat.offloaded]
    storages = {t.untyped_storage().data_ptr(): (t.device.type, t.untyped_storage().nbytes()) for t in tensors}
    held: dict[str, int] = {}
    for device, nbytes in storages.values():
        held[device] = held.get(device, 0) + nbytes
    return held


def assert_state_is_one_nth(hvd, model, optimizer, where: str) -> None:
    """ZeroOptimizer (AdamW, float32) holds 1/N of its state, all on device type `where`: two moments and a
    gradient per element of this rank's shard (and offloaded, the master's host copy), the shard being N-th of
    the trainable elements to one element."""
    elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_element = 4 * (3 + any(flat.offloaded for flat in optimizer._zero.flats))
    held = held_state_bytes(optimizer)
    assert set(held) == {where}, held
    shard = held[where] / per_element
    assert elements // hvd.size() <= shard <= -(-elements // hvd.size()), (held, elements)


@pytest.mark.parametrize("passes", [1, 2])
def test_matches_single_process_adamw_and_holds_one_nth_of_the_state(hvd, passes):
    model, optimizer, _ = train(hvd, passes=passes)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert_same_parameters(model, reference(hvd.size())[0])
    total = sum(p.numel() for p in model.parameters())
    moments = sum(state["exp_avg"].numel() for state in optimizer.state.values())
    assert moments in (total // hvd.size(), total // hvd.size() + 1)  # this rank's shard, not the model
    assert_state_is_one_nth(hvd, model, optimizer, "cpu")  # and nothing bigger behind it
    assert all(p.grad is None for p in model.parameters())  # the gradients live in the flat buffer
    assert runtime().coordinator.counters.largest_batch.get(OpKind.REDUCESCATTER, 0) >= 1


def test_two_param_groups_with_their_own_lr_and_a_frozen_parameter(hvd):
    model, optimizer, _ = train(hvd, groups=True, frozen=True)
    expected, _, _ = reference(hvd.size(), groups=True, frozen=True)
    assert_same_parameters(model, expected)
    assert [group["lr"] for group in optimizer.param_groups] == [3e-2, 1e-2]
    assert torch.equal(model[0].bias, make_model()[0].bias)  # frozen: never stepped


class WithScale(torch.nn.Module):
    """make_model's network times a learnable 0-d parameter."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.net = make_model(seed)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def test_the_wrapped_optimizer_sees_whole_parameters_with_their_shapes_and_a_0d_one_trains(hvd):
    model = WithScale(seed=hvd.rank())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), named_parameters=model.named_parameters()
    )
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() > 0}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(tuple(p.shape) in shapes for p in stepped) >= len(stepped) - 2  # whole, shaped like the model's
    assert all(p.dim() == 1 for p in stepped if tuple(p.shape) not in shapes)  # only boundary pieces are flat
    reference_model = WithScale()
    reference_optimizer = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
    for x, y in batches(hvd.size()):
        for m, opt, data in ((model, optimizer, (x[rows], y[rows])), (reference_model, reference_optimizer, (x, y))):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(data[0]), data[1]).backward()
            opt.step()
    assert_same_parameters(model, reference_model)
    full = optimizer.consolidated_state_dict(to=0)
    if full is not None:
        index = [name for name, _ in model.named_parameters()].index("scale")
        expected = reference_optimizer.state[reference_model.scale]["exp_avg"]  # 0-d, like the parameter
        torch.testing.assert_close(full["state"][index]["exp_avg"], expected, rtol=1e-5, atol=1e-9)


def test_lr_scheduler_steps_the_wrapped_optimizer(hvd):
    model = make_model(seed=hvd.rank())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.ZeroOptimizer(make_optimizer(model, False), named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    reference_model = make_model()
    reference_optimizer = make_optimizer(reference_model, False)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optimizer, step_size=2, gamma=0.5)
    rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
    for x, y in batches(hvd.size()):
        for m, opt, sched, data in (
            (model, optimizer, scheduler, (x[rows], y[rows])),
            (reference_model, reference_optimizer, reference_scheduler, (x, y)),
        ):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(data[0]), data[1]).backward()
            opt.step()
            sched.step()
    assert optimizer.param_groups[0]["lr"] == reference_optimizer.param_groups[0]["lr"] == 1e-2 * 0.25
    assert_same_parameters(model, reference_model)


def test_clip_grad_norm_uses_the_global_norm(hvd):
    model, _, norms = train(hvd, clip=0.05)
    expected, _, expected_norms = reference(hvd.size(), clip=0.05)
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    assert all(norm > 0.05 for norm in norms)  # the clipping really scaled the gradients
    assert_same_parameters(model, expected)


def test_bf16_compression_rounds_the_gradients_within_its_tolerance(hvd):
    model, _, _ = train(hvd, compression=hvd.Compression.bf16)
    exact = reference(hvd.size())[0]
    # bf16 keeps 8 bits of mantissa (relative error 2^-9 per gradient); Adam's update is lr * m / sqrt(v), so
    # 5 steps of lr 1e-2 move a parameter by at most 5e-2 and the rounding changes that by well under 1e-3.
    assert_same_parameters(model, exact, rtol=0, atol=1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), exact.parameters()))  # it did round


def test_consolidated_state_loads_into_plain_adamw_and_resumes_bit_for_bit(hvd, tmp_path_factory):
    _, optimizer, _ = train(hvd, steps=3)
    full = optimizer.consolidated_state_dict(to=0)
    assert (full is None) == (hvd.rank() != 0)
    full = hvd.broadcast_object(full, root_rank=0)
    _, expected_optimizer, _ = reference(hvd.size(), steps=3)
    plain = expected_optimizer.state_dict()
    assert full["param_groups"] == plain["param_groups"]
    for index, state in plain["state"].items():
        torch.testing.assert_close(full["state"][index]["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        assert float(full["state"][index]["step"]) == float(state["step"]) == 3
    reloaded = make_model()
    torch.optim.AdamW(reloaded.parameters()).load_state_dict(full)  # a plain optimizer takes the file
    uninterrupted, _, _ = train(hvd, steps=STEPS)
    resumed_model, _, _ = train(hvd, steps=3)
    assert_resumes_bit_for_bit(hvd, resumed_model, lambda fresh: fresh.load_state_dict(full), 3, uninterrupted)


def test_sharded_state_round_trip_resumes_bit_for_bit(hvd):
    uninterrupted, _, _ = train(hvd, steps=STEPS)
    model, optimizer, _ = train(hvd, steps=2)
    shard = optimizer.sharded_state_dict()
    assert_resumes_bit_for_bit(hvd, model, lambda fresh: fresh.load_sharded_state_dict(shard), 2, uninterrupted)


def assert_resumes_bit_for_bit(hvd, model, load, first_step: int, uninterrupted) -> None:
    """A fresh model with `model`'s weights and a fresh ZeroOptimizer given the saved state by `load` trains the
    remaining steps to the parameters of the uninterrupted run: exactly at 2 ranks; at 3 and more, to an ulp or
    two, because a fresh optimizer negotiates its first step, whose reduce-scatter (the executor's, on the world's
    communicator) may sum in another order than the planned step it replaces (on the plan's own)."""
    fresh_model = make_model()
    fresh_model.load_state_dict(model.state_dict())
    fresh = hvd.ZeroOptimizer(make_optimizer(fresh_model, False), named_parameters=fresh_model.named_parameters())
    load(fresh)
    train(hvd, model=fresh_model, optimizer=fresh, first_step=first_step)
    for a, b in zip(fresh_model.parameters(), uninterrupted.parameters()):
        if hvd.size() == 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_misuse_and_bad_state_are_refused(hvd):
    model, optimizer, _ = train(hvd, steps=1)
    with pytest.raises(RuntimeError, match="consolidated_state_dict"):
        optimizer.state_dict()
    full = hvd.broadcast_object(optimizer.consolidated_state_dict(to=0), root_rank=0)
    before = {k: v["exp_avg"].clone() for k, v in optimizer.state.items()}
    bad = {"state": dict(full["state"]), "param_groups": full["param_groups"]}
    bad["state"][0] = dict(full["state"][0], exp_avg=torch.zeros(5))
    with pytest.raises(ValueError, match="has shape"):
        optimizer.load_state_dict(bad)
    with pytest.raises(ValueError, match="param groups"):
        optimizer.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
    assert all(torch.equal(optimizer.state[k]["exp_avg"], v) for k, v in before.items())  # nothing changed
    wrong = dict(optimizer.sharded_state_dict(), zero={"size": hvd.size() + 1})
    with pytest.raises(ValueError, match="do not fit this optimizer"):
        optimizer.load_sharded_state_dict(wrong)


def test_parameters_that_differ_between_ranks_raise_on_every_rank(hvd):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3 + (1 if hvd.rank() == hvd.size() - 1 else 0))
    with pytest.raises(CollectiveMismatchError, match="'weight' of shape"):
        hvd.ZeroOptimizer(torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters())


def test_shards_over_a_process_set_without_rank_0(hvd, rest):
    model = make_model()
    if not rest.included():
        with pytest.raises(ValueError, match="not in"):
            hvd.ZeroOptimizer(make_optimizer(model, False), process_set=rest)
        return
    members = list(rest.ranks)
    optimizer = hvd.ZeroOptimizer(
        make_optimizer(model, False), named_parameters=model.named_parameters(), process_set=rest
    )
    rows = slice(members.index(hvd.rank()) * PER_RANK, (members.index(hvd.rank()) + 1) * PER_RANK)
    for x, y in batches(len(members)):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    assert_same_parameters(model, reference(len(members))[0])
    assert (optimizer._zero.frozen is not None) == (len(members) > 1)  # planned on a set without rank 0
    assert optimizer.consolidated_state_dict(to=members[0]) is None or hvd.rank() == members[0]


@pytest.mark.skipif(not STAGED, reason="the staged path runs under HVDPLUS_STAGED_PATH_ON_CPU=1")
def test_the_staged_path_stages_every_collective_through_host_copies_and_never_plans(hvd, monkeypatch):
    """CPU tensors standing for CUDA tensors without a device plane: each reduce-scatter and allgather reaches the
    core as a host copy that does not share the buffer's memory, its result is copied back, and no plan freezes
    (the host engine cannot take device memory); the training equals one process's."""
    from hvdplus.torch.zero import shards as zero

    shared = []  # per collective buffer: whether the core's buffer is the tensor's own memory
    collective_input = zero.collective_input

    def spy(tensor):
        buffer, device = collective_input(tensor)
        shared.append(buffer.ctypes.data == tensor.data_ptr())
        return buffer, device

    monkeypatch.setattr(zero, "collective_input", spy)
    model = make_model(seed=0)
    optimizer = hvd.ZeroOptimizer(make_optimizer(model, groups=False), named_parameters=model.named_parameters())
    train(hvd, model=model, optimizer=optimizer)
    assert optimizer._zero.frozen is None
    assert len(shared) >= 2 * STEPS and not any(shared)
    assert_same_parameters(model, reference(hvd.size())[0])


@planned_only
def test_the_plan_freezes_after_the_first_step_and_leaves_with_its_optimizer(hvd, monkeypatch):
    """After the first (negotiated) step every bucket's reduce-scatter, and the allgather of the updated shards,
    run on the frozen plan's communicator: no more negotiated collectives, and the same parameters as one
    process. A dropped optimizer takes its hooks and plan with it."""
    import gc
    import weakref

    from hvdplus.torch.zero import shards as zero

    negotiated: list[str] = []
    for kind in ("submit_reducescatter", "submit_allgather"):
        submit = getattr(zero.core, kind)
        counted = lambda *a, submit=submit, kind=kind, **k: negotiated.append(kind) or submit(*a, **k)  # noqa: E731
        monkeypatch.setattr(zero.core, kind, counted)
    model, optimizer, _ = train(hvd)
    shards = optimizer._zero
    assert shards.frozen is not None and shards.frozen.steps == STEPS - 1
    # The wrapping's parameter check (allgather_object: sizes, then data), then the first step's reduce-scatters.
    # The plan freezes at the end of the first step's synchronize, so that step's allgather is already planned.
    expected = ["submit_allgather"] * 2 + ["submit_reducescatter"] * len(shards.buckets)
    assert sorted(negotiated) == expected, negotiated
    assert_same_parameters(model, reference(hvd.size())[0])
    plan, owner = weakref.ref(shards.frozen), weakref.ref(shards)
    del optimizer, shards
    gc.collect()
    assert owner() is None and plan() is None
    torch.nn.functional.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()  # no hook left to fire
    assert all(p.grad is not None for p in model.parameters())


@planned_only
def test_a_changed_model_fails_the_planned_step_on_every_rank(hvd):
    model, optimizer, _ = train(hvd, steps=2)
    assert optimizer._zero.frozen is not None
    last = hvd.size() - 1
    if hvd.rank() == last:  # no longer a view of the optimizer's flat buffer
        model[0].weight.data = model[0].weight.data.clone()
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
    with pytest.raises(PlanMismatchError, match=rf"rank\(s\) \[{last}\] differs"):
        optimizer.step()
    assert optimizer._zero.frozen is None


@planned_only
def test_a_rank_in_join_fails_the_planned_step_as_horovod_fails_a_reducescatter(hvd):
    model, optimizer, _ = train(hvd, steps=2)
    assert optimizer._zero.frozen is not None
    if hvd.rank() == 0:
        hvd.join()  # serves the plan's step with zeros, and sees it end
        assert optimizer._zero.frozen.closed
    else:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
        with pytest.raises(RuntimeError, match="Reducescatter is not supported with Join at this time"):
            optimizer.step()
        assert optimizer._zero.frozen is None
        hvd.join()
    train(hvd, model=model, optimizer=optimizer, steps=2)  # negotiated again, then planned again
    assert optimizer._zero.frozen is not None and not optimizer._zero.frozen.closed


@planned_only
def test_planned_steps_appear_in_the_timeline(hvd, tmp_path):
    """Rank 0's timeline shows each planned step's reduce-scatters and allgather (PLANNED_ spans inside the op's)."""
    import json

    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path))
    _, optimizer, _ = train(hvd)
    hvd.stop_timeline()
    assert optimizer._zero.frozen is not None
    if hvd.rank() != 0:
        return
    events = [e for e in json.loads(path.read_text()) if e.get("ph") == "B"]
    assert sum(e["name"] == "PLANNED_REDUCESCATTER" for e in events) == (STEPS - 1) * len(optimizer._zero.buckets)
    assert sum(e["name"] == "PLANNED_ALLGATHER" for e in events) == STEPS  # one dtype; frozen before step 1's


@pytest.mark.parametrize("passes", [1, 2])
def test_offloaded_optimizer_steps_host_copies_and_matches_single_process_adamw(hvd, monkeypatch, passes):
    """offload="optimizer": the wrapped optimizer steps host copies of this rank's range (not views of the
    model's flat buffer), each bucket's reduced slice reaches the host through a staged copy, and the updated
    range goes back before the allgather; the training equals one process's."""
    from hvdplus.torch.zero import shards as zero

    staged: list[int] = []
    host_empty = zero.host_empty
    monkeypatch.setattr(zero, "host_empty", lambda n, *a: staged.append(n) or host_empty(n, *a))
    model, optimizer, _ = train(hvd, passes=passes, offload="optimizer")
    assert_same_parameters(model, reference(hvd.size())[0])
    shards = optimizer._zero
    assert all(flat.offloaded for flat in shards.flats)
    flat_storage = shards.flats[0].master.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() != flat_storage for p in shards.shard_params)
    assert all(state["exp_avg"].device.type == "cpu" for state in optimizer.state.values())
    assert_state_is_one_nth(hvd, model, optimizer, "cpu")
    mine = sum(flat.part.counts[shards.index] for flat in shards.flats)
    # Every step copies this rank's reduced slices to the host (at least `mine` elements), after the host copies.
    assert sum(staged) >= mine * (1 + STEPS) and len(staged) >= STEPS


def test_offloaded_optimizer_clips_and_resumes_from_its_sharded_state(hvd):
    model, _, norms = train(hvd, clip=0.05, offload="optimizer")
    expected, _, expected_norms = reference(hvd.size(), clip=0.05)
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    assert_same_parameters(model, expected)
    uninterrupted, _, _ = train(hvd, steps=STEPS, offload="optimizer")
    model, optimizer, _ = train(hvd, steps=2, offload="optimizer")
    shard = optimizer.sharded_state_dict()
    assert_resumes_bit_for_bit(hvd, model, lambda fresh: fresh.load_sharded_state_dict(shard), 2, uninterrupted)


WRITES = ["broadcast_parameters", "load_state_dict", "torch.nn.init", "p.data.copy_", "TorchState.restore"]


def write_rank_0s_start(hvd, model: torch.nn.Module, how: str) -> None:
    """Give every rank the weights `start_written_by(how)` returns, by `how`, a write made after wrapping."""
    if how == "broadcast_parameters":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif how == "load_state_dict":
        model.load_state_dict(make_model(seed=7).state_dict())
    elif how == "torch.nn.init":
        torch.manual_seed(8)
        for p in model.parameters():
            torch.nn.init.uniform_(p, -0.5, 0.5)
    elif how == "TorchState.restore":
        state = hvd.elastic.TorchState(model=model)
        state.sync()  # rank 0's weights, as an elastic run starts
        state.commit()
        torch.manual_seed(100 + hvd.rank())
        for p in model.parameters():
            torch.nn.init.normal_(p)
        state.restore()
    else:
        for p, q in zip(model.parameters(), make_model(seed=7).parameters()):
            p.data.copy_(q)


def start_written_by(how: str) -> torch.nn.Module:
    model = make_model(seed=1)  # rank 0's own start (seeded by rank + 1)
    if how in ("load_state_dict", "p.data.copy_"):
        model = make_model(seed=7)
    elif how == "torch.nn.init":
        torch.manual_seed(8)
        for p in model.parameters():
            torch.nn.init.uniform_(p, -0.5, 0.5)
    return model


@pytest.mark.parametrize("offload", [None, "optimizer"])
@pytest.mark.parametrize("how", WRITES)
def test_a_write_to_the_parameters_after_wrapping_reaches_the_next_step(hvd, how, offload):
    """Horovod's order (wrap, then broadcast_parameters) and every other in-place write after wrapping: the
    steps start from the written weights, with the optimizer offloaded too (whose host master is taken again at
    each step), equal to one process from those weights."""
    model = make_model(seed=hvd.rank() + 1)  # the ranks start apart
    optimizer = hvd.ZeroOptimizer(
        make_optimizer(model, groups=False), named_parameters=model.named_parameters(), offload=offload
    )
    write_rank_0s_start(hvd, model, how)
    train(hvd, model=model, optimizer=optimizer)
    assert_same_parameters(model, reference(hvd.size(), start=start_written_by(how))[0])


def test_rebinding_a_parameter_after_wrapping_raises(hvd):
    """`p.data = t` after wrapping would leave the parameter out of the step: step() raises, naming it."""
    model = make_model()
    optimizer = hvd.ZeroOptimizer(make_optimizer(model, groups=False), named_parameters=model.named_parameters())
    model[2].weight.data = model[2].weight.data.clone()
    torch.nn.functional.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
    with pytest.raises(RuntimeError, match=r"'2.weight' no longer is the view.*p.data.copy_\(t\)"):
        optimizer.step()


def test_parameters_on_two_devices_or_other_device_kinds_than_the_peers_are_refused(hvd):
    model = make_model()
    with torch.device("meta"):
        stray = torch.nn.Parameter(torch.empty(3))
    with pytest.raises(ValueError, match="on one device; found '0.weight' on cpu, 'stray' on meta"):
        hvd.ZeroOptimizer(
            torch.optim.AdamW([*model.parameters(), stray]),
            named_parameters=[*model.named_parameters(), ("stray", stray)],
        )
    with pytest.raises(ValueError, match="offload must be None or 'optimizer'"):
        hvd.ZeroOptimizer(torch.optim.AdamW(model.parameters()), offload="parameters")
    last = hvd.size() - 1
    if hvd.rank() == last:  # the last rank's model is on another device than its peers'
        model = model.to("meta")
    with pytest.raises(CollectiveMismatchError, match=f"rank {last}.*'0.weight' of shape .*on meta"):
        hvd.ZeroOptimizer(torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters())
