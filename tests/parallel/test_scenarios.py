"""Whole-job behaviours: hierarchical allreduce, stall warnings, a dead worker."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.parallel.jobs import run_job

pytest.importorskip("torch")
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None


def on_both_engines(test):
    """A whole-job scenario run over MPI (when mpi4py is installed) and over Gloo."""
    engines = [pytest.param("mpi", marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")), "gloo"]
    return pytest.mark.parallel(pytest.mark.timeout(200)(pytest.mark.parametrize("engine", engines)(test)))


@pytest.mark.parallel
@pytest.mark.timeout(200)
def test_hierarchical_allreduce_on_two_hosts():
    """4 ranks whose HOROVOD_HOSTNAME says 2 hosts x 2 ranks: local/cross groups and 3-step allreduce."""
    code, output = run_job("gloo", 4, [str(SCENARIOS / "hierarchical.py")],
                           {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"},
                           rank_env=lambda rank: {"HOROVOD_HOSTNAME": f"host{rank // 2}"})
    assert code == 0, output
    assert output.count("hierarchical ok") == 4


@on_both_engines
def test_stall_warning_names_missing_rank(engine):
    code, output = run_job(engine, 2, [str(SCENARIOS / "stall.py")], {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    assert code == 0, output
    assert re.search(r"allreduce 'late.tensor'.*submitted by ranks \[0\], missing ranks \[1\]", output), output
    assert output.count("completed after the stall") == 2


@pytest.mark.parallel
@pytest.mark.timeout(200)
def test_dead_worker_raises_on_the_others_within_seconds():
    code, output = run_job("gloo", 3, [str(SCENARIOS / "dead_worker.py")], timeout=60)
    assert code == 3, output  # the dead rank's own exit status; the survivors exited 0
    times = [float(t) for t in re.findall(r"raised HorovodInternalError after ([\d.]+) s", output)]
    assert len(times) == 2, output
    assert max(times) < 10, output


@on_both_engines
def test_stall_shutdown_names_the_tensor_and_the_missing_rank(engine):
    code, output = run_job(engine, 2, [str(SCENARIOS / "stall_shutdown.py")],
                           {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    assert code == 0, output
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: raised .*stalled longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2: "
                         r"allreduce 'late.tensor' \(missing ranks \[1\]\)", output), output


@on_both_engines
def test_peer_shutdown_leaves_rank_and_size_readable(engine):
    """As in Horovod: after another rank's shutdown, rank() and size() still answer; collectives raise."""
    code, output = run_job(engine, 3, [str(SCENARIOS / "peer_shutdown.py")], timeout=60)
    assert code == 0, output
    for rank in (1, 2):
        expected = (f"rank {rank}/3: raised HorovodInternalError: hvdplus can no longer run collectives: "
                    "hvdplus was shut down on rank 0")
        assert expected in output, output


@pytest.mark.timeout(120)
def test_single_process_without_launcher():
    """`python script.py` with no launcher is a job of one rank, as with Horovod."""
    import subprocess
    import sys

    from tests.parallel.jobs import ROOT, worker_env

    done = subprocess.run([sys.executable, "examples/pytorch_collectives.py"], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 0/1, single process] allreduce(Sum) of ones*rank: [0.0, 0.0, 0.0]" in done.stdout
    assert "allgather_object: [{'rank': 0}]" in done.stdout


@pytest.mark.parallel
@pytest.mark.timeout(120)
def test_timeline_is_a_valid_chrome_trace(tmp_path):
    import json

    path = tmp_path / "timeline.json"
    code, output = run_job("gloo", 2, [str(SCENARIOS / "timeline.py")], {"HOROVOD_TIMELINE": str(path)})
    assert code == 0, output
    events = json.loads(path.read_text())
    rows = {e["args"]["name"]: e["pid"] for e in events if e.get("ph") == "M"}
    assert set(rows) == {"grad.w", "gathered"}
    spans = [e["name"] for e in events if e.get("ph") == "B" and e["pid"] == rows["grad.w"]]
    assert spans == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"] * 3
    begins = sum(1 for e in events if e.get("ph") == "B")
    assert begins == sum(1 for e in events if e.get("ph") == "E")


@on_both_engines
def test_negotiation_by_recursive_doubling(engine):
    """3 ranks (not a power of two: one rank folds in and out) swap merged tables over the real engine."""
    code, output = run_job(engine, 3, [str(SCENARIOS / "negotiation_doubling.py")],
                           {"HVDPLUS_NEGOTIATION_DOUBLING_RANKS": "2"}, timeout=90)
    assert code == 0, output
    assert output.count("mismatch raised") == 3, output
    assert len(re.findall(r"rank \d: doubling ok after \d+ exchanges", output)) == 3, output
