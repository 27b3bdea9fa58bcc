"""No rank leaves a barrier before every member of its set has arrived at it: on the whole job and on the process set
of every rank but 0, each member is late in turn by a random time, and every member records (time.time(), one clock:
the ranks share the machine) when it called barrier() and when it returned. Before each barrier an allreduce runs,
as in Horovod's test_global_barrier_op, and the spread of the times the ranks left it is printed: under load it
shows how far apart ranks leave a collective they all ran.

SCENARIO_BARRIER=none replaces hvd.barrier by a call that returns at once: a barrier that lets ranks leave early,
which this scenario must catch (test_scenarios.py runs it to show that it can fail)."""

import os
import random
import sys
import time

import torch

import hvdplus.torch as hvd

ROUNDS_PER_MEMBER = 2
MIN_DELAY_S, MAX_DELAY_S = 0.02, 0.3

os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
hvd.init()
rank, size = hvd.rank(), hvd.size()
others = hvd.add_process_set(list(range(1, size)))
barrier = (lambda process_set: None) if os.environ.get("SCENARIO_BARRIER") == "none" else hvd.barrier
delays = random.Random(hvd.broadcast_object(random.randrange(1 << 30), root_rank=0))  # the same draws on every rank


def rounds(process_set: hvd.ProcessSet, members: list[int], label: str) -> dict[str, tuple[int, float, float, float]]:
    """Each member late in turn: {round: (late rank, allreduce left, barrier called, barrier left)} on this rank."""
    records = {}
    for i in range(ROUNDS_PER_MEMBER * len(members)):
        late, delay = members[i % len(members)], delays.uniform(MIN_DELAY_S, MAX_DELAY_S)
        if rank not in members:
            continue
        hvd.allreduce(torch.ones(1), name=f"{label}.before.{i}", process_set=process_set)
        reduced = time.time()
        if rank == late:
            time.sleep(delay)
        called = time.time()
        barrier(process_set=process_set)
        records[f"{label}.{i}"] = (late, reduced, called, time.time())
    return records


everyone = hvd.allgather_object(
    {**rounds(hvd.global_process_set, list(range(size)), "global"), **rounds(others, others.ranks, "without-rank-0")}
)
labels = sorted(set().union(*everyone))
early, widest, margin = [], 0.0, float("inf")
for label in labels:
    seen = {r: records[label] for r, records in enumerate(everyone) if label in records}
    late, last_arrival = seen[min(seen)][0], max(called for _, _, called, _ in seen.values())
    first_exit = min(left for _, _, _, left in seen.values())
    margin = min(margin, first_exit - last_arrival)
    if first_exit < last_arrival:
        early.append(f"{label}: a rank left {last_arrival - first_exit:.3f} s before the last (rank {late}) arrived")
    reduced = [r for _, r, _, _ in seen.values()]
    widest = max(widest, max(reduced) - min(reduced))
print(
    f"rank {rank}: {len(labels)} barriers; first exit minus last arrival, the least: {margin * 1e3:.2f} ms; "
    f"the ranks left the allreduce before each up to {widest * 1e3:.2f} ms apart",
    flush=True,
)
if early:
    print(f"rank {rank}: EARLY BARRIER EXITS:\n" + "\n".join(early), flush=True)
    sys.exit(1)
print(f"rank {rank}: every rank left each barrier after the last one arrived", flush=True)
hvd.shutdown()
