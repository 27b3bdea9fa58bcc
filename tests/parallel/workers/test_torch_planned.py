"""The planned path of DistributedOptimizer (torch/planned/reducer.py): after the first negotiated step the ranks freeze
the step plan, and from then on gradients live in the reducer's buckets and travel with no negotiation.

Each scenario runs twice in the same job, once on the planned path and once with it switched off (Horovod's
negotiated path, checked against single-process training in test_torch_optimizer.py), and the two must give
the same parameters. Written to pass at any world size; run on 2 and 3 ranks over MPI and Gloo."""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from hvdplus.torch.device_plane import CPU_TEST_KIND

STEPS = 6
LONG = 30  # steps of the test of rounds on ranks outside the process set
PER_RANK = 4


@contextmanager
def planned(enabled: bool, **settings):
    """Run with HVDPLUS_PLANNED_PATH on or off, and any other `settings` (the agreement reads them when it runs)."""
    from hvdplus.common.basics import runtime

    rt = runtime()
    saved = rt.settings
    rt.settings = dataclasses.replace(saved, planned_path=enabled, **settings)
    try:
        yield
    finally:
        rt.settings = saved


class Branchy(torch.nn.Module):
    """Two heads; `forward(x, use_b)` leaves head b without a gradient when use_b is false."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 8)
        self.a = torch.nn.Linear(8, 2)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def batches(size: int, steps: int = STEPS):
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(size * PER_RANK, 4, generator=generator), torch.randn(size * PER_RANK, 2, generator=generator))
        for _ in range(steps)
    ]


def train(
    hvd, prefix: str, *, steps: int = STEPS, use_b=lambda step, rank: True, process_set=None, after=None, **kwargs
):
    """Rank r trains on its rows of each batch, calling `after(step)` after each; returns (model, optimizer)."""
    process_set = process_set or hvd.global_process_set
    size, rank = process_set.size(), process_set.rank()
    model = Branchy()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()],
        process_set=process_set,
        **kwargs,
    )
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step, (x, y) in enumerate(batches(size, steps)):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows], use_b(step, rank)), y[rows]).backward()
        optimizer.step()
        if after is not None:
            after(step)
    return model, optimizer


def parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def both_paths(hvd, prefix: str, **kwargs):
    """(planned parameters, negotiated parameters, the planned optimizer)."""
    with planned(True):
        model, optimizer = train(hvd, f"{prefix}.planned", **kwargs)
    with planned(False):
        reference, negotiated = train(hvd, f"{prefix}.negotiated", **kwargs)
    assert negotiated._reducer is None
    return parameters(model), parameters(reference), optimizer


# Both paths sum the same float32 gradients over the same engine; only the order of additions in a fused
# buffer may differ (a few ulps), which 6 steps of momentum SGD at lr 0.1 keep below 1e-6.
SAME = {"rtol": 1e-5, "atol": 1e-6}


def test_planned_steps_match_negotiated_with_no_copies_and_no_rounds(hvd):
    from hvdplus.common.basics import runtime

    rounds = []

    def count_rounds(step: int) -> None:
        if step == 1:  # let the background thread finish the round after the agreement (it finds no more work)
            time.sleep(0.1)
        rounds.append(runtime().coordinator.counters.rounds)

    with planned(True):
        model, optimizer = train(hvd, "plan.a", after=count_rounds)
    with planned(False):
        reference, _ = train(hvd, "plan.a.negotiated")
    for got, want in zip(parameters(model), parameters(reference)):
        torch.testing.assert_close(got, want, **SAME)
    reducer = optimizer._reducer
    assert reducer is not None, "the plan did not freeze after the first negotiated step"
    assert reducer.steps == STEPS - 1 and reducer.copies == 0
    # On the plane the gradients travel on: the host engine, or (HVDPLUS_DEVICE_PATH_ON_CPU=1, the CUDA code
    # path on CPU tensors) the device plane's torch.distributed engine, whose group takes the tensors themselves.
    assert reducer.host is not runtime().settings.device_path_on_cpu
    if reducer.host and runtime().engine.name == "mpi":  # MPI's blocking calls on the group's own thread
        assert reducer._group.calls.calls_run >= (STEPS - 1) * len(reducer._buckets)
    # Steps 3 to 5 ran no control round: no negotiation, no hand-off to the background thread. (Not step 6: a
    # faster peer that finished it may already negotiate the next training's first step, whose doorbell round
    # this rank joins before its last count; a peer cannot finish step 6 before this rank counted step 5.)
    assert rounds[1] == rounds[-2] > 0, rounds
    # Every gradient is a view of a bucket: backward wrote into the buffer that was reduced.
    flats = {bucket.flat.untyped_storage().data_ptr() for bucket in reducer._buckets}
    assert all(p.grad.untyped_storage().data_ptr() in flats for p in model.parameters())


def test_both_paths_start_their_collectives_with_the_engines_one_call(hvd, monkeypatch):
    """One execution model: the negotiated rounds' executor and the frozen plan start their allreduces with the
    same engine call (DataEngine.start_allreduce), the first on the rounds' groups, the plan on its own group."""
    from hvdplus.common.basics import runtime
    from hvdplus.common.engines.nccl import TorchTensorEngine

    started: list[int] = []  # id() of the group of every allreduce started, by any thread
    for engine_class in {type(runtime().engine), TorchTensorEngine}:
        start = engine_class.start_allreduce

        def spy(self, buf, dtype, op, group, send=None, start=start):
            started.append(id(group))
            return start(self, buf, dtype, op, group, send)

        monkeypatch.setattr(engine_class, "start_allreduce", spy)
    with planned(True):
        _, optimizer = train(hvd, "plan.one_call")
    reducer = optimizer._reducer
    assert reducer is not None
    on_plan = started.count(id(reducer._group))
    assert on_plan >= (STEPS - 1) * len(reducer._buckets), (on_plan, len(started))
    assert len(started) > on_plan  # the first, negotiated step (and the freeze's agreement) on the rounds' groups


def test_unused_parameters_contribute_zeros(hvd):
    # Rank 0 never uses head b after step 1; the other ranks do on odd steps. Buckets still start in the same
    # order everywhere (head b's gradients are zeros on the ranks that skipped it).
    got, want, optimizer = both_paths(hvd, "plan.unused", use_b=lambda step, rank: step < 1 or (rank and step % 2))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **SAME)
    assert optimizer._reducer is not None


def test_fp16_buckets_round_on_the_wire(hvd):
    got, want, optimizer = both_paths(hvd, "plan.fp16", compression=hvd.Compression.fp16)
    assert all(bucket.wire is not None and bucket.wire.dtype == torch.float16 for bucket in optimizer._reducer._buckets)
    for g, w in zip(got, want):  # the same fp16 values reduced on both paths
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


def test_gradient_accumulation_and_predivide(hvd):
    got, want, _ = both_paths(hvd, "plan.predivide", gradient_predivide_factor=float(hvd.size()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **SAME)
    with planned(True):
        _, optimizer = train(hvd, "plan.passes", backward_passes_per_step=2)
    assert optimizer._reducer is not None  # (passes are checked against a reference in test_torch_optimizer.py)


def test_model_zero_grad_costs_one_copy_per_gradient(hvd):
    with planned(True):
        model, optimizer = train(hvd, "plan.copy", steps=3)
    reducer = optimizer._reducer
    assert reducer is not None and reducer.copies == 0
    model.zero_grad()  # set_to_none: backward then makes new gradient tensors, copied into the buckets
    model(torch.randn(PER_RANK, 4)).sum().backward()
    optimizer.step()
    assert reducer.copies == sum(1 for _ in model.parameters()) and reducer.steps == 3


def test_changed_model_fails_the_step_on_every_rank(hvd):
    with planned(True):
        model, optimizer = train(hvd, "plan.changed", steps=2)
    assert optimizer._reducer is not None
    changed = hvd.size() - 1
    x = torch.randn(PER_RANK, 4)
    if hvd.rank() == changed:
        model.double()  # float64 parameters and gradients where the plan has float32 ones
        x = x.double()
    optimizer.zero_grad()
    model(x).sum().backward()
    before = parameters(model)
    with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{changed}\] differs from the plan") as info:
        optimizer.step()
    assert type(info.value).__name__ == "PlanMismatchError"
    assert optimizer._reducer is None  # the next step negotiates again
    for got, want in zip(parameters(model), before):  # raised before the update, on every rank
        assert torch.equal(got, want)


def test_a_device_planes_guard_is_summed_in_host_memory(hvd):
    """On a device plane (CUDA tensors on NCCL; CPU tensors with HVDPLUS_DEVICE_PATH_ON_CPU=1) a step's guard is
    summed by the host engine, in host memory, so reading it copies nothing from the device and waits for no
    kernel; the last bucket holds gradients only. On the host engine the guard rides in the last bucket (read
    from host memory too). Either way every rank reads the same sum: here every rank trained."""
    with planned(True):
        _, optimizer = train(hvd, "plan.guard")
    reducer = optimizer._reducer
    last = reducer._buckets[-1]
    gradients = sum(p.numel() for p in last.params)
    if reducer.host:
        assert reducer._guard_group is None and last.flat.numel() == gradients + 1
    else:
        assert reducer._guard_group is not None and last.flat.numel() == gradients
        assert isinstance(reducer._guard_word, np.ndarray) and reducer._guard_word.tolist() == [hvd.size()]


def test_join_contributes_zeros_to_planned_steps(hvd):
    # Rank 0 runs out of data after 3 steps and joins; the others train 3 more planned steps, then join.
    def train_and_join(prefix: str):
        model = Branchy()
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()],
        )
        rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
        for step, (x, y) in enumerate(batches(hvd.size())):
            if hvd.rank() == 0 and step == 3:
                break
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
        last = hvd.join()
        return parameters(model), optimizer, last

    with planned(True):
        got, optimizer, last = train_and_join("plan.join.planned")
    with planned(False):
        want, _, last_negotiated = train_and_join("plan.join.negotiated")
    assert optimizer._reducer is not None
    assert last in range(1, hvd.size()) and last_negotiated in range(1, hvd.size())  # rank 0 joined first
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **SAME)


def test_process_set_without_rank_0(hvd):
    from hvdplus.common.basics import open_channel, runtime

    rest = hvd.add_process_set(list(range(1, hvd.size())))
    alone = hvd.size() == 2  # rank 1 alone: its steps take no collective at all (test_torch_optimizer.py), no plan
    try:
        if hvd.rank() != 0:
            got, want, optimizer = both_paths(hvd, "plan.set", process_set=rest)
            assert (optimizer._reducer is None) == alone
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, **SAME)
        # The set's steps need nothing from rank 0, outside it: negotiated, they take the set's own rounds
        # (common/control/set_rounds.py); planned, the plan's group. Device tensors (HVDPLUS_DEVICE_PATH_ON_CPU=1 here)
        # are negotiated in the whole job's rounds, where every step takes a round of every rank, members or not;
        # planned, rank 0 then runs only the rounds of the first (negotiated) step and the agreement. Rank 0 waits
        # for the end on a channel (point to point, no round), not in a collective, which would run rounds itself.
        in_world_rounds = CPU_TEST_KIND in runtime().coordinator.device_kinds  # CPU tensors on a device plane
        channel = open_channel()
        for enabled in (False, True):
            hvd.barrier()
            time.sleep(0.05)  # the barrier's last round, in which every rank finds no more work
            before = runtime().coordinator.counters.rounds
            done = np.zeros(1, dtype=np.int64)
            if hvd.rank() != 0:
                with planned(enabled):
                    train(hvd, f"plan.set.long.{enabled}", steps=LONG, process_set=rest)
                if hvd.rank() == 1:
                    channel.isend(done, 0, 0).wait(lambda: None)
            else:
                channel.irecv(done, 1, 0).wait(lambda: None)
                rounds = runtime().coordinator.counters.rounds - before
                kind = "planned" if enabled else "negotiated"
                if alone or not in_world_rounds:
                    assert rounds == 0, f"rank 0 ran {rounds} control rounds during {LONG} {kind} steps of others"
                elif enabled:
                    assert rounds < 12, f"rank 0 ran {rounds} control rounds during {LONG} planned steps of others"
                else:
                    assert rounds >= LONG, f"rank 0 ran {rounds} control rounds during {LONG} negotiated steps"
    finally:
        hvd.remove_process_set(rest)


def test_zero_grad_while_gradients_are_pending_raises_and_clears_parameters_outside_the_plan(hvd):
    with planned(True):
        model, optimizer = train(hvd, "plan.pending", steps=2)
    assert optimizer._reducer is not None
    model(torch.randn(PER_RANK, 4)).sum().backward()
    with pytest.raises(AssertionError, match="zero_grad"):  # AllreduceInFlightError, as Horovod raises
        optimizer.zero_grad()  # as on the negotiated path: the hooks have run, step() has not
    optimizer.step()
    # A parameter that the optimizer holds but the plan does not (it needed no gradient when wrapped) is still
    # cleared by zero_grad, as torch does.
    extra = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    optimizer.param_groups[0]["params"].append(extra)
    extra.grad = torch.ones(3)
    optimizer.zero_grad()
    assert extra.grad is None
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # zeroed views


def test_a_dropped_optimizer_releases_its_plan(hvd):
    import gc
    import weakref

    from hvdplus.common.planned_steps import frozen_plans

    with planned(True):
        model, optimizer = train(hvd, "plan.dropped", steps=2)
    reducer = weakref.ref(optimizer._reducer)
    group = weakref.ref(optimizer._reducer._group)
    del model, optimizer
    gc.collect()  # the hooks hold the optimizer in a cycle with the parameters
    assert reducer() is None and group() is None, "the plan's buffers and communicator outlived its optimizer"
    assert all(plan.runtime is not None for plan in frozen_plans())
    hvd.join()  # serves only the plans still held, the same on every rank


def test_planned_steps_appear_in_the_timeline(hvd, tmp_path):
    """Rank 0's timeline shows each planned step's buckets, a row each (named after its first gradient, as a
    negotiated bucket's grouped allreduce): an ALLREDUCE span holding PLANNED_ALLREDUCE, and no negotiation of
    the optimizer's gradients after the first step; every span closes."""
    import json

    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path))
    with planned(True):
        _, optimizer = train(hvd, "plan.timeline")
    hvd.stop_timeline()
    buckets = len(optimizer._reducer._buckets)
    if hvd.rank() != 0:
        return
    events = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    ours = [e for e in events if e.get("ph") in "BE" and names[e["pid"]].startswith("allreduce.plan.timeline.")]
    planned_starts = [e["ts"] for e in ours if e.get("name") == "PLANNED_ALLREDUCE"]
    negotiated_starts = [e["ts"] for e in ours if e.get("name") == "NEGOTIATE_ALLREDUCE"]
    assert len(planned_starts) == (STEPS - 1) * buckets
    assert negotiated_starts and max(negotiated_starts) < min(planned_starts)  # the first step only
    assert sum(e["ph"] == "B" for e in ours) == sum(e["ph"] == "E" for e in ours)


def test_hierarchical_allreduce_keeps_the_plan_of_device_plane_tensors(hvd):
    """HOROVOD_HIERARCHICAL_ALLREDUCE=1 keeps gradients on the host engine negotiated (the executor runs the
    hierarchical allreduce, on host buffers only), but not those on a device plane (CUDA tensors on NCCL; here CPU
    tensors with HVDPLUS_DEVICE_PATH_ON_CPU=1), which no hierarchy applies to: their plan freezes."""
    from hvdplus.common.basics import runtime

    on_device = runtime().settings.device_path_on_cpu
    with planned(True, hierarchical_allreduce=True):
        got, optimizer = train(hvd, "plan.hierarchical")
    with planned(False):
        want, _ = train(hvd, "plan.hierarchical.negotiated")
    assert (optimizer._reducer is not None) == on_device
    if on_device:
        assert not optimizer._reducer.host and optimizer._reducer.steps == STEPS - 1
    for g, w in zip(parameters(got), parameters(want)):
        torch.testing.assert_close(g, w, **SAME)
