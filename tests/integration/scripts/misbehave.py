"""A job where rank 1 misbehaves after init: `raise` raises, `kill` SIGKILLs itself, `sleep` never ends.

Every rank prints 'pid <rank> <pid>'; rank 1 prints 'failing at <time.time()>' right before it fails."""

import os
import signal
import sys
import time

import hvdplus.torch as hvd

hvd.init()
print(f"pid {hvd.rank()} {os.getpid()}", flush=True)
if hvd.rank() == 1 and sys.argv[1] != "sleep":
    time.sleep(0.5)
    print(f"failing at {time.time()}", flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
