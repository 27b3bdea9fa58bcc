"""The background thread of an idle job: its control rounds slow down, and work still starts promptly."""

from __future__ import annotations

import time

import torch


def test_idle_ranks_slow_their_control_rounds(hvd):
    """With nothing in flight on any rank, rounds back off to one per 40 ms instead of one per cycle (1 ms); a
    submit after the idle spell still completes (the submitting rank wakes at once, the others within 40 ms)."""
    from hvdplus.common.basics import runtime

    hvd.barrier()
    time.sleep(0.3)  # let the back-off reach its longest wait
    before = runtime().coordinator.rounds
    time.sleep(1.0)
    idle_rounds = runtime().coordinator.rounds - before
    assert 5 <= idle_rounds <= 100, idle_rounds  # 1 ms cycles would be ~1000; 40 ms waits give ~25
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.idle").item() == hvd.size()
