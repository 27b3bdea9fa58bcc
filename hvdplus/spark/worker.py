"""A rank's process under a Spark task: `python -m hvdplus.spark.worker RESULT_KEY LABEL`.

It fetches fn from the job's store, runs it (fn calls hvd.init() itself), and leaves its pickled outcome under
RESULT_KEY. A failure is also written at once where the driver watches for one, so the job ends within a second
instead of when this process exits."""

from __future__ import annotations

import os
import pickle
import sys
import traceback

from hvdplus.common.rendezvous import RendezvousClient
from hvdplus.common.settings import Settings
from hvdplus.spark.keys import FAILURE_KEY, FUNCTION_KEY


def _pickled(outcome: tuple[bool, object]) -> bytes:
    try:
        return pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - any pickling error is the function's result's fault
        return pickle.dumps((False, f"fn returned a value pickle cannot send back to the driver: {exc!r}"))


def main(argv: list[str]) -> int:
    """Run fn once; exit 1 after reporting its traceback if it raised."""
    result, label = argv
    launch = Settings.from_env(os.environ).launch
    if launch.rendezvous_addr is None or launch.rendezvous_port is None or launch.secret_key is None:
        print("hvdplus.spark.worker runs inside hvdplus.spark's tasks only", file=sys.stderr)
        return 2
    client = RendezvousClient(launch.rendezvous_addr, launch.rendezvous_port, launch.secret_key, 60.0)
    fn, args, kwargs = pickle.loads(client.get(FUNCTION_KEY))
    try:
        outcome: tuple[bool, object] = (True, fn(*args, **kwargs))
    except BaseException:  # noqa: B902 - every failure goes back to the driver
        trace = traceback.format_exc()
        client.compare_set(FAILURE_KEY, b"", f"{label} raised:\n{trace}".encode())
        outcome = (False, trace)
    client.set(result, _pickled(outcome))
    client.close()
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
