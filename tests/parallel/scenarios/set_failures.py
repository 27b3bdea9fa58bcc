"""Failures inside a process set's own rounds (common/control/set_rounds.py), 3 ranks, the set of ranks 1 and 2 (rank 0
outside it); argv[1] says which:

* dead: rank 2 exits while rank 1 waits for it in a set collective;
* stall: rank 2 never submits the set's 'late.tensor' (run with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS);
* frozen: rank 2 stops (SIGSTOP) while rank 1 waits in a set round (run with the stall variables as well).

Rank 1 must raise within seconds (naming rank 2 when it stalls or freezes: a dead one breaks the transport); rank 0,
which shares no round with them, raises at its next collective instead of hanging, with the set's error."""

import os
import signal
import sys
import time

import torch

import hvdplus.torch as hvd
from hvdplus.common.basics import runtime

mode = sys.argv[1]
pair = hvd.ProcessSet([1, 2])
hvd.init(process_sets=[pair])
pids = hvd.allgather_object(os.getpid())
time.sleep(0.3)  # the job's rounds go idle on every rank: what follows needs only the set's
start = time.monotonic()
try:
    if hvd.rank() == 0:
        time.sleep(4)  # the others have failed by then (the stall and frozen limits are 2 and 3 s)
        hvd.allreduce(torch.ones(1), name="after")  # the world's rounds, which the failed ranks left
    else:
        hvd.allreduce(torch.ones(1), name="set.warmup", process_set=pair)
        if hvd.rank() == 2:
            if mode == "dead":
                os._exit(3)
            if mode == "frozen":
                os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 continues it once it has raised
            else:
                time.sleep(4)  # stall: its rounds keep answering; it just never submits
        start = time.monotonic()
        hvd.allreduce(torch.ones(1), name="late.tensor", process_set=pair)
    print(f"rank {hvd.rank()}: no error", flush=True)
except hvd.HorovodInternalError as exc:
    print(f"rank {hvd.rank()}: raised after {time.monotonic() - start:.1f} s: {exc}", flush=True)
if mode == "frozen" and hvd.rank() == 1:
    os.kill(pids[2], signal.SIGCONT)
if hvd.rank() != 0 and runtime().engine.name == "mpi":
    time.sleep(6)  # until rank 0 has raised too: under mpirun the first rank to exit ends the job
os._exit(0)
