"""Hierarchical allreduce and allgather over simulated hosts equal the flat results, on the global process set
and on a process set of their own, with sizes that do not divide by the ranks per host, fused or not.

HOSTS="2,2" gives each rank its host name before init (host0 gets the first 2 ranks, host1 the next 2), unless
REAL_HOSTS is set (the job runs on real hosts with that layout);
EXPECT is the cross-host algorithm expected for large buffers, or "flat" when the layout must fall back."""

import os

import torch

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", os.environ.get("HOROVOD_RANK", "0"))))
slots = [int(n) for n in os.environ["HOSTS"].split(",")]
if not os.environ.get("REAL_HOSTS"):  # simulated: name this rank's host; on real hosts they have their names
    os.environ["HOROVOD_HOSTNAME"] = f"host{sum(rank >= sum(slots[: h + 1]) for h in range(len(slots)))}"

import hvdplus.torch as hvd  # noqa: E402
from hvdplus.common.basics import runtime  # noqa: E402

everyone_but_last = hvd.ProcessSet(list(range(sum(slots) - 1)))
evens = hvd.ProcessSet(list(range(0, sum(slots), 2)))
but_first_host = hvd.ProcessSet(list(range(slots[0], sum(slots))))  # no rank 0; 2+ hosts when there are 3
hvd.init(process_sets=[everyone_but_last, evens, but_first_host])
size, expect = hvd.size(), os.environ["EXPECT"]
assert len(slots) == hvd.cross_size() or expect == "flat", (hvd.local_size(), hvd.cross_size())


def check_allreduce(process_set, tag):
    members = process_set.ranks if process_set.ranks else list(range(size))
    for count in (1, 7, 1000, (1 << 18) + 3):  # the last is large enough for the composed cross-host step
        x = torch.arange(count, dtype=torch.float32) * (hvd.rank() + 1)
        total = torch.arange(count, dtype=torch.float32) * sum(r + 1 for r in members)
        torch.testing.assert_close(hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.h{count}", process_set=process_set), total)
        torch.testing.assert_close(
            hvd.allreduce(x, name=f"{tag}.avg{count}", process_set=process_set), total / len(members)
        )
        half = hvd.allreduce(x.to(torch.bfloat16), op=hvd.Sum, name=f"{tag}.bf{count}", process_set=process_set)
        torch.testing.assert_close(half.float(), total, rtol=2e-2, atol=1.0)
    handles = [
        hvd.allreduce_async(torch.full((5,), float(i)), op=hvd.Sum, name=f"{tag}.fused{i}", process_set=process_set)
        for i in range(20)
    ]
    for i, handle in enumerate(handles):
        assert torch.all(hvd.synchronize(handle) == i * len(members))


def check_allgather(process_set, tag):
    members = process_set.ranks if process_set.ranks else list(range(size))
    mine = torch.full((members.index(hvd.rank()) % 3 + 1, 2), float(hvd.rank()))  # uneven rows per rank
    expected = torch.cat([torch.full((i % 3 + 1, 2), float(r)) for i, r in enumerate(members)])
    torch.testing.assert_close(hvd.allgather(mine, name=f"{tag}.ag", process_set=process_set), expected)
    handles = [hvd.allgather_async(mine + i, name=f"{tag}.ag{i}", process_set=process_set) for i in range(5)]
    for i, handle in enumerate(handles):
        torch.testing.assert_close(hvd.synchronize(handle), expected + i)


def check_pipelined(process_set, tag):
    """8 MiB and 12 bytes: two chunks of the default HVDPLUS_HIERARCHICAL_CHUNK_BYTES, uneven, pipelined (the
    cross-host steps on a thread of the set's own). The sums are exact in float32."""
    members = process_set.ranks if process_set.ranks else list(range(size))
    pattern = torch.arange((1 << 21) + 3, dtype=torch.float32) % 1000
    total = hvd.allreduce(pattern * (hvd.rank() + 1), op=hvd.Sum, name=f"{tag}.pipelined", process_set=process_set)
    torch.testing.assert_close(total, pattern * sum(r + 1 for r in members), rtol=0, atol=0)


check_allreduce(hvd.global_process_set, "global")
check_allgather(hvd.global_process_set, "global")
runs = runtime().coordinator.counters.hierarchical_runs
if expect == "flat":
    assert not runs, runs
else:
    assert runs.get(f"allreduce/{expect}", 0) >= 2, runs  # the 1 MiB buffer: sum and average (bfloat16 too if 1)
    assert runs.get("allgather", 0) >= 2, runs  # the lone allgather and the fused batch
    assert f"allreduce/pipelined-{expect}" not in runs, runs  # 1 MiB: under two chunks
check_pipelined(hvd.global_process_set, "global")
if expect != "flat":
    before, runs = runs, runtime().coordinator.counters.hierarchical_runs
    assert runs.get(f"allreduce/pipelined-{expect}", 0) == 1, (before, runs)
if evens.included():  # one rank per host (2 hosts), or hosts with different counts (3): flat
    before = runtime().coordinator.counters.hierarchical_runs
    check_allreduce(evens, "evens")
    assert runtime().coordinator.counters.hierarchical_runs == before
if everyone_but_last.included():  # the last host is a rank short: flat, with a logged reason
    before = runtime().coordinator.counters.hierarchical_runs
    check_allreduce(everyone_but_last, "but_last")
    check_allgather(everyone_but_last, "but_last")
    assert runtime().coordinator.counters.hierarchical_runs == before
if but_first_host.included():  # hierarchical without rank 0 where it spans 2+ equal hosts, else flat
    before = runtime().coordinator.counters.hierarchical_runs
    check_allreduce(but_first_host, "but_first")
    check_allgather(but_first_host, "but_first")
    after = runtime().coordinator.counters.hierarchical_runs
    if expect != "flat" and len(slots) > 2:
        assert after.get(f"allreduce/{expect}", 0) >= before.get(f"allreduce/{expect}", 0) + 2, (before, after)
        assert after.get("allgather", 0) >= before.get("allgather", 0) + 2, (before, after)
        check_pipelined(but_first_host, "but_first")  # the set's own rounds and cross lane, without rank 0
        piped = runtime().coordinator.counters.hierarchical_runs
        assert piped.get(f"allreduce/pipelined-{expect}", 0) == after.get(f"allreduce/pipelined-{expect}", 0) + 1
    else:
        assert after == before, (before, after)
hvd.barrier()  # shutdown stops every rank's background thread: wait for the process sets' members first
print(f"rank {hvd.rank()} local {hvd.local_rank()} cross {hvd.cross_rank()} runs {runs}: hierarchical ok")
hvd.shutdown()
