"""MessageTable readiness, validation errors, join and process-set deadlock detection."""

from hvdplus.common.control.messages import Request
from hvdplus.common.control.negotiation import JOIN_KEY, MessageTable, is_join, join_key, validate
from hvdplus.common.ops import OpKind, ReduceOp


def req(name="t", kind=OpKind.ALLREDUCE, **kw):
    return Request(name=name, kind=kind, **{"shape": (2, 3), **kw})


def join_req():
    return Request(name=JOIN_KEY[1], kind=OpKind.JOIN, process_set=JOIN_KEY[0])


def announce(table, rank, request):
    return table.add(request, 1 << rank)


def members_of(sets):
    return lambda set_id: sets[set_id]


TWO = members_of({0: (0, 1)})
THREE = members_of({0: (0, 1, 2)})


# ------------------------------------------------------------------ readiness


def test_not_ready_until_all_members_announce():
    table = MessageTable()
    assert announce(table, 0, req()) is None
    assert table.take_ready(TWO) == []
    assert len(table) == 1
    announce(table, 1, req())
    [response] = table.take_ready(TWO)
    assert response.error is None
    assert response.key == (0, "t") and response.kind == OpKind.ALLREDUCE
    assert response.members == (0, 1)
    assert response.requests == (req(), req())
    assert len(table) == 0


def test_requests_are_in_member_order_not_arrival_order():
    table = MessageTable()
    announce(table, 1, req(prescale=1.0))
    announce(table, 0, req())
    [response] = table.take_ready(TWO)
    assert response.members == (0, 1) and len(response.requests) == 2


def test_ready_responses_come_in_arrival_order():
    table = MessageTable()
    for name in ("b", "a", "c"):
        announce(table, 0, req(name))
    for name in ("c", "a", "b"):
        announce(table, 1, req(name))
    assert [r.key[1] for r in table.take_ready(TWO)] == ["b", "a", "c"]


def test_same_name_on_different_sets_are_separate_entries():
    table = MessageTable()
    sets = members_of({0: (0, 1), 1: (0,)})
    announce(table, 0, req(process_set=1))
    [response] = table.take_ready(sets)
    assert response.key == (1, "t") and response.members == (0,)


def test_duplicate_announcement_by_one_rank():
    table = MessageTable()
    assert announce(table, 0, req()) is None
    problem = announce(table, 0, req())
    assert problem is not None and "rank 0" in problem and "twice" in problem and "'t'" in problem


def test_submission_by_non_member_is_an_error():
    table = MessageTable()
    sets = members_of({0: (0, 1, 2), 1: (0, 1)})
    for rank in (0, 1, 2):
        announce(table, rank, req(process_set=1))
    [response] = table.take_ready(sets)
    assert response.error is not None and "rank 2" in response.error and "process set 1" in response.error


# ------------------------------------------------------------------ validation


def _error_for(requests_by_rank, members=TWO):
    table = MessageTable()
    for rank, request in requests_by_rank.items():
        announce(table, rank, request)
    [response] = table.take_ready(members)
    return response.error


def test_mismatched_shapes_name_ranks_and_shapes():
    error = _error_for({0: req(shape=(2, 3)), 1: req(shape=(3, 2))})
    assert "Mismatched shapes" in error
    assert "rank 1" in error and "rank 0" in error
    assert "(2, 3)" in error and "(3, 2)" in error


def test_mismatch_groups_agreeing_ranks():
    error = _error_for({0: req(), 1: req(dtype="float16"), 2: req()}, THREE)
    assert "ranks [0, 2] have float32" in error and "rank 1 has float16" in error


def test_mismatched_dtype():
    error = _error_for({0: req(dtype="float32"), 1: req(dtype="int32")})
    assert "data types" in error and "float32" in error and "int32" in error and "rank 1" in error


def test_mismatched_kind():
    error = _error_for({0: req(), 1: req(kind=OpKind.BROADCAST, root=0)})
    assert "collective operations" in error and "allreduce" in error and "broadcast" in error


def test_mismatched_op():
    error = _error_for({0: req(op=ReduceOp.SUM), 1: req(op=ReduceOp.MAX)})
    assert "reduction ops" in error and "SUM" in error and "MAX" in error


def test_mismatched_device():
    error = _error_for({0: req(device="cpu"), 1: req(device="cuda:0")})
    assert "devices (CPU or GPU)" in error and "rank 0 has cpu" in error and "rank 1 has cuda" in error


def test_ranks_pinned_to_different_gpus_agree():
    """torch.cuda.set_device(hvd.local_rank()) gives cuda:0 on rank 0 and cuda:1 on rank 1: Horovod only asks that
    all ranks be on CPU or all on GPU."""
    assert _error_for({0: req(device="cuda:0"), 1: req(device="cuda:1")}) is None
    assert _error_for({0: req(device="cuda:0"), 1: req(device="cuda:1"), 2: req(device="cuda:2")}, THREE) is None


def test_mismatched_scales():
    assert "prescale" in _error_for({0: req(prescale=1.0), 1: req(prescale=0.5)})
    assert "postscale" in _error_for({0: req(postscale=1.0), 1: req(postscale=0.5)})


def test_mismatched_broadcast_root():
    error = _error_for({0: req(kind=OpKind.BROADCAST, root=0), 1: req(kind=OpKind.BROADCAST, root=1)})
    assert "root ranks" in error and "rank 1" in error


def test_invalid_broadcast_root():
    error = _error_for({0: req(kind=OpKind.BROADCAST, root=2), 1: req(kind=OpKind.BROADCAST, root=2)})
    assert "Invalid root rank 2" in error and "global ranks are [0, 1]" in error


def test_broadcast_root_is_a_global_rank_of_the_set():
    """Horovod's root_rank is a global rank also on a process set: on the set {1, 2}, root 2 is valid
    (index 1 in the set) and root 0 is not a member."""
    pair = members_of({0: (0, 1, 2), 5: (1, 2)})
    for root, problem in ((2, None), (1, None), (0, "Invalid root rank 0")):
        table = MessageTable()
        for rank in (1, 2):
            announce(table, rank, req(kind=OpKind.BROADCAST, root=root, process_set=5))
        [response] = table.take_ready(pair)
        assert (response.error is None) if problem is None else (problem in response.error), response.error


def test_valid_broadcast():
    assert _error_for({0: req(kind=OpKind.BROADCAST, root=1), 1: req(kind=OpKind.BROADCAST, root=1)}) is None


def test_allgather_allows_different_first_dimension():
    assert (
        _error_for({0: req(kind=OpKind.ALLGATHER, shape=(2, 3)), 1: req(kind=OpKind.ALLGATHER, shape=(5, 3))}) is None
    )


def test_allgather_rejects_different_trailing_dimensions():
    error = _error_for({0: req(kind=OpKind.ALLGATHER, shape=(2, 3)), 1: req(kind=OpKind.ALLGATHER, shape=(2, 4))})
    assert "trailing dimensions" in error and "(3,)" in error and "(4,)" in error


def test_allgather_rejects_different_number_of_dimensions():
    error = _error_for({0: req(kind=OpKind.ALLGATHER, shape=(2, 3)), 1: req(kind=OpKind.ALLGATHER, shape=(2,))})
    assert "number of dimensions" in error


def test_reducescatter_requires_same_shape():
    error = _error_for({0: req(kind=OpKind.REDUCESCATTER, shape=(4,)), 1: req(kind=OpKind.REDUCESCATTER, shape=(6,))})
    assert "shapes" in error


def test_validate_direct_ok_and_mismatch():
    assert validate({req(): 0b11}, (0, 1)) is None
    assert "rank 1" in validate({req(): 0b01, req(shape=(1,)): 0b10}, (0, 1))


# ------------------------------------------------------------------ join


def test_joined_rank_lets_allreduce_proceed_with_none():
    table = MessageTable()
    announce(table, 1, join_req())
    announce(table, 0, req())
    [response] = table.take_ready(TWO)
    assert response.error is None
    assert response.requests == (req(), None)
    assert response.first == req()
    assert table.joined == (1,)


def test_joined_rank_makes_allgather_fail_mentioning_join():
    table = MessageTable()
    announce(table, 1, join_req())
    announce(table, 0, req(kind=OpKind.ALLGATHER))
    [response] = table.take_ready(TWO)
    assert response.error is not None and "join" in response.error and "rank 1" in response.error


def test_join_completes_with_last_rank_that_announced():
    table = MessageTable()
    announce(table, 2, join_req())
    announce(table, 0, join_req())
    assert table.take_ready(THREE) == []
    announce(table, 1, join_req())
    [response] = table.take_ready(THREE)
    assert response.key == JOIN_KEY and response.kind == OpKind.JOIN and response.error is None
    assert response.join_last_rank == 1
    assert table.joined == ()


def test_join_not_complete_blocks_nothing_else():
    table = MessageTable()
    announce(table, 0, join_req())
    assert table.take_ready(TWO) == []
    assert table.joined == (0,)


# ------------------------------------------------------------------ process-set deadlocks


def test_same_name_on_two_sets_by_different_ranks_is_a_deadlock_error():
    table = MessageTable()
    sets = members_of({0: (0, 1), 1: (0, 1)})
    announce(table, 0, req(process_set=0))
    announce(table, 1, req(process_set=1))
    responses = table.take_ready(sets)
    assert sorted(r.key for r in responses) == [(0, "t"), (1, "t")]
    for response in responses:
        assert response.error is not None and "process set" in response.error
        assert "rank 0" in response.error and "rank 1" in response.error
    assert len(table) == 0


def test_overlapping_sets_without_cycle_do_not_error():
    table = MessageTable()
    sets = members_of({0: (0, 1, 2), 1: (0, 1), 2: (1, 2)})
    announce(table, 0, req(process_set=1))  # A = (0, 1): waits for rank 1
    announce(table, 1, req(process_set=2))  # B = (1, 2): waits for rank 2, not for anyone on A
    assert table.take_ready(sets) == []
    assert len(table) == 2
    announce(table, 2, req(process_set=2))
    [response] = table.take_ready(sets)
    assert response.key == (2, "t") and response.error is None
    announce(table, 1, req(process_set=1))
    [response] = table.take_ready(sets)
    assert response.key == (1, "t") and response.error is None


def test_a_shadow_from_a_set_whose_rounds_keep_their_own_table_names_the_deadlock_and_never_runs():
    """Each process set's rounds keep a table of their own (common/control/set_rounds.py): the set [0, 1]'s table sees
    rank 1's allreduce 't' and, as a shadow, rank 0's 't' on the whole job; it fails its entry with the same error
    one table of both sets gives, and drops the shadow."""
    pair = MessageTable(join_key(1))
    sets = members_of({0: (0, 1), 1: (0, 1)})
    announce(pair, 1, req(process_set=1))
    assert pair.take_ready(sets) == [] and pair.missing_here(0) == [(1, "t")]
    pair.add(req(process_set=0, shadow=1 << 0), 1 << 1)  # sent by rank 1 on behalf of rank 0, who holds it
    [response] = pair.take_ready(sets)
    assert response.key == (1, "t") and "Mismatched process sets" in (response.error or "")
    assert "rank 0" in response.error and "rank 1" in response.error
    assert len(pair) == 0


def test_a_shadow_without_a_deadlock_is_dropped_and_the_entry_waits_on():
    """Rank 1 holds 't' on set [1, 2] while set [0, 1]'s entry waits for it: no one on [1, 2] waits for [0, 1]'s
    ranks, so nothing fails; the shadow goes and the entry keeps waiting."""
    first = MessageTable(join_key(1))
    sets = members_of({0: (0, 1, 2), 1: (0, 1), 2: (1, 2)})
    announce(first, 0, req(process_set=1))
    first.add(req(process_set=2, shadow=1 << 1), 1 << 1)
    assert first.take_ready(sets) == []
    assert len(first) == 1 and first.missing_here(1) == [(1, "t")]
    announce(first, 1, req(process_set=1))
    [response] = first.take_ready(sets)
    assert response.error is None


def test_a_process_sets_own_rounds_join_under_a_key_of_their_own():
    """join() is in flight in the whole job's rounds and each set's at once: each has its own name."""
    pair = MessageTable(join_key(1))
    sets = members_of({0: (0, 1, 2), 1: (1, 2)})
    assert join_key(0) == JOIN_KEY and join_key(1) != JOIN_KEY and all(map(is_join, (join_key(0), join_key(1))))
    assert not is_join((1, JOIN_KEY[1]))
    announce(pair, 2, Request(name=join_key(1)[1], kind=OpKind.JOIN, process_set=1))
    announce(pair, 1, req(process_set=1))
    [response] = pair.take_ready(sets)  # the joined rank 2 contributes zeros
    assert response.error is None and response.requests == (req(process_set=1), None)
    assert pair.joined == (2,)
    announce(pair, 1, Request(name=join_key(1)[1], kind=OpKind.JOIN, process_set=1))
    [response] = pair.take_ready(sets)
    assert response.kind == OpKind.JOIN and response.join_last_rank == 1 and pair.joined == ()


# ------------------------------------------------------------------ stalls and drop


def test_stalls_report_missing_ranks():
    table = MessageTable()
    announce(table, 0, req("x"))
    announce(table, 2, req("x"))
    [stall] = table.stalls(0, THREE)
    assert stall.key == (0, "x")
    assert stall.submitted == (0, 2) and stall.missing == (1,)
    assert "allreduce 'x'" == stall.description
    assert stall.seconds >= 0


def test_stalls_ignore_recent_entries():
    table = MessageTable()
    announce(table, 0, req())
    assert table.stalls(3600, TWO) == []


# ------------------------------------------------------------------ merged announcements


def test_ranks_that_agree_arrive_as_one_mask():
    members = members_of({0: tuple(range(1024))})
    table = MessageTable()
    assert table.add(req(), (1 << 1024) - 1) is None
    [response] = table.take_ready(members)
    assert response.error is None and response.requests == (req(),) * 1024


def test_a_mask_overlapping_earlier_announcements_names_the_repeating_ranks():
    table = MessageTable()
    assert table.add(req(), 0b011) is None
    problem = table.add(req(), 0b110)
    assert "rank 1 submitted allreduce 't' twice" in problem


def test_join_last_rank_is_the_highest_of_the_final_announcement():
    table = MessageTable()
    table.add(join_req(), 0b010)
    table.add(join_req(), 0b101)
    [response] = table.take_ready(THREE)
    assert response.join_last_rank == 2


# ------------------------------------------------------------------ grouped calls of different sizes


def member(call, index, group):
    return req(f"{call}.{index}", group=group, call=call)


def test_members_only_some_ranks_grouped_fail_with_the_mismatch_then_the_name_is_free_again():
    """Rank 0 groups 2 tensors, rank 1 groups 3: the two common members fail with the mismatch, and so does the
    third, which rank 0 never sends (it used to wait for ever, keeping the background thread busy), whether
    announced before or after the mismatch is decided. A later call of the same name is not affected."""
    table = MessageTable()
    for index in range(2):
        announce(table, 0, member("g", index, 2))
        announce(table, 1, member("g", index, 3))
    responses = table.take_ready(TWO)
    assert [r.key[1] for r in responses] == ["g.0", "g.1"]
    assert all("Mismatched numbers of tensors in the grouped call" in r.error for r in responses)
    announce(table, 1, member("g", 2, 3))  # announced in a later round
    [late] = table.take_ready(TWO)
    assert late.key == (0, "g.2") and late.error == responses[0].error and len(table) == 0
    for rank in (0, 1):  # the same call again, now with the same number of tensors
        for index in range(3):
            announce(table, rank, member("g", index, 3))
    assert [r.error for r in table.take_ready(TWO)] == [None, None, None]
