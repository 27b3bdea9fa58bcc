"""DistributedOptimizer and the broadcast helpers, checked against single-process training on the full batch.

Written to pass at any world size; run by tests/parallel/test_jobs.py on 2 and 3 ranks.
Every test names its allreduces with its own prefix so that no two tests share a tensor name."""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager

import pytest
import torch

STEPS = 5
PER_RANK = 4  # samples per rank and step


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def global_batches(size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same STEPS batches of size * PER_RANK samples on every rank."""
    generator = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(size * PER_RANK, 4, generator=generator), torch.randn(size * PER_RANK, 2, generator=generator))
        for _ in range(STEPS)
    ]


def named(model: torch.nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    return [(f"{prefix}.{name}", p) for name, p in model.named_parameters()]


def reference_params(size: int) -> list[torch.Tensor]:
    """Plain SGD with momentum on the full concatenated batch, in this process, no collectives."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in global_batches(size):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train_distributed(hvd, prefix: str, passes: int = 1, **kwargs) -> list[torch.Tensor]:
    """Rank r trains on its rows of each global batch, split into `passes` micro-batches."""
    model = make_model(seed=hvd.rank())  # different start on each rank: broadcast_parameters must fix it
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=named(model, prefix), backward_passes_per_step=passes, **kwargs
    )
    rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
    for x, y in global_batches(hvd.size()):
        optimizer.zero_grad()
        for xm, ym in zip(x[rows].chunk(passes), y[rows].chunk(passes)):
            # Equal micro-batches and a mean loss: dividing by `passes` makes the accumulated gradient the
            # gradient of the mean over this rank's rows; Average over ranks then gives the full-batch one.
            (torch.nn.functional.mse_loss(model(xm), ym) / passes).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


# float32, 5 steps of a tiny MLP: the distributed and reference gradients differ only by summation order
# (a few ulps, ~1e-7 relative), which momentum SGD with lr 0.1 cannot amplify beyond ~1e-6 in 5 steps;
# 1e-5 relative (and 1e-6 absolute for entries near zero) leaves margin and still catches any scaling error.
EXACT = {"rtol": 1e-5, "atol": 1e-6}


def test_matches_single_process_full_batch(hvd):
    for got, want in zip(train_distributed(hvd, "opt.a"), reference_params(hvd.size())):
        torch.testing.assert_close(got, want, **EXACT)


def test_backward_passes_per_step_accumulates(hvd):
    for got, want in zip(train_distributed(hvd, "opt.b", passes=2), reference_params(hvd.size())):
        torch.testing.assert_close(got, want, **EXACT)


def test_fp16_compression(hvd):
    # fp16 keeps 11 significant bits: each gradient element is off by up to 2^-11 ~ 4.9e-4 relative when cast,
    # plus one fp16 rounding per addition across ranks. Gradients here are O(1), lr 0.1, momentum 0.9 over
    # 5 steps sums to at most ~4 gradients' worth of movement: ~4 * 0.1 * 3 * 4.9e-4 ~ 6e-4 of error.
    # 2e-3 covers it, while an unreduced or wrongly scaled gradient moves the parameters by ~1e-2 or more.
    for got, want in zip(
        train_distributed(hvd, "opt.c", compression=hvd.Compression.fp16), reference_params(hvd.size())
    ):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_gradient_predivide_factor_gives_the_same_average(hvd):
    for got, want in zip(
        train_distributed(hvd, "opt.predivide", gradient_predivide_factor=float(hvd.size())),
        reference_params(hvd.size()),
    ):
        torch.testing.assert_close(got, want, **EXACT)


def _adam_state(optimizer: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict())


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        assert state.keys() == got["state"][index].keys()
        for key, value in state.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)


def test_broadcast_parameters_and_adam_state(hvd):
    model = make_model(seed=100 + hvd.rank())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1), betas=(0.8, 0.9 - hvd.rank() / 100))

    # Before any step: the root's params and options everywhere, and the state of Horovod's start-up step on
    # zero gradients (Adam's moments stay zero and the parameters do not move; `step` is 1).
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for got, want in zip(model.parameters(), make_model(seed=100).parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0)
    assert optimizer.param_groups[0]["lr"] == 0.01 and optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    first = _adam_state(optimizer)
    assert float(first["state"][0]["step"]) == 1.0 and not first["state"][0]["exp_avg"].any()

    # After steps with rank-specific data (no allreduce), states differ until broadcast again.
    torch.manual_seed(hvd.rank())
    for _ in range(hvd.rank() + 2):  # a different number of steps per rank, so `step` differs too
        optimizer.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        optimizer.step()
    root_params = hvd.broadcast_object(
        [p.detach().clone() for p in model.parameters()], root_rank=0, name="opt.d.params"
    )
    root_state = hvd.broadcast_object(_adam_state(optimizer), root_rank=0, name="opt.d.state")
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for got, want in zip(model.parameters(), root_params):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    state = _adam_state(optimizer)
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(state["state"][0])
    assert float(state["state"][0]["step"]) == 3.0  # the start-up step and the root's 2 steps
    _assert_same_state(state, root_state)


def test_broadcast_state_of_a_distributed_optimizer_then_train(hvd):
    model = make_model(seed=hvd.rank())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=named(model, "opt.d2")
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    torch.manual_seed(hvd.rank())
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        optimizer.step()
    # Same start, same averaged gradients: every rank holds the same params and state.
    gathered = hvd.allgather_object(
        (_adam_state(optimizer), [p.detach() for p in model.parameters()]), name="opt.d2.check"
    )
    for state, params in gathered[1:]:
        _assert_same_state(state, gathered[0][0])
        for got, want in zip(params, gathered[0][1]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_wrapped_optimizer_is_an_instance_of_the_users_class(hvd):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=named(model, "opt.e"))
    assert isinstance(wrapped, torch.optim.SGD) and type(wrapped).__name__ == "SGD"
    assert wrapped.defaults == optimizer.defaults and wrapped.param_groups[0]["lr"] == 0.5
    calls = []
    wrapped.register_step_post_hook(lambda *args: calls.append(1))
    model(torch.ones(1, 4)).sum().backward()
    wrapped.step()
    assert calls == [1]  # step hooks run once, not once per class in the chain


def test_duplicate_and_missing_names_raise(hvd):
    model = make_model()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="Found duplicates: opt.f.same"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=[("opt.f.same", p) for p in params])
    with pytest.raises(ValueError, match="were not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=named(model, "opt.f")[:1])
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), op=hvd.Sum, gradient_predivide_factor=2.0)


def test_zero_grad_during_allreduce_raises(hvd):
    if hvd.size() == 1:
        pytest.skip("alone, Horovod registers no hooks: zero_grad() cannot know that backward ran")
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named(model, "opt.g")
    )
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called after loss.backward\\(\\)"):
        optimizer.zero_grad()
    optimizer.synchronize()
    optimizer.zero_grad()  # fine once synchronized


def test_unused_parameter_is_reduced_with_zeros(hvd):
    # Only rank 0 uses `extra`; the others contribute zeros, so every rank gets rank 0's gradient / size.
    model = make_model()
    extra = torch.nn.Parameter(torch.ones(3))
    params = named(model, "opt.h") + [("opt.h.extra", extra)]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    loss = model(torch.ones(2, 4)).sum()
    if hvd.rank() == 0:
        loss = loss + (extra * torch.tensor([1.0, 2.0, 3.0])).sum()
    loss.backward()
    with optimizer.skip_synchronize():
        optimizer.synchronize()
        torch.testing.assert_close(extra.grad, torch.tensor([1.0, 2.0, 3.0]) / hvd.size())
        optimizer.step()
    torch.testing.assert_close(extra.detach(), 1 - 0.1 * torch.tensor([1.0, 2.0, 3.0]) / hvd.size())


def test_set_backward_passes_per_step_and_too_many_passes(hvd):
    if hvd.size() == 1:
        pytest.skip("alone, Horovod registers no hooks: backward passes are not counted")
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named(model, "opt.i")
    )
    optimizer.set_backward_passes_per_step(2)
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        model(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def test_buckets_follow_the_engine_unless_set(hvd):
    """With HVDPLUS_BUCKET_BYTES unset, buckets follow the engine's costs: over Gloo (a call costs milliseconds) a
    1.6 MB gradient shares DDP's 25 MiB bucket with the small ones; over MPI (a call costs microseconds) it goes
    alone, in place, and only the small ones go in buckets. Tensors on a device plane (CUDA tensors on NCCL; CPU
    tensors with HVDPLUS_DEVICE_PATH_ON_CPU=1) share DDP's bucket on every engine. A value set for the job wins."""
    from hvdplus.common.basics import runtime

    model = torch.nn.Sequential(
        torch.nn.Linear(8, 640), torch.nn.ReLU(), torch.nn.Linear(640, 640), torch.nn.ReLU(), torch.nn.Linear(640, 3)
    )
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named(model, "policy")
    )
    buckets = {frozenset(bucket) for bucket in optimizer._p_to_group.values()}
    first, large, last = model[0], model[2].weight, model[4]
    assert large.numel() * 4 > 1 << 20
    if runtime().settings.bucket_bytes is not None:
        assert runtime().bucket_bytes == runtime().settings.bucket_bytes
    elif runtime().settings.device_path_on_cpu or hvd.gloo_enabled():
        # DDP's 25 MiB bucket, but the first one closes once it holds 1 MiB (DDP's first-bucket rule): the large
        # gradient reaches that limit and travels in it with the last layer's, while backward still computes the
        # first layer, whose gradients start the next bucket.
        assert hvd.mpi_enabled() or runtime().bucket_bytes == 25 << 20
        assert buckets == {frozenset([*last.parameters(), *model[2].parameters()]), frozenset(first.parameters())}
    else:  # alone: a group of its own, which closes the open bucket
        assert runtime().bucket_bytes == 1 << 20
        assert buckets == {
            frozenset([*last.parameters(), model[2].bias]),
            frozenset([large]),
            frozenset(first.parameters()),
        }
    for _ in range(2):  # the first step negotiates, the second may run planned, with the same buckets
        x = torch.full((2, 8), float(hvd.rank() + 1))
        model(x).sum().backward()
        optimizer.step()  # the step completes with the buckets chosen, on every rank alike
    reducer = optimizer._planned()
    if reducer is not None and runtime().settings.bucket_bytes is None:
        planned = [{id(p) for p in bucket.params} for bucket in reducer._buckets]
        # The planned path has no gradient alone: DDP's first bucket, closed by the large gradient where the buckets
        # are larger than it (25 MiB); over MPI's 1 MiB buckets the large gradient starts the second.
        ddp_sized = runtime().settings.device_path_on_cpu or hvd.gloo_enabled()
        in_first = [*last.parameters(), model[2].bias] + ([large] if ddp_sized else [])
        assert planned[0] == {id(p) for p in in_first}, "DDP's first bucket"
    weights = hvd.allgather(model[0].weight.detach().reshape(1, -1), name="policy.weights")
    assert torch.equal(weights[0], weights[-1])


def test_gradients_travel_in_packed_buckets(hvd):
    """Without groups=, gradients go in DDP-style buckets (HVDPLUS_BUCKET_BYTES, 1 MiB): this small model is one
    bucket, started once backward has produced all of its gradients, as one core request. With
    HVDPLUS_BUCKET_BYTES=0 (tests/parallel/test_jobs.py runs this file so) each gradient goes on its own."""
    from hvdplus.common.basics import runtime
    from hvdplus.common.handles import Completion

    if hvd.size() == 1:
        pytest.skip("alone, no gradient goes through the core (test_a_set_of_one_rank_reduces_nothing_...)")
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named(model, "bucket")
    )
    params = list(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    if runtime().bucket_bytes == 0:
        assert optimizer._p_to_group == {}
        assert all(
            isinstance(handle, Completion) and handle.collectives == 1 for handle, _ in optimizer._handles.values()
        )
    else:
        assert set(optimizer._p_to_group) == set(params) and len(set(optimizer._p_to_group.values())) == 1
        [result] = {id(handle[0]): handle[0] for handle, _ in optimizer._handles.values()}.values()
        assert result.collectives == 1  # one request for the whole bucket
    optimizer.step()


@contextmanager
def set_of_one_rank(hvd):
    """A process set of this rank alone: the global set in a job of one rank (no hooks, as in Horovod), else one
    set per rank (the hooks run, as at any size above one)."""
    if hvd.size() == 1:
        yield hvd.global_process_set
        return
    sets = [hvd.add_process_set([rank]) for rank in range(hvd.size())]
    try:
        yield sets[hvd.rank()]
    finally:
        for process_set in sets:
            hvd.remove_process_set(process_set)


def _plain_steps(model: torch.nn.Module, batches, passes: int, gradient) -> list[torch.Tensor]:
    """Plain torch SGD on `batches` in `passes` micro-batches, with `gradient(g)` applied to each gradient before
    the step (what the allreduce of a set of one rank does: nothing, or a round trip through the compression)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        for xm, ym in zip(x.chunk(passes), y.chunk(passes)):
            (torch.nn.functional.mse_loss(model(xm), ym) / passes).backward()
        for p in model.parameters():
            p.grad = gradient(p.grad)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


ALONE_CASES = {  # DistributedOptimizer's arguments, and what its allreduce alone does to a gradient
    "average": ({}, lambda g: g),
    "sum": ({"op": "Sum"}, lambda g: g),
    "passes": ({"backward_passes_per_step": 2}, lambda g: g),
    "predivide": ({"gradient_predivide_factor": 3.0}, lambda g: g.mul(1 / 3.0).mul(3.0)),  # the core's two factors
    "fp16": ({"compression": "fp16"}, lambda g: g.half().float()),
}


@pytest.mark.parametrize("case", sorted(ALONE_CASES))
def test_a_set_of_one_rank_reduces_nothing_through_the_core(hvd, case, tmp_path, monkeypatch):
    """Alone in its process set, DistributedOptimizer's step() sends no gradient through the core (no request
    submitted, no handle, nothing on the timeline): the gradients are already the answer, rounded through the
    compression and scaled by gradient_predivide_factor's two factors as the core would. The parameters are
    exactly plain torch's, on the same batches with the same rounding."""
    from hvdplus.common.basics import runtime
    from hvdplus.common.handles import Completion

    kwargs, gradient = ALONE_CASES[case]
    kwargs = dict(kwargs)
    if "op" in kwargs:
        kwargs["op"] = getattr(hvd, kwargs["op"])
    if "compression" in kwargs:
        kwargs["compression"] = getattr(hvd.Compression, kwargs["compression"])
    passes = kwargs.get("backward_passes_per_step", 1)
    prefix = f"alone.{case}"
    batches = [(x[:PER_RANK], y[:PER_RANK]) for x, y in global_batches(1)]
    timeline = tmp_path / "timeline.json"
    with set_of_one_rank(hvd) as alone:
        model = make_model()
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=named(model, prefix),
            process_set=alone,
            **kwargs,
        )
        hvd.start_timeline(str(timeline))
        coordinator, submitted = runtime().coordinator, []
        submit = coordinator.submit
        monkeypatch.setattr(
            coordinator, "submit", lambda request, *a, **k: submitted.append(request.name) or submit(request, *a, **k)
        )
        for x, y in batches:
            optimizer.zero_grad()
            for xm, ym in zip(x.chunk(passes), y.chunk(passes)):
                (torch.nn.functional.mse_loss(model(xm), ym) / passes).backward()
            # With hooks (a set of one in a larger job) each gradient is marked done, with no core request.
            assert not any(isinstance(h, (Completion, tuple)) for h, _ in optimizer._handles.values())
            optimizer.step()
        monkeypatch.undo()
        hvd.stop_timeline()
        assert optimizer._reducer is None  # nothing to overlap alone: no plan either
    # (A count of control rounds would not do: the other ranks' collectives, process sets included, run rounds on
    # this rank too.)
    assert submitted == [], f"requests submitted during {STEPS} steps alone: {submitted}"
    got = [p.detach() for p in model.parameters()]
    for g, want in zip(got, _plain_steps(make_model(), batches, passes, gradient)):
        assert torch.equal(g, want), (g - want).abs().max()
    if hvd.rank() == 0:
        events = json.loads(timeline.read_text() or "[]")
        rows = [e["args"]["name"] for e in events if e.get("ph") == "M" and "name" in e.get("args", {})]
        assert not [row for row in rows if prefix in row], rows  # rows are labelled allreduce.<name>


def test_a_set_of_one_rank_keeps_horovods_optimizer_semantics(hvd):
    """Alone: skip_synchronize() after synchronize(), an unused parameter stepped with zeros, and (with the hooks
    a larger job registers) the errors of too many passes and of zero_grad() while gradients are pending."""
    with set_of_one_rank(hvd) as alone:
        model = make_model()
        extra = torch.nn.Parameter(torch.ones(3))
        params = named(model, "alone.semantics") + [("alone.semantics.extra", extra)]
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD([p for _, p in params], lr=0.1, weight_decay=0.5),
            named_parameters=params,
            process_set=alone,
        )
        model(torch.ones(2, 4)).sum().backward()
        if hvd.size() > 1:
            with pytest.raises(RuntimeError, match="zero_grad"):
                optimizer.zero_grad()
        with optimizer.skip_synchronize():
            optimizer.synchronize()
            assert extra.grad is not None and not extra.grad.any()  # zeros, as the core would have reduced
            optimizer.step()
        torch.testing.assert_close(extra.detach(), torch.full((3,), 1 - 0.1 * 0.5))  # weight decay on zeros
        optimizer.zero_grad()
        optimizer.set_backward_passes_per_step(2)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
        if hvd.size() > 1:
            with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
                model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        with pytest.warns(UserWarning, match="skip_synchronize"):
            optimizer.synchronize()
            optimizer.step()


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_a_set_of_one_rank_steps_sparse_gradients_as_plain_torch(hvd, sparse_as_dense):
    """Alone, a sparse gradient stays sparse (coalesced, as the sparse allreduce returns it), and with
    sparse_as_dense it comes back sparse from its dense copy; the parameters match plain torch's."""

    def run(wrap):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        optimizer = wrap(torch.optim.SGD(embedding.parameters(), lr=0.5), embedding)
        for ids in ([1, 2, 2], [3, 1, 9]):
            optimizer.zero_grad()
            embedding(torch.tensor(ids)).pow(2).sum().backward()
            optimizer.step()
            assert embedding.weight.grad.is_sparse
        return embedding.weight.detach().clone()

    with set_of_one_rank(hvd) as alone:
        got = run(
            lambda optimizer, module: hvd.DistributedOptimizer(
                optimizer,
                named_parameters=named(module, f"alone.sparse.{sparse_as_dense}"),
                sparse_as_dense=sparse_as_dense,
                process_set=alone,
            )
        )
    torch.testing.assert_close(got, run(lambda optimizer, module: optimizer), rtol=0, atol=1e-7)
