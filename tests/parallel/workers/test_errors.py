"""Bad input raises on every rank, names the ranks involved, and leaves the job usable."""

from __future__ import annotations

import pytest
import torch

from hvdplus.common.basics import registered_process_set
from hvdplus.common.exceptions import CollectiveMismatchError
from tests.parallel.process_sets import global_ranks, pset, rest  # noqa: F401 (fixtures)


def _after_error_job_still_works(hvd, process_set=None):
    process_set = hvd.global_process_set if process_set is None else process_set
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=process_set)
    assert got.tolist() == [float(len(global_ranks(hvd, process_set)))] * 2


def test_mismatched_shapes_raise_on_every_rank(hvd):
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched shapes.*rank 0 has \(2,\)"):
        hvd.allreduce(torch.ones(2 + min(hvd.rank(), 1)), name="shape.mismatch")
    _after_error_job_still_works(hvd)


def test_mismatched_dtypes(hvd):
    dtype = torch.float32 if hvd.rank() == 0 else torch.float64
    with pytest.raises(CollectiveMismatchError, match="Mismatched data types.*(float32.*float64|float64.*float32)"):
        hvd.allreduce(torch.ones(2, dtype=dtype), name="dtype.mismatch")
    _after_error_job_still_works(hvd)


def test_mismatched_ops(hvd):
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    with pytest.raises(CollectiveMismatchError, match="Mismatched reduction ops"):
        hvd.allreduce(torch.ones(2), op=op, name="op.mismatch")


def test_mismatched_roots(hvd):
    with pytest.raises(CollectiveMismatchError, match="Mismatched root ranks"):
        hvd.broadcast(torch.ones(2), root_rank=min(hvd.rank(), 1), name="root.mismatch")
    _after_error_job_still_works(hvd)


def test_mismatched_member_shapes_of_a_packed_group(hvd):
    """A packed group's total size can agree while its tensors do not ((2, 3) against (3, 2)): still an error."""
    first = (2, 3) if hvd.rank() == 0 else (3, 2)
    with pytest.raises(CollectiveMismatchError, match="shapes of the grouped tensors"):
        hvd.grouped_allreduce([torch.ones(first), torch.ones(4)], name="packed.mismatch")
    _after_error_job_still_works(hvd)


@pytest.mark.parametrize("packed", [True, False])
def test_grouped_calls_with_different_numbers_of_tensors(hvd, packed):
    """Rank r groups 2 + r % 2 tensors: an error naming the counts on every rank, not a wait for members the
    other ranks never send; packed (one dtype) or tensor by tensor (mixed dtypes), allreduce and allgather."""
    extra = hvd.rank() % 2
    tensors = [torch.ones(2), torch.ones(2) if packed else torch.ones(2, dtype=torch.float64)] + [torch.ones(1)] * extra
    expected = r"Mismatched numbers of tensors in the grouped call for collective .*ha(s|ve) 2; rank 1 has 3\."
    with pytest.raises(CollectiveMismatchError, match=expected):
        hvd.grouped_allreduce(tensors, name=f"count.mismatch.{packed}")
    with pytest.raises(CollectiveMismatchError, match=expected):
        hvd.grouped_allgather(tensors, name=f"count.mismatch.gather.{packed}")
    with pytest.raises(CollectiveMismatchError, match=expected):
        hvd.synchronize(
            hvd.grouped_reducescatter_async([t.repeat(6) for t in tensors], name=f"count.mismatch.rs.{packed}")
        )
    _after_error_job_still_works(hvd)
    # The member only rank 1 submitted failed too: nothing is left in flight to keep the background thread busy.
    from hvdplus.common.basics import runtime

    assert not runtime().coordinator.counters.busy


def test_mismatched_kinds(hvd):
    tensor = torch.ones(2)
    with pytest.raises(CollectiveMismatchError, match="Mismatched collective operations"):
        if hvd.rank() == 0:
            hvd.allreduce(tensor, name="kind.mismatch")
        else:
            hvd.allgather(tensor, name="kind.mismatch")


def test_mismatched_trailing_dimensions_in_allgather(hvd):
    with pytest.raises(CollectiveMismatchError, match="trailing dimensions"):
        hvd.allgather(torch.ones(2, 2 + min(hvd.rank(), 1)), name="ag.mismatch")


def test_mismatched_process_sets(hvd):
    if hvd.size() < 3:  # ranks 0 and 1 are the whole job: registering them again is refused (the test below)
        pytest.skip("needs a set of two ranks that is not the whole job: 3 ranks or more")
    pair = hvd.add_process_set([0, 1])
    try:
        if hvd.rank() in (0, 1):
            target = hvd.global_process_set if hvd.rank() == 0 else pair
            with pytest.raises(CollectiveMismatchError, match="Mismatched process sets"):
                hvd.allreduce(torch.ones(1), name="ps.mismatch", process_set=target)
        hvd.barrier()
    finally:
        hvd.remove_process_set(pair)


def test_invalid_root_rank(hvd):
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.ones(2), root_rank=hvd.size())
    _after_error_job_still_works(hvd)


def test_duplicate_name_in_flight(hvd):
    """Rank 0 submits 'dup' twice while it is surely in flight: the other ranks submit theirs only after a
    barrier that rank 0 enters after its second call (ranks may submit in different orders)."""
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(torch.ones(1), name="dup")
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(torch.ones(1), name="dup")
        hvd.barrier()
    else:
        hvd.barrier()
        handle = hvd.allreduce_async(torch.ones(1), name="dup")
    assert hvd.synchronize(handle).item() == 1.0


def test_unsupported_dtype(hvd):
    with pytest.raises(TypeError, match="complex64"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="cannot reduce dtype 'bool'"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
    _after_error_job_still_works(hvd)


def test_bad_alltoall_splits(hvd):
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.ones(4), splits=[1] * (hvd.size() + 1))


def test_alltoall_splits_of_a_non_integer_dtype_raise_on_every_rank_whatever_they_hold(hvd):
    """Horovod's test passes torch.empty float32 splits, whose garbage differs from rank to rank, and expects
    ValueError on every rank: the dtype is refused before the values are read, so a rank whose splits happen to
    hold valid counts (here rank 0's) cannot submit while its peers raise, and the next collective still pairs."""
    n = hvd.size()
    garbage = torch.full((n,), 1.0) if hvd.rank() == 0 else torch.full((n,), float("nan"))
    for splits in (garbage, torch.empty(n), torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.bool)):
        with pytest.raises(ValueError, match=f"splits to contain integers, got a {splits.dtype} tensor"):
            hvd.alltoall(torch.ones(n), splits=splits)
    output, received = hvd.alltoall(torch.ones(n), splits=torch.ones(n, dtype=torch.int64))
    assert output.tolist() == [1.0] * n and received.tolist() == [1] * n
    _after_error_job_still_works(hvd)


def test_a_request_checked_before_skips_the_checks_and_still_meets_mismatches(hvd, pset):
    """The dynamic API's fast path: a named allreduce whose arguments were checked before reuses its request (no
    checks, no new request), and the negotiation still turns a mismatch into an error on every member. On the
    global set and on one without rank 0 (at 2 ranks, the one-member set {1})."""
    from hvdplus.common.basics import runtime

    ranks = global_ranks(hvd, pset)
    if hvd.rank() not in ranks:
        return
    size, first = len(ranks), ranks[0]
    name = f"checked.once.{pset.process_set_id}"
    checked = runtime().checked_requests
    for _ in range(3):
        got = hvd.allreduce(torch.ones(4), op=hvd.Sum, name=name, process_set=pset)
        assert got.tolist() == [float(size)] * 4
    keys = [key for key in checked if key[0] == name]
    assert len(keys) == 1, keys
    reused = checked[keys[0]]
    hvd.allreduce(torch.ones(4), op=hvd.Sum, name=name, process_set=pset)
    assert checked[keys[0]] is reused  # reused, not built again
    if size > 1:
        # The set's first rank sends the shape it sent before (a request it finds checked); the others a new one.
        with pytest.raises(CollectiveMismatchError, match=rf"Mismatched shapes.*rank {first} has \(4,\)"):
            hvd.allreduce(torch.ones(4 + (hvd.rank() != first)), op=hvd.Sum, name=name, process_set=pset)
    _after_error_job_still_works(hvd, pset)


def test_a_removed_process_set_is_refused_after_its_requests_were_checked(hvd):
    process_set = hvd.add_process_set([0])  # not the whole job's ranks, nor `rest`'s: a set of its own
    if process_set.included():
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="checked.set", process_set=process_set).tolist() == [1, 1]
    hvd.remove_process_set(process_set)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(2), op=hvd.Sum, name="checked.set", process_set=process_set)
    _after_error_job_still_works(hvd)


def test_a_process_set_with_the_ranks_of_another_is_refused_on_every_rank(hvd, rest):
    """Horovod's rule: one process set per list of ranks. Adding the ranks of a registered set again (in any order;
    every rank: the global set's) raises ValueError on every rank, naming that set; once a set is removed its ranks
    may be added again, and collectives go on."""
    with pytest.raises(ValueError, match=r"duplicate process set: .* has the ranks of process set 0$"):
        hvd.add_process_set(list(range(hvd.size())))
    with pytest.raises(ValueError, match=rf"has the ranks of process set {rest.process_set_id}$"):
        hvd.add_process_set(list(range(hvd.size() - 1, 0, -1)))
    first = hvd.add_process_set([0])
    first_id = first.process_set_id
    hvd.remove_process_set(first)
    again = hvd.add_process_set([0])
    assert again.process_set_id is not None and again.process_set_id > first_id  # ids are not reused
    twin = registered_process_set([0])  # the same set under another object, as a pipeline holds one
    assert twin is not None and twin.process_set_id == again.process_set_id
    assert hvd.remove_process_set(again) is True
    assert hvd.remove_process_set(twin) is False  # gone already: Horovod's answer for an unknown set
    _after_error_job_still_works(hvd)
