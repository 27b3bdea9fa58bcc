"""horovod#3494: after a reset the ranks decide together whether to sync the state. Rank 0's training function
raises HorovodInternalError (it restores and must sync), rank 1's HostsUpdatedInterrupt(skip_sync=True) (alone it
would skip the sync), any other rank's HostsUpdatedInterrupt(skip_sync=False). Were the decision each rank's own,
rank 1 would go on while the others wait in the sync's broadcast. Every rank must sync twice (at the start and
after the reset) and end with rank 0's value. The reset itself is a no-op here: the same runtime goes on."""

import hvdplus.torch as hvd
from hvdplus.common.elastic.state import ObjectState, run_fn
from hvdplus.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

hvd.init()
rank = hvd.rank()


class CountingState(ObjectState):
    syncs = 0

    def sync(self) -> None:
        self.syncs += 1
        super().sync()


state = CountingState(value=rank)
calls = []


def train(state: CountingState) -> int:
    calls.append(len(calls))
    if len(calls) == 1:
        state.value = 100 + rank  # uncommitted: rank 0 restores, the others keep it until rank 0's sync
        if rank == 0:
            raise HorovodInternalError("a collective failed (simulated)")
        raise HostsUpdatedInterrupt(skip_sync=rank == 1)
    return state.value


result = run_fn(train, reset=lambda: None)(state)
print(f"rank {rank}: syncs {state.syncs}, value {result}", flush=True)
hvd.shutdown()
