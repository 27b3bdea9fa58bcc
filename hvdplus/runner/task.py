"""The worker side of `hvdplus.runner.run`: fetch the function from the job's store, run it, leave the result."""

from __future__ import annotations

import os
import pickle
import sys
import traceback

from hvdplus.common.rendezvous import RendezvousClient
from hvdplus.common.settings import Settings
from hvdplus.runner.api import FUNCTION_KEY, result_key


def main() -> int:
    """Run this rank's call; exit 1 after storing the traceback if it raised."""
    settings = Settings.from_env(os.environ)
    launch = settings.launch
    # run() starts this rank under hvdplusrun, which sets the rendezvous and the rank
    assert launch.rendezvous_addr is not None and launch.rendezvous_port is not None
    assert launch.secret_key is not None and launch.rank is not None
    client = RendezvousClient(
        launch.rendezvous_addr, launch.rendezvous_port, launch.secret_key, settings.timeout_seconds
    )
    fn, args, kwargs = pickle.loads(client.get(FUNCTION_KEY))
    try:
        outcome = (True, fn(*args, **kwargs))
    except BaseException:  # noqa: B902 - every failure goes back to the caller of run()
        outcome = (False, traceback.format_exc())
    client.set(result_key(launch.rank), pickle.dumps(outcome))
    client.close()
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    sys.exit(main())
