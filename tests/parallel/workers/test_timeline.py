"""A running job's timeline shows each collective at once (Horovod's test_timeline)."""

import json
import time

import torch


def test_a_collective_is_on_the_timeline_while_the_job_runs(hvd, tmp_path):
    """0.1 s after a named allreduce, rank 0's still open timeline holds its row (named as Horovod's PyTorch names
    the op), its negotiation and op spans and the cycle marks; the file is complete after stop_timeline()."""
    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path), mark_cycles=True)
    try:
        hvd.allreduce(torch.ones(3), name="test_timeline_row")
        time.sleep(0.1)
        if hvd.rank() == 0:
            text = path.read_text()
            for expected in ("allreduce.test_timeline_row", "NEGOTIATE_ALLREDUCE", '"ALLREDUCE"', "CYCLE_START"):
                assert expected in text, text
    finally:
        hvd.stop_timeline()
    if hvd.rank() == 0:
        rows = [e["args"]["name"] for e in json.loads(path.read_text()) if e.get("ph") == "M"]
        assert "allreduce.test_timeline_row" in rows, rows
