"""The timeline writes its events as they come: a file opened while the job runs shows them, valid JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hvdplus.common.timeline import Timeline, op_name


def _events_once_written(path: Path, count: int, seconds: float = 5.0) -> list[dict]:
    """The file's events once it holds `count` (read as a user would, while the timeline stays open)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            events = json.loads(path.read_text())
        except json.JSONDecodeError:  # read in the middle of a write
            events = []
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.01)


def test_events_reach_the_file_while_the_timeline_is_open(tmp_path):
    timeline = Timeline(str(tmp_path / "t.json"), mark_cycles=True)
    try:
        timeline.cycle()
        timeline.begin("grad", "NEGOTIATE_ALLREDUCE", "ALLREDUCE")
        timeline.end("grad")
        events = _events_once_written(tmp_path / "t.json", 4)
        assert [e.get("name") for e in events] == ["CYCLE_START", "process_name", "NEGOTIATE_ALLREDUCE", None]
        assert events[1]["args"] == {"name": "allreduce.grad"}
        timeline.begin("grad", "ALLREDUCE")  # later events follow, still valid JSON
        assert len(_events_once_written(tmp_path / "t.json", 5)) == 5
    finally:
        timeline.close()
    assert len(json.loads((tmp_path / "t.json").read_text())) == 5


def test_rows_are_named_as_horovods_pytorch_names_the_op():
    assert op_name("ALLREDUCE", "grad.w") == "allreduce.grad.w"
    assert op_name("ALLGATHER", "x") == "allgather.x"
    assert op_name("ALLREDUCE", "allreduce.noname.ps0.3") == "allreduce.noname.ps0.3"  # an unnamed one's name
