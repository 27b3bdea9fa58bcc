"""Under plain srun: the rendezvous is authenticated. Each rank checks that the secret file is 0600, and that
neither a client with a wrong secret nor torch's plain TCPStore client can use the store; prints 'secret ok'."""

import datetime
import os
import stat

import torch
import torch.distributed as dist

import hvdplus.torch as hvd
from hvdplus.common.rendezvous import RendezvousClient
from hvdplus.common.settings import LaunchEnv

hvd.init()
launch = LaunchEnv.from_env(os.environ)
mode = stat.S_IMODE(os.stat(launch.srun_secret_file).st_mode)
assert mode == 0o600, oct(mode)
try:
    RendezvousClient(launch.rendezvous_addr, launch.rendezvous_port, "not-the-secret", 5).set("intruder", b"x")
    raise SystemExit("a client with a wrong secret was admitted")
except (OSError, RuntimeError, ValueError):
    pass
try:
    store = dist.TCPStore(
        launch.rendezvous_addr,
        launch.rendezvous_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=3),
        wait_for_workers=False,
    )
    store.set("intruder", "x")
    raise SystemExit("torch's plain TCPStore client was admitted")
except (RuntimeError, OSError, dist.DistStoreError):
    pass
hvd.allreduce(torch.ones(1), name="after.intruders")
print(f"rank {hvd.rank()}: secret ok", flush=True)
hvd.shutdown()
