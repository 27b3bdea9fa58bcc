"""Pipeline schedules as data (hvdplus.common.plans.pipeline_schedules): the rules every schedule keeps, its simulated
bubble against the papers' formulas, and the layer partition."""

import collections
import itertools
import random

import pytest

from hvdplus.common.plans.pipeline_schedules import (
    SCHEDULES,
    Action,
    DeadlockError,
    Op,
    balanced_split,
    build_schedule,
    check_sizes,
    chunk_stages,
    simulate,
    theoretical_bubble,
)

F, BW, B, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
TIMES = ("forward", "backward_input", "backward_weight")
CHUNKS_PER_STAGE = {"gpipe": (1,), "1f1b": (1,), "interleaved": (2, 3), "zero-bubble": (1, 2)}
CASES = [
    pytest.param(name, stages, micro, v, id=f"{name}-S{stages}-M{micro}-v{v}")
    for name in SCHEDULES
    for stages in (1, 2, 3, 4)
    for micro in (1, 2, 3, 4, 8)
    for v in CHUNKS_PER_STAGE[name]
    if name != "interleaved" or micro % stages == 0
]


def _run(name, stages, micro, v=1, **times):
    schedule = build_schedule(name, stages, micro, v)
    return schedule, simulate(schedule, chunk_stages(name, stages, v), **times)


def _backward(name):
    return B if name == "zero-bubble" else BW


@pytest.mark.parametrize("name, stages, micro, v", CASES)
def test_every_pass_runs_once_on_its_stage_in_order(name, stages, micro, v):
    schedule, owner = build_schedule(name, stages, micro, v), chunk_stages(name, stages, v)
    ops = (F, B, W) if name == "zero-bubble" else (F, BW)
    position = {}
    for stage, actions in enumerate(schedule):
        for index, a in enumerate(actions):
            if a.peer is None:
                assert owner[a.chunk] == stage, a
                assert (a.op, a.micro_batch, a.chunk) not in position, a
                position[a.op, a.micro_batch, a.chunk] = index
    assert set(position) == {(op, m, c) for op in ops for m in range(micro) for c in range(len(owner))}
    for m, c in itertools.product(range(micro), range(len(owner))):
        assert [position[op, m, c] for op in ops] == sorted(position[op, m, c] for op in ops)


@pytest.mark.parametrize("name, stages, micro, v", CASES)
def test_passes_follow_their_dependencies_in_simulated_time(name, stages, micro, v):
    _, result = _run(name, stages, micro, v, forward=1.0, backward_input=2.0, backward_weight=0.5, transfer=0.25)
    span, back, last = result.spans, _backward(name), stages * v - 1
    for m in range(micro):
        assert span[back, m, last][0] >= span[F, m, last][1]
        for c in range(1, last + 1):
            assert span[F, m, c][0] >= span[F, m, c - 1][1]
            assert span[back, m, c - 1][0] >= span[back, m, c][1]


@pytest.mark.parametrize("name, stages, micro, v", CASES)
def test_messages_wrap_their_pass_and_match_one_to_one(name, stages, micro, v):
    schedule, owner = build_schedule(name, stages, micro, v), chunk_stages(name, stages, v)
    last = len(owner) - 1
    sends, recvs = collections.Counter(), collections.Counter()
    for stage, actions in enumerate(schedule):
        for index, a in enumerate(actions):
            if a.op is F:
                assert _neighbour(actions, index, -1, a, Op.RECV_ACTIVATION) == _remote(owner, stage, a.chunk - 1)
                assert _neighbour(actions, index, 1, a, Op.SEND_ACTIVATION) == _remote(owner, stage, a.chunk + 1)
            elif a.op in (B, BW):
                assert _neighbour(actions, index, -1, a, Op.RECV_GRAD) == _remote(owner, stage, a.chunk + 1)
                assert _neighbour(actions, index, 1, a, Op.SEND_GRAD) == _remote(owner, stage, a.chunk - 1)
            elif a.op in (Op.SEND_ACTIVATION, Op.SEND_GRAD):
                sends[a.op, a.micro_batch, a.chunk, stage, a.peer] += 1
            elif a.op is Op.RECV_ACTIVATION:
                recvs[Op.SEND_ACTIVATION, a.micro_batch, a.chunk - 1, a.peer, stage] += 1
            elif a.op is Op.RECV_GRAD:
                recvs[Op.SEND_GRAD, a.micro_batch, a.chunk + 1, a.peer, stage] += 1
    assert sends == recvs
    assert set(sends.values()) <= {1}
    for op, _micro_batch, c, sender, receiver in sends:
        assert 0 <= c <= last and sender == owner[c] != receiver
        assert receiver == owner[c + 1] if op is Op.SEND_ACTIVATION else receiver == owner[c - 1]


def _neighbour(actions, index, step, action, op):
    """The peer of the `op` message right next to `action` for the same (m, c), else None."""
    at = index + step
    if 0 <= at < len(actions) and actions[at].op is op:
        assert (actions[at].micro_batch, actions[at].chunk) == (action.micro_batch, action.chunk)
        return actions[at].peer
    return None


def _remote(owner, stage, chunk):
    """The stage of `chunk` if it exists and sits on another stage, else None (no message)."""
    return owner[chunk] if 0 <= chunk < len(owner) and owner[chunk] != stage else None


def test_a_schedule_where_both_stages_receive_first_deadlocks():
    schedule = [
        [Action(Op.RECV_GRAD, 0, 0, 1), Action(BW, 0, 0)],
        [Action(Op.RECV_ACTIVATION, 0, 1, 0), Action(F, 0, 1), Action(BW, 0, 1)],
    ]
    with pytest.raises(DeadlockError, match=r"stage 0 waits at RECV_B\(m=0, c=0, peer=1\); stage 1 waits at RECV_F"):
        simulate(schedule, [0, 1])


def test_simulate_rejects_misplaced_chunks_and_negative_times():
    with pytest.raises(ValueError, match="chunk 1 is on stage 1"):
        simulate([[Action(F, 0, 1)], []], [0, 1])
    with pytest.raises(ValueError, match="transfer must be >= 0"):
        simulate(build_schedule("1f1b", 2, 2), [0, 1], transfer=-1)


def test_transfer_time_delays_each_receive():
    _, result = _run("1f1b", 2, 1, transfer=0.5)  # F 1, +0.5, F 1, BW 2, +0.5, BW 2
    assert result.makespan == 7.0 and result.finish == (7.0, 4.5) and result.busy == (3.0, 3.0)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8])
def test_peak_activations(stages, micro):
    assert _run("gpipe", stages, micro)[1].peak_activations == (micro,) * stages
    one_f_one_b = _run("1f1b", stages, micro)[1].peak_activations
    assert one_f_one_b == tuple(min(stages - s, micro) for s in range(stages))
    h1 = _run("zero-bubble", stages, micro)[1].peak_activations
    assert h1[0] == one_f_one_b[0] and max(h1) <= max(one_f_one_b)  # the paper's bound: 1F1B's largest
    assert max(_run("zero-bubble", stages, micro, 2)[1].peak_activations) <= 2 * min(stages, micro)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("times", [(1, 1, 1), (1, 2, 1), (1, 0.5, 0.5), (2, 0.25, 0.75)])
def test_gpipe_and_1f1b_bubble_is_the_formula(name, stages, micro, times):
    _, result = _run(name, stages, micro, **dict(zip(TIMES, times)))
    assert result.bubble == pytest.approx([(stages - 1) / (micro + stages - 1)] * stages, abs=1e-9)
    assert theoretical_bubble(name, stages, micro) == pytest.approx(result.bubble[0], abs=1e-9)


@pytest.mark.parametrize("stages, micro", [(1, 2), (2, 2), (2, 4), (2, 8), (3, 3), (3, 6), (4, 4), (4, 8)])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("times", [(1, 1, 1), (1, 0.5, 0.5)])
def test_interleaved_bubble_is_the_formula(stages, micro, v, times):
    _, result = _run("interleaved", stages, micro, v, **dict(zip(TIMES, times)))
    assert result.bubble == pytest.approx([(stages - 1) / (v * micro + stages - 1)] * stages, abs=1e-9)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8])
def test_zero_bubble_beats_1f1b(stages, micro):
    h1, base = max(_run("zero-bubble", stages, micro)[1].bubble), max(_run("1f1b", stages, micro)[1].bubble)
    assert h1 <= base + 1e-9
    if micro >= stages:
        assert h1 <= theoretical_bubble("zero-bubble", stages, micro) + 1e-9
        h1_idle, base_idle = (max(_run(n, stages, micro)[1].idle) for n in ("zero-bubble", "1f1b"))
        assert h1_idle <= base_idle / 3 + 1e-9
    if micro >= 2 * stages > 2:
        v_bubble = max(_run("zero-bubble", stages, micro, 2)[1].bubble)
        assert v_bubble < h1
        assert v_bubble == pytest.approx((stages - 1) / (6 * micro + stages - 1), abs=1e-9)


def test_theoretical_bubble_values():
    assert theoretical_bubble("gpipe", 4, 8) == theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble("zero-bubble", 4, 8) == pytest.approx(3 / 27)  # idle (S-1)(F+B-W) = 3
    assert theoretical_bubble("zero-bubble", 4, 8, backward_input=2) == pytest.approx(6 / 38)
    assert theoretical_bubble("zero-bubble", 4, 8, backward_weight=3) == 0.0  # clamped at zero
    assert theoretical_bubble("zero-bubble", 4, 8, 2) == pytest.approx(3 / 51)


def test_chunk_placement():
    assert chunk_stages("interleaved", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert chunk_stages("zero-bubble", 3, 1) == [0, 1, 2]
    assert chunk_stages("zero-bubble", 3, 2) == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("pipedream", 2, 2), ValueError, "unknown pipeline schedule 'pipedream'; choose one of gpipe"),
        (("1f1b", 0, 2), ValueError, "stages must be at least 1, got 0"),
        (("1f1b", 2, 0), ValueError, "micro_batches must be at least 1"),
        (("interleaved", 2, 2, 0), ValueError, "virtual_stages must be at least 1"),
        (("1f1b", 2.0, 2), TypeError, "stages must be an int"),
        (("gpipe", 2, 2, 2), ValueError, "'gpipe' runs one chunk per stage"),
        (("interleaved", 2, 2, 1), ValueError, "'interleaved' needs virtual_stages >= 2"),
        (("interleaved", 4, 6, 2), ValueError, "multiple of stages \\(Megatron-LM's rule\\), got 6 .* use 8"),
        (("zero-bubble", 2, 4, 3), ValueError, "virtual_stages=1 \\(ZB-H1\\) and virtual_stages=2 \\(ZB-V\\), got 3"),
    ],
)
def test_build_schedule_rejects_bad_arguments(args, error, message):
    with pytest.raises(error, match=message):
        build_schedule(*args)


def test_balanced_split_is_optimal():
    rng = random.Random(0)
    for _ in range(300):
        costs = [rng.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(1, 8))]
        parts = rng.randint(1, len(costs))
        sizes = balanced_split(costs, parts)
        check_sizes(sizes, len(costs), parts)
        assert _largest(costs, sizes) == min(
            _largest(costs, [b - a for a, b in zip((0, *cuts), (*cuts, len(costs)))])
            for cuts in itertools.combinations(range(1, len(costs)), parts - 1)
        )


def _largest(costs, sizes):
    starts = [0, *itertools.accumulate(sizes)]
    return max(sum(costs[a:b]) for a, b in zip(starts, starts[1:]))


def test_balanced_split_examples_and_errors():
    assert balanced_split([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [1, 4]
    assert balanced_split([2.5], 1) == [1]
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 stages"):
        balanced_split([1, 1, 1], 4)
    with pytest.raises(ValueError, match="cannot cut 3 layers into 0 stages"):
        balanced_split([1, 1, 1], 0)
    with pytest.raises(ValueError, match="got -1 for layer 1"):
        balanced_split([1, -1, 1], 2)


def test_check_sizes():
    check_sizes([2, 4], 6, 2)
    with pytest.raises(ValueError, match=r"sizes \[3, 4\] add up to 7 but the model has 6 layers"):
        check_sizes([3, 4], 6, 2)
    with pytest.raises(ValueError, match="got 2 sizes .* for 3 stages"):
        check_sizes([3, 3], 6, 3)
    with pytest.raises(ValueError, match="positive ints, got 0"):
        check_sizes([6, 0], 6, 2)
