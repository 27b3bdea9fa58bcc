"""The lone lane (common/control/set_rounds.py, SetRounds.run_lone): a blocking allreduce of a host tensor whose
request is cached runs from the caller's thread in a round of its own, with no handle or batch, when its rounds
have nothing else to do; otherwise it takes the full cycle. Either way every rank gets the same result, which these
tests check against the sum computed here, with the lane's counters showing which way each call went."""

from __future__ import annotations

import time

import pytest
import torch

from tests.parallel.process_sets import global_ranks, pset, rest  # noqa: F401 (fixtures)
from tests.parallel.stress import stressed

CALLS = 40


def _counters():
    from hvdplus.common.basics import runtime

    return runtime().coordinator.counters


def test_back_to_back_blocking_allreduces_take_the_lone_lane(hvd, pset):
    """In place and into a new tensor, on the global set and on one without rank 0: right sums, and most calls
    decided alone in the lane (a call after a peer's idle spell, or beside a late peer, takes the full cycle)."""
    ranks = global_ranks(hvd, pset)
    if hvd.rank() not in ranks:
        return
    counters, size = _counters(), len(ranks)
    name = f"lone.{pset.process_set_id}"
    hvd.allreduce(torch.ones(4), op=hvd.Sum, name=name, process_set=pset)  # negotiated once, then cached
    hvd.allreduce_(torch.ones(4), op=hvd.Sum, name=f"{name}.inplace", process_set=pset)
    runs = counters.lone_runs
    expected = float(sum(range(size)))
    for step in range(CALLS):
        got = hvd.allreduce(torch.arange(4.0) + ranks.index(hvd.rank()) + step, op=hvd.Sum, name=name, process_set=pset)
        assert got.tolist() == [expected + size * (step + i) for i in range(4)]
        tensor = torch.full((4,), float(ranks.index(hvd.rank()) + step))
        assert hvd.allreduce_(tensor, op=hvd.Sum, name=f"{name}.inplace", process_set=pset) is tensor
        assert tensor.tolist() == [expected + size * step] * 4
    if not stressed():  # stress mode sleeps before each call, on purpose
        assert counters.lone_runs - runs >= CALLS, (counters.lone_runs - runs, counters.lone_fallbacks)


def test_a_blocking_in_place_group_takes_the_lone_lane(hvd, pset):
    """grouped_allreduce_ of host tensors of one dtype travels as one packed request: through the lane too, in the
    buffer kept under its name and set (torch/packing.py), with every member's sum right, on the global set and on
    one without rank 0 (the same name on both)."""
    from hvdplus.torch.buffers import plane_kind
    from hvdplus.torch.packing import kept_buffers

    ranks = global_ranks(hvd, pset)
    if hvd.rank() not in ranks:
        return
    counters, size, index = _counters(), len(ranks), ranks.index(hvd.rank())
    shapes = [(2, 3), (5,), (1,)]
    hvd.grouped_allreduce_([torch.ones(shape) for shape in shapes], op=hvd.Sum, name="lone.group", process_set=pset)
    runs, reuses = counters.lone_runs, kept_buffers.reuses
    for step in range(CALLS // 2):
        tensors = [torch.full(shape, float(index + step)) for shape in shapes]
        assert hvd.grouped_allreduce_(tensors, op=hvd.Sum, name="lone.group", process_set=pset)[0] is tensors[0]
        for tensor in tensors:
            assert torch.all(tensor == float(sum(range(size)) + size * step))
    if plane_kind(torch.ones(1)) is None:  # host tensors: every call after the first packs into the kept buffer
        assert kept_buffers.reuses - reuses == CALLS // 2, kept_buffers.reuses - reuses
    if not stressed():
        assert counters.lone_runs - runs >= CALLS // 4, (counters.lone_runs - runs, counters.lone_fallbacks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_the_lone_lane_averages_and_scales_as_the_full_cycle(hvd, dtype):
    """Average divides by the set's size, and the scale factors apply, in the lane as in the executor's batches
    (at least a few of the calls take the lane: on 2 shared cores a peer's round without the call is common)."""
    counters, size = _counters(), hvd.size()
    name = f"lone.scaled.{dtype}"
    tensor = lambda: torch.full((3,), 2.0 * (hvd.rank() + 1)).to(dtype)  # noqa: E731
    runs = counters.lone_runs
    for _ in range(12):
        got = hvd.allreduce(tensor(), op=hvd.Average, name=name)
        assert got.dtype == dtype
        assert got.tolist() == [float(size + 1)] * 3
        if dtype.is_floating_point:
            got = hvd.allreduce(tensor(), op=hvd.Sum, name=f"{name}.scaled", prescale_factor=0.5, postscale_factor=3.0)
            assert got.tolist() == [1.5 * size * (size + 1)] * 3
    if not stressed():
        assert counters.lone_runs - runs >= 3, (counters.lone_runs - runs, counters.lone_fallbacks)


def test_a_late_peer_sends_the_lone_round_on_as_a_full_cycle(hvd):
    """Every rank but 0 sleeps before its call: rank 0's lane round meets a peer's round without the collective
    (its background thread's), which does not decide the collective alone; the round goes on as a full cycle, and
    the collective completes in a later one, with the right sum."""
    counters, size = _counters(), hvd.size()
    hvd.allreduce(torch.ones(2), op=hvd.Sum, name="lone.late")
    fallbacks = counters.lone_fallbacks
    for step in range(5):
        if hvd.rank() != 0:
            time.sleep(0.03)
        got = hvd.allreduce(torch.full((2,), float(step)), op=hvd.Sum, name="lone.late")
        assert got.tolist() == [float(size * step)] * 2
    # In stress mode rank 0 sleeps before its calls too, and may then find the rounds idle (the lane closed).
    if hvd.rank() == 0 and not stressed():
        assert counters.lone_fallbacks - fallbacks >= 1, counters.lone_fallbacks - fallbacks


def test_the_lone_lane_stays_closed_while_the_rank_has_work_in_flight(hvd):
    """An asynchronous allreduce in flight closes the lane (its round would announce two collectives): rank 0's
    blocking call behind it takes the full cycle. The peers submit the asynchronous one only after the blocking
    one, so it is still in flight on rank 0 whatever the timing. Both complete with the right sums."""
    counters, size = _counters(), hvd.size()
    for step in range(3):
        if hvd.rank() == 0:
            handle = hvd.allreduce_async(torch.full((2,), float(step)), op=hvd.Sum, name="lone.async")
            runs = counters.lone_runs
            got = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="lone.after.async")
            assert counters.lone_runs == runs
        else:
            got = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="lone.after.async")
            handle = hvd.allreduce_async(torch.full((2,), float(step)), op=hvd.Sum, name="lone.async")
        assert got.tolist() == [float(size)] * 3
        assert hvd.synchronize(handle).tolist() == [float(size * step)] * 2
