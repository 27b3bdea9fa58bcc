"""hvd.pipeline.Pipeline against one process training the unpartitioned model on the combined batch.

Written to pass at any world size: each test runs every pipeline depth S > 1 that divides the job's size (2 ranks:
2 stages; 3 ranks: 3 stages; 4 ranks: 2 stages x 2 replicas and 4 stages x 1). Tolerance 1e-5: the pipeline
sums the micro-batches' weighted gradients (and DistributedOptimizer averages the replicas') in another order
than one backward over the whole batch; float32 rounding of a few ulps, far below 1e-5 after 3 SGD steps."""

from __future__ import annotations

import pytest
import torch

STEPS, ROWS = 3, 12  # rows per replica and step: micro-batches of different sizes when M does not divide 12
LR = 0.1
SETUPS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1), ("zero-bubble", 2)]


def make_model(seed: int = 0, layers: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    modules: list[torch.nn.Module] = [torch.nn.Linear(5, 12)]
    for _ in range(layers - 2):
        modules += [torch.nn.Tanh(), torch.nn.Linear(12, 12)]
    modules += [torch.nn.Tanh(), torch.nn.Linear(12, 3)]
    return torch.nn.Sequential(*modules)


def depths(size: int) -> list[int]:
    return [s for s in range(2, size + 1) if size % s == 0]


def batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(replicas * ROWS, 5, generator=generator), torch.randn(replicas * ROWS, 3, generator=generator))
        for _ in range(STEPS)
    ]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def micro_batches_for(stages: int, schedule: str) -> int:
    return 2 * stages if schedule in ("interleaved", "zero-bubble") else 5  # 5 does not divide 12 rows


def train(hvd, pipe, optimizer, replicas: int, passes: int = 1):
    """Train STEPS steps on this replica's rows; returns the losses train_step returned."""
    rows = slice(pipe.replica * ROWS, (pipe.replica + 1) * ROWS)
    losses = []
    for x, y in batches(replicas):
        optimizer.zero_grad()
        for xm, ym in zip(x[rows].chunk(passes), y[rows].chunk(passes)):
            losses.append(float(pipe.train_step(xm, ym, mse)))
        optimizer.step()
    return losses


def reference(replicas: int, passes: int = 1, build=make_model):
    """One process, the unpartitioned model, all replicas' rows, SGD at LR x passes (k passes of DistributedOptimizer
    sum k half-batch mean gradients: k times the whole batch's); returns the model and, per replica, the losses
    of its rows (per pass) before each step."""
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * passes)
    losses: dict[int, list[float]] = {r: [] for r in range(replicas)}
    for x, y in batches(replicas):
        with torch.no_grad():
            for r in range(replicas):
                rows = slice(r * ROWS, (r + 1) * ROWS)
                losses[r] += [float(mse(model(xm), ym)) for xm, ym in zip(x[rows].chunk(passes), y[rows].chunk(passes))]
        optimizer.zero_grad()
        mse(model(x), y).backward()
        optimizer.step()
    return model, losses


def assert_matches(pipe, model) -> None:
    expected = dict(model.named_parameters())
    names = [name for name, _ in pipe.named_parameters()]
    assert names and all(name in expected for name in names)  # the unpartitioned model's names
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name].detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule,virtual", SETUPS)
def test_schedule_matches_single_process_training(hvd, schedule, virtual):
    for stages in depths(hvd.size()):
        pipe = hvd.pipeline.Pipeline(
            make_model(seed=hvd.rank()),
            num_stages=stages,
            micro_batches=micro_batches_for(stages, schedule),
            schedule=schedule,
            virtual_stages=virtual,
        )
        _load_reference_start(pipe)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(pipe.parameters(), lr=LR),
            named_parameters=pipe.named_parameters(),
            process_set=pipe.data_parallel_set,
        )
        losses = train(hvd, pipe, optimizer, pipe.replicas)
        model, expected_losses = reference(pipe.replicas)
        assert_matches(pipe, model)
        assert losses == pytest.approx(expected_losses[pipe.replica], rel=1e-5)
        assert pipe.data_parallel_set.size() == pipe.replicas and pipe.pipeline_set.size() == stages
        assert len(pipe.pipeline_set.ranks) == stages and hvd.rank() in pipe.pipeline_set.ranks
        if virtual > 1:
            assert isinstance(pipe.stage_module, list) and len(pipe.stage_module) == virtual
        computed = {(a.op, a.micro_batch) for a, _, _ in pipe.last_timings}
        split = {a.op.value for a, _, _ in pipe.last_timings}
        assert split == ({"F", "B", "W"} if schedule == "zero-bubble" else {"F", "BW"})  # the B/W split ran
        assert len(computed) > 0


def _load_reference_start(pipe) -> None:
    """Every rank built the model from its own seed: load the reference's initial weights (as a broadcast from
    a rank holding the whole model would)."""
    start = make_model().state_dict()
    pipe.load_state_dict({name: start[name] for name in pipe.state_dict()})


@pytest.mark.parametrize("wrap", ["zero", "accumulate"])
def test_zero_optimizer_and_accumulation_compose(hvd, wrap):
    passes = 2 if wrap == "accumulate" else 1
    for stages in depths(hvd.size()):
        pipe = hvd.pipeline.Pipeline(make_model(), num_stages=stages, micro_batches=2, schedule="1f1b")
        base = torch.optim.SGD(pipe.parameters(), lr=LR)
        if wrap == "zero":
            optimizer = hvd.ZeroOptimizer(
                base, named_parameters=pipe.named_parameters(), process_set=pipe.data_parallel_set
            )
        else:
            optimizer = hvd.DistributedOptimizer(
                base,
                named_parameters=pipe.named_parameters(),
                process_set=pipe.data_parallel_set,
                backward_passes_per_step=2,
            )
        losses = train(hvd, pipe, optimizer, pipe.replicas, passes=passes)
        model, expected = reference(pipe.replicas, passes=passes)
        assert_matches(pipe, model)
        assert losses == pytest.approx(expected[pipe.replica], rel=1e-5)


class Pair(torch.nn.Module):
    """Returns a tuple: the activation, a copy shifted by one, and an integer tensor (row-wise: no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.linear(x)
        return h, h + 1.0, (h[:, 0] > 0).long()


class Merge(torch.nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, shifted, index = pair
        return torch.tanh(h) * shifted + index[:, None].float() * 0.01


def tuple_model() -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 12), Pair(), Merge(), torch.nn.Linear(12, 12), Pair(), Merge(), torch.nn.Linear(12, 3)
    )


def test_tuples_of_tensors_and_micro_batches_of_different_sizes(hvd):
    for stages in depths(hvd.size()):
        pipe = hvd.pipeline.Pipeline(
            tuple_model(),
            num_stages=stages,
            micro_batches=5,
            balance=[2, 5] if stages == 2 else "parameters",
            schedule="1f1b",
        )
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(pipe.parameters(), lr=LR),
            named_parameters=pipe.named_parameters(),
            process_set=pipe.data_parallel_set,
        )
        losses = train(hvd, pipe, optimizer, pipe.replicas)
        model, expected = reference(pipe.replicas, build=tuple_model)
        assert_matches(pipe, model)
        assert losses == pytest.approx(expected[pipe.replica], rel=1e-5)


def test_eval_step_returns_the_output_on_the_last_stage_only(hvd):
    for stages in depths(hvd.size()):
        for schedule, virtual in (("1f1b", 1), ("zero-bubble", 2)):
            pipe = hvd.pipeline.Pipeline(
                make_model(), num_stages=stages, micro_batches=4, schedule=schedule, virtual_stages=virtual
            )
            x = torch.randn(10, 5, generator=torch.Generator().manual_seed(1))
            out = pipe.eval_step(x if pipe.is_first_stage else None)
            if pipe.is_last_stage:
                torch.testing.assert_close(out, make_model()(x).detach(), rtol=1e-6, atol=1e-6)
                assert not out.requires_grad
            else:
                assert out is None


class FailOnCall(torch.nn.Module):
    """Raises on its `at`-th forward call (counting from 0)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.at:
            raise RuntimeError("shape error on purpose")
        return x


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_failing_stage_makes_every_rank_of_the_pipeline_raise_naming_it(hvd, where):
    for stages in depths(hvd.size()):
        layers = list(make_model())
        layers.insert(0 if where == "first" else len(layers), FailOnCall(at=2))  # fails on micro-batch 2
        pipe = hvd.pipeline.Pipeline(layers, num_stages=stages, micro_batches=4, schedule="1f1b")
        failing = 0 if where == "first" else stages - 1
        with pytest.raises(
            hvd.pipeline.PipelineError,
            match=rf"stage {failing} \(rank \d+\) failed on micro-batch "
            r"2 .*shape error on purpose",
        ):
            pipe.train_step(torch.randn(8, 5), torch.randn(8, 3), mse)


def test_bad_arguments_are_refused_before_any_communication(hvd):
    Pipeline = hvd.pipeline.Pipeline
    with pytest.raises(ValueError, match=f"cannot cut 3 layers into {2 * hvd.size()} chunks"):
        Pipeline(
            make_model()[:3], num_stages=hvd.size(), micro_batches=hvd.size(), virtual_stages=2, schedule="interleaved"
        )
    with pytest.raises(ValueError, match="add up to"):
        Pipeline(make_model(), num_stages=hvd.size(), micro_batches=2, balance=[1] * (hvd.size() - 1) + [2])
    with pytest.raises(ValueError, match="must divide"):
        Pipeline(make_model(), num_stages=hvd.size() + 1, micro_batches=2)
    with pytest.raises(ValueError, match="multiple"):
        Pipeline(
            make_model(), num_stages=hvd.size(), micro_batches=hvd.size() + 1, schedule="interleaved", virtual_stages=2
        )
    with pytest.raises(ValueError, match="sample_input"):
        Pipeline(make_model(), num_stages=hvd.size(), micro_batches=2, balance="time")
    with pytest.raises(ValueError, match="schedule"):
        Pipeline(make_model(), num_stages=hvd.size(), micro_batches=2, schedule="pipedream")


def test_balance_by_parameters_and_by_measured_time(hvd):
    stages = hvd.size()
    wide = torch.nn.Sequential(torch.nn.Linear(5, 400), torch.nn.Linear(400, 5), *[torch.nn.Tanh() for _ in range(6)])
    by_parameters = hvd.pipeline.Pipeline(wide, num_stages=stages, micro_batches=2)
    bounds = by_parameters.chunk_bounds
    assert bounds[0] == (0, 1)  # the first Linear alone holds half the parameters
    assert sum(end - start for start, end in bounds) == len(wide)
    by_time = hvd.pipeline.Pipeline(
        wide, num_stages=stages, micro_batches=2, balance="time", sample_input=torch.randn(64, 5)
    )
    assert sum(end - start for start, end in by_time.chunk_bounds) == len(wide)
    everyone = hvd.allgather_object(by_time.chunk_bounds)
    assert all(b == everyone[0] for b in everyone)  # measured on every rank, agreed by all


def test_a_pipeline_built_again_reuses_the_process_sets_of_its_layout(hvd):
    """A second pipeline of the same layout (a rebalance, another model) registers no sets of its own: it takes the
    ones registered before, so that building pipelines adds no rounds threads or groups, and Horovod's rule of one
    set per list of ranks holds."""
    import threading

    first = hvd.pipeline.Pipeline(make_model(), num_stages=hvd.size(), micro_batches=2)
    rounds_threads = sum(thread.name.startswith("hvdplus-rounds-") for thread in threading.enumerate())
    second = hvd.pipeline.Pipeline(make_model(seed=1), num_stages=hvd.size(), micro_batches=2)
    assert second.data_parallel_set.process_set_id == first.data_parallel_set.process_set_id
    assert second.pipeline_set.process_set_id == first.pipeline_set.process_set_id == 0  # every rank: the global set
    assert sum(thread.name.startswith("hvdplus-rounds-") for thread in threading.enumerate()) == rounds_threads


def test_parameters_keep_the_names_of_the_unpartitioned_model(hvd):
    import collections

    named = torch.nn.Sequential(
        collections.OrderedDict(
            [("embed", torch.nn.Linear(5, 12)), ("act", torch.nn.Tanh())]
            + [(f"block{i}", torch.nn.Linear(12, 12)) for i in range(2 * hvd.size())]
        )
    )
    pipe = hvd.pipeline.Pipeline(named, num_stages=hvd.size(), micro_batches=2)
    mine = [name for name, _ in pipe.named_parameters()]
    everyone = [name for names in hvd.allgather_object(mine) for name in names]
    assert everyone == [name for name, _ in named.named_parameters()]  # each once, in model order
    assert set(pipe.state_dict()) == set(mine)


def _messages(pipe) -> int:
    """The sends and receives of this rank's last step: one tensor each for make_model's stages."""
    from hvdplus.common.plans.pipeline_schedules import Op

    moves = (Op.SEND_ACTIVATION, Op.RECV_ACTIVATION, Op.SEND_GRAD, Op.RECV_GRAD)
    return sum(action.op in moves for action in pipe.actions_by_stage[pipe.stage])


@pytest.mark.parametrize("schedule,virtual", SETUPS)
def test_activations_and_gradients_travel_on_the_device_plane(hvd, schedule, virtual):
    """Under HVDPLUS_DEVICE_PATH_ON_CPU=1 (CUDA tensors' code path on CPU tensors) every activation and gradient
    goes on the plane's own channels, counted on its engine, and the training still equals one process's."""
    from hvdplus.common.basics import runtime
    from hvdplus.torch.device_plane import CPU_TEST_KIND

    if CPU_TEST_KIND not in runtime().coordinator.device_kinds:
        pytest.skip("the device plane takes CPU tensors only under HVDPLUS_DEVICE_PATH_ON_CPU=1")
    for stages in depths(hvd.size()):
        micro = micro_batches_for(stages, schedule)
        pipe = hvd.pipeline.Pipeline(
            make_model(), num_stages=stages, micro_batches=micro, schedule=schedule, virtual_stages=virtual
        )
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(pipe.parameters(), lr=LR),
            named_parameters=pipe.named_parameters(),
            process_set=pipe.data_parallel_set,
        )
        received = []
        for chunk in pipe.stage_module if virtual > 1 else [pipe.stage_module]:
            chunk[0].register_forward_pre_hook(lambda module, args: received.append(args[0].device))
        counted = []
        for x, y in batches(pipe.replicas):
            rows = slice(pipe.replica * ROWS, (pipe.replica + 1) * ROWS)
            engine = runtime().coordinator.plane_engine(CPU_TEST_KIND)
            before = 0 if engine is None else engine.p2p_transfers
            optimizer.zero_grad()
            pipe.train_step(x[rows], y[rows], mse)
            optimizer.step()
            counted.append(runtime().coordinator.plane_engine(CPU_TEST_KIND).p2p_transfers - before)
        assert pipe.plane == CPU_TEST_KIND
        assert counted == [_messages(pipe)] * STEPS  # every message on the plane, from the first step
        assert received and all(device.type == "cpu" for device in received)
        model, _ = reference(pipe.replicas)
        assert_matches(pipe, model)


def test_a_dtype_mismatch_between_stages_raises_on_every_rank_naming_the_stage(hvd):
    """Stage 0 hands on float64 activations that stage 1's float32 Linear refuses: every rank of the pipeline
    raises, naming stage 1 and the first micro-batch, whichever way the activations travel."""
    for stages in depths(hvd.size()):
        layers = list(make_model())  # 15 layers
        layers.insert(1, Cast(torch.float64))  # the end of stage 0's chunk
        rest = len(layers) - 2
        sizes = [2] + [rest // (stages - 1) + (1 if i < rest % (stages - 1) else 0) for i in range(stages - 1)]
        pipe = hvd.pipeline.Pipeline(layers, num_stages=stages, micro_batches=3, schedule="1f1b", balance=sizes)
        with pytest.raises(hvd.pipeline.PipelineError, match=r"stage 1 \(rank \d+\) failed on micro-batch 0 .*dtype"):
            pipe.train_step(torch.randn(6, 5), torch.randn(6, 3), mse)


class Cast(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)
