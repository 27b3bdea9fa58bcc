"""An engine call that raises fails the handles of the work it was running, on the rank it raised on.

The work of a cycle leaves the in-flight table when its batches are planned; a failure inside a batch used to leave
those handles waiting forever (seen when Gloo refused a dtype). The engine here is the one-rank engine with its
allreduce made to fail, as a real engine's would."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from hvdplus.common.control.coordinator import Coordinator
from hvdplus.common.control.messages import Request
from hvdplus.common.engines.local import LocalEngine
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.ops import OpKind, ReduceOp
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology


class RefusingEngine(LocalEngine):
    def start_allreduce(self, buf, dtype, op, group, send=None):
        raise RuntimeError("Invalid scalar type")


def _give_up_after(seconds: float) -> Callable[[], None]:
    """An `alive` for Handle.wait that ends a wait longer than `seconds` (instead of hanging the suite)."""
    deadline = time.monotonic() + seconds

    def alive() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the handle did not complete within {seconds} s")

    return alive


def test_a_failing_engine_call_fails_its_handles_instead_of_hanging():
    engine = RefusingEngine()
    coordinator = Coordinator(engine, Settings(), Topology(0, ("host",)))
    try:
        handles = []
        for k in range(3):  # several in one cycle: a fused batch, and work queued behind it
            data = np.ones(4, dtype=np.float32)
            handles.append(
                coordinator.submit(Request(f"t{k}", OpKind.ALLREDUCE, 0, "float32", (4,), op=ReduceOp.SUM), data, data)
            )
        for handle in handles:
            with pytest.raises(HorovodInternalError, match="Invalid scalar type"):
                handle.wait(_give_up_after(10.0))
    finally:
        coordinator.shutdown()
