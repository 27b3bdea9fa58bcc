"""Whole-job behaviours: hierarchical allreduce, stall warnings, a dead worker."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.parallel.jobs import ROOT, run_job
from tests.parallel.stress import cpu_hogs, hog_count

pytest.importorskip("torch")
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None


def on_both_engines(test):
    """A whole-job scenario run over MPI (when mpi4py is installed) and over Gloo."""
    engines = [pytest.param("mpi", marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")), "gloo"]
    return pytest.mark.parallel(pytest.mark.timeout(200)(pytest.mark.parametrize("engine", engines)(test)))


@pytest.mark.parallel
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "engine,hosts,env,expect",
    [
        # auto for 2 hosts over MPI, with Open MPI's own hierarchical allreduce (han) off
        ("mpi", "2,2", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "OMPI_MCA_coll": "^han"}, "halving-doubling"),
        ("mpi", "2,2", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, "flat"),  # han on: flat, with the reason
        ("gloo", "2,2,2", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HVDPLUS_CROSS_ALGORITHM": "ring"}, "ring"),
        ("gloo", "2,1", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, "flat"),  # uneven hosts: flat, with the reason
        ("mpi", "2,2", {"HOROVOD_HIERARCHICAL_ALLGATHER": "0"}, "flat"),  # nothing asked: flat (the default)
    ],
    ids=["mpi-2x2-auto", "mpi-2x2-han", "gloo-3x2-ring", "gloo-uneven", "mpi-2x2-default"],
)
def test_hierarchical_collectives_on_simulated_hosts(engine, hosts, env, expect):
    """Ranks told they live on several hosts: hierarchical allreduce and allgather on the global set and on
    process sets equal the flat results, the expected path ran (counted), uneven layouts fall back and say why."""
    size = sum(int(n) for n in hosts.split(","))
    code, output = run_job(
        engine,
        size,
        [str(SCENARIOS / "hierarchical.py")],
        {"HOSTS": hosts, "EXPECT": expect, "HOROVOD_HIERARCHICAL_ALLGATHER": "1", **env},
    )
    assert code == 0, output
    assert output.count("hierarchical ok") == size, output
    if hosts == "2,1":
        assert "fall back to flat: its hosts run different numbers of ranks (host0: 2, host1: 1)" in output, output
    if engine == "mpi" and expect == "flat" and "HOROVOD_HIERARCHICAL_ALLREDUCE" in env:
        assert "fall back to flat: Open MPI's han component already reduces across hosts" in output, output


@pytest.mark.parallel
@pytest.mark.timeout(200)
# A job takes 3-7 s on 2 cores (up to 21 s loaded beside other jobs): one loaded job per engine, at the worker
# suites' sizes.
@pytest.mark.parametrize(
    "engine, np, load",
    [
        pytest.param("mpi", 2, "quiet", marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")),
        pytest.param("mpi", 3, "quiet", marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")),
        ("gloo", 2, "quiet"),
        ("gloo", 3, "quiet"),
        pytest.param("mpi", 3, "loaded", marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")),
        ("gloo", 2, "loaded"),
    ],
)
def test_no_rank_leaves_a_barrier_before_every_member_arrived(engine, np, load):
    """Each member of the whole job, then of the set without rank 0, arrives late in turn: every member leaves
    each barrier after the late one called it (one clock: the ranks share the machine), quiet and beside processes
    that keep every core busy (tests/parallel/stress.py)."""
    with cpu_hogs(hog_count(np) if load == "loaded" else 0, 120):
        code, output = run_job(engine, np, [str(SCENARIOS / "barrier_arrival.py")], timeout=120)
    assert code == 0, output
    assert output.count("every rank left each barrier after the last one arrived") == np, output


@pytest.mark.parallel
@pytest.mark.timeout(200)
def test_the_barrier_scenario_fails_where_the_barrier_lets_ranks_leave_early():
    """The scenario above, with hvd.barrier replaced by a call that returns at once, fails on every rank and names
    barriers of both sets: it can catch a barrier that lets a rank go before the others have arrived."""
    code, output = run_job("gloo", 3, [str(SCENARIOS / "barrier_arrival.py")], {"SCENARIO_BARRIER": "none"}, timeout=60)
    assert code == 1, output
    assert output.count("EARLY BARRIER EXITS") == 3, output
    assert re.search(r"global\.\d+: a rank left", output) and re.search(r"without-rank-0\.\d+: a rank left", output)


@on_both_engines
def test_stall_warning_names_missing_rank(engine):
    code, output = run_job(engine, 2, [str(SCENARIOS / "stall.py")], {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    assert code == 0, output
    assert re.search(r"allreduce 'late.tensor'.*submitted by ranks \[0\], missing ranks \[1\]", output), output
    assert output.count("completed after the stall") == 2


@pytest.mark.parallel
@pytest.mark.timeout(200)
def test_a_planned_step_waits_for_a_paused_rank_beyond_the_engine_timeout():
    """Gloo's planned groups have no timeout of their own: the peers' buckets wait for a rank that pauses for
    longer than HVDPLUS_TIMEOUT (3 s here: the rendezvous at init waits that long too), and the stall check (1 s
    here) names the paused rank meanwhile."""
    env = {"HVDPLUS_TIMEOUT": "3", "HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}
    code, output = run_job("gloo", 2, [str(SCENARIOS / "planned_pause.py")], env, timeout=60)
    assert code == 0, output
    assert output.count("planned True, steps done, weights agree True") == 2, output
    assert re.search(
        r"rank 1 has not answered a planned step for \d+ s: it may be frozen or hung, or have stopped", output
    ), output


@pytest.mark.parallel
@pytest.mark.timeout(200)
def test_dead_worker_raises_on_the_others_within_seconds():
    code, output = run_job("gloo", 3, [str(SCENARIOS / "dead_worker.py")], timeout=60)
    assert code == 3, output  # the dead rank's own exit status; the survivors exited 0
    times = [float(t) for t in re.findall(r"raised HorovodInternalError after ([\d.]+) s", output)]
    assert len(times) == 2, output
    assert max(times) < 10, output


@on_both_engines
@pytest.mark.parametrize("where", ["cycle", "execute"])
def test_a_failure_in_one_background_thread_is_named_on_every_rank(engine, where):
    """A rank whose background thread fails announces it: every pending and later call on every rank raises within
    seconds naming rank 1's error, and no rank hangs. Over MPI, peers blocked inside a data collective that rank 1
    never joined (`execute`) are released only when rank 1's process exits and mpirun ends the job."""
    code, output = run_job(engine, 3, [str(SCENARIOS / "thread_failure.py"), where], timeout=60)
    assert code == 1, output
    injected = f"collective failed on rank 1: RuntimeError: injected failure in {where}"
    reporting = [1] if engine == "mpi" and where == "execute" else [0, 1, 2]
    for rank in reporting:
        raised = re.search(rf"rank {rank}: raised after ([\d.]+) s: .*{injected}", output)
        assert raised and float(raised.group(1)) < 5, output
        assert re.search(
            rf"rank {rank}: later call raised: hvdplus can no longer run collectives: .*{injected}", output
        ), output
    for rank in set(range(3)) - {1}:
        assert f"rank {rank}: no error" not in output, output


@pytest.mark.parallel
@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["open", "step", "join"])
def test_a_rank_that_dies_on_the_planned_path_stops_its_peers_within_seconds(where):
    """A rank dies while its peers wait for it on the planned path: arriving in the plan's new group (`open`), in a
    planned step's allreduce (`step`), or while a joined peer serves the planned steps with zeros (`join`). Over
    Gloo, run without a launcher that would stop them, the survivors raise HorovodInternalError within seconds
    instead of waiting for the group's timeout (a year). (Over MPI, a rank that dies ends the MPI job.)"""
    code, output = run_job("gloo", 3, [str(SCENARIOS / "planned_death.py"), where], timeout=60)
    dead = 0 if where == "join" else 1
    assert code == 3, output
    assert f"rank {dead}: exits in {where}" in output, output
    for rank in set(range(3)) - {dead}:
        raised = re.search(rf"rank {rank}: raised after ([\d.]+) s: ", output)
        assert raised and float(raised.group(1)) < 10, output
        assert f"rank {rank}: no error" not in output, output


_MPI = pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")
_STALL = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"}
_FROZEN = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}
_SET_FAILURES = [
    ("gloo", "dead", {}),  # over MPI, a rank that dies ends the MPI job
    ("gloo", "stall", _STALL),
    pytest.param("mpi", "stall", _STALL, marks=_MPI),
    ("gloo", "frozen", _FROZEN),
    pytest.param("mpi", "frozen", _FROZEN, marks=_MPI),
]
_SET_FAILURE_TEXT = {
    "dead": "",
    "stall": r"stalled longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2: allreduce 'late.tensor' "
    r"\(missing ranks \[2\]\)",
    "frozen": r"rank 2 did not answer a control round for \d+ s",
}


@pytest.mark.parallel
@pytest.mark.timeout(200)
@pytest.mark.parametrize("engine, mode, env", _SET_FAILURES)
def test_a_failure_in_a_process_sets_own_rounds_reaches_every_rank(engine, mode, env):
    """A member of a process set dies, stalls or freezes while its peer waits for it in the set's own rounds
    (common/control/set_rounds.py): the peer raises within seconds, naming it, and rank 0, outside the set and sharing
    no round with them, raises at its next collective instead of hanging."""
    code, output = run_job(engine, 3, [str(SCENARIOS / "set_failures.py"), mode], env, timeout=90)
    # (mpirun reports a rank that exits without MPI_Finalize, as these do once hvdplus failed, with exit code 1.)
    assert code == (3 if mode == "dead" else 1 if engine == "mpi" else 0), output
    raised = re.search(rf"rank 1: raised after ([\d.]+) s: .*{_SET_FAILURE_TEXT[mode]}", output)
    assert raised and float(raised.group(1)) < 10, output
    # Rank 0 names the set's failure, which a member announced (a dead rank breaks the transport instead). A frozen
    # rank 2 may also hold up a round of the whole job: rank 0 then names it (with rank 1, whose rounds stopped).
    silent = r"(rank 2|ranks \[[\d, ]*2\]) did not answer a control round"
    named = silent if mode == "frozen" else _SET_FAILURE_TEXT[mode]
    assert re.search(rf"rank 0: raised after ([\d.]+) s: .*{named}", output), output
    assert "no error" not in output, output


@on_both_engines
def test_stall_shutdown_names_the_tensor_and_the_missing_rank(engine):
    code, output = run_job(
        engine,
        2,
        [str(SCENARIOS / "stall_shutdown.py")],
        {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"},
    )
    assert code == 0, output
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank}: raised .*stalled longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2: "
            r"allreduce 'late.tensor' \(missing ranks \[1\]\)",
            output,
        ), output


@on_both_engines
def test_peer_shutdown_leaves_rank_and_size_readable(engine):
    """As in Horovod: after another rank's shutdown, rank() and size() still answer; collectives raise."""
    code, output = run_job(engine, 3, [str(SCENARIOS / "peer_shutdown.py")], timeout=60)
    assert code == 0, output
    for rank in (1, 2):
        expected = (
            f"rank {rank}/3: raised HorovodInternalError: hvdplus can no longer run collectives: "
            "hvdplus was shut down on rank 0"
        )
        assert expected in output, output


@pytest.mark.timeout(120)
def test_single_process_without_launcher():
    """`python script.py` with no launcher is a job of one rank, as with Horovod."""
    import subprocess
    import sys

    from tests.parallel.jobs import worker_env

    done = subprocess.run(
        [sys.executable, "examples/pytorch_collectives.py"],
        cwd=ROOT,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 0/1, single process] allreduce(Sum) of ones*rank: [0.0, 0.0, 0.0]" in done.stdout
    assert "allgather_object: [{'rank': 0}]" in done.stdout


@pytest.mark.parallel
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "engine,np",
    [
        pytest.param("mpi", 3, marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")),
        ("gloo", 2),
    ],
)
def test_init_process_sets_as_horovods_tests_use_them(engine, np):
    """Duplicates in hvd.init(process_sets=...) raise on the ranks that listed them (MPI communicators included)
    and a later init with valid sets works; the same sets work again after a shutdown."""
    code, output = run_job(engine, np, [str(SCENARIOS / "init_process_sets.py")], {"TEST_SIZE": str(np)}, timeout=150)
    assert code == 0, output
    assert output.count("init process sets ok") == np, output


@pytest.mark.parallel
@pytest.mark.timeout(120)
def test_timeline_is_a_valid_chrome_trace_with_horovods_phases(tmp_path):
    """4 ranks on 2 simulated hosts: every tensor's row holds NEGOTIATE, the op span and its activities (QUEUE,
    fusion copies, the engine call, the hierarchical sub-steps nested), spans balance, and the file parsed while
    the job was still running."""
    import json

    path = tmp_path / "timeline.json"
    code, output = run_job(
        "gloo",
        4,
        [str(SCENARIOS / "timeline.py")],
        {"HOROVOD_TIMELINE": str(path), "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"},
        rank_env=lambda rank: {"HOROVOD_HOSTNAME": f"host{rank // 2}"},
    )
    assert code == 0, output
    assert "valid while running" in output, output
    events = json.loads(path.read_text())
    rows = {e["args"]["name"]: e["pid"] for e in events if e.get("ph") == "M"}
    named = {"grad.w", "fused.0", "fused.2", "after.flush"}
    assert {f"allreduce.{name}" for name in named} | {"allgather.gathered"} <= set(rows)

    def spans(name):
        return [e["name"] for e in events if e.get("ph") == "B" and e["pid"] == rows[name]]

    hierarchical = ["HIERARCHICAL_ALLREDUCE", "LOCAL_REDUCESCATTER", "CROSS_ALLREDUCE", "LOCAL_ALLGATHER"]
    assert spans("allreduce.grad.w") == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", *hierarchical] * 3
    assert spans("allgather.gathered") == ["NEGOTIATE_ALLGATHER", "ALLGATHER", "QUEUE", "GLOO_ALLGATHER"] * 3
    fused = spans("allreduce.fused.1")
    assert fused[:3] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE"], fused
    assert fused.count("MEMCPY_IN_FUSION_BUFFER") == fused.count("MEMCPY_OUT_FUSION_BUFFER") >= 1, fused
    for row in rows.values():  # every span on every row is closed, and closed after it opened
        depth = 0
        for event in (e for e in events if e.get("pid") == row and e.get("ph") in "BE"):
            depth += 1 if event["ph"] == "B" else -1
            assert depth >= 0
        assert depth == 0


@pytest.mark.parallel
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "engine,np",
    [
        pytest.param("mpi", 2, marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")),
        pytest.param("mpi", 3, marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")),
        ("gloo", 2),
        ("gloo", 3),
    ],
)
def test_timelines_started_and_stopped_while_collectives_run(tmp_path, engine, np):
    """Rank 0 starts and stops 30 timelines from a thread while every rank runs async allreduces and allgathers:
    no error, every result right, every file a valid Chrome trace, the job ends normally. HOROVOD_TIMELINE=DYNAMIC
    is set, as Horovod's scripts set it for this: it names no file (Horovod's meaning), so none is written."""
    code, output = run_job(
        engine,
        np,
        [str(SCENARIOS / "timeline_swaps.py")],
        {"TIMELINE_DIR": str(tmp_path), "HOROVOD_TIMELINE": "DYNAMIC"},
        timeout=120,
    )
    assert not (ROOT / "DYNAMIC").exists(), "HOROVOD_TIMELINE=DYNAMIC was taken for a file name"
    assert code == 0, output
    assert re.search(r"30 timelines valid over \d+ steps, [1-9]\d* spans", output), output
    assert output.count("timeline swaps done") == np, output
    assert "Error" not in output and "Traceback" not in output, output


@on_both_engines
def test_negotiation_by_recursive_doubling(engine):
    """3 ranks (not a power of two: one rank folds in and out) swap merged tables over the real engine."""
    code, output = run_job(
        engine, 3, [str(SCENARIOS / "negotiation_doubling.py")], {"HVDPLUS_NEGOTIATION_DOUBLING_RANKS": "2"}, timeout=90
    )
    assert code == 0, output
    assert output.count("mismatch raised") == 3, output
    assert len(re.findall(r"rank \d: doubling ok after \d+ exchanges", output)) == 3, output


@pytest.mark.parallel
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "engine,np,hosts",
    [
        pytest.param("mpi", 2, 1, marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")),
        ("gloo", 3, 1),
        ("gloo", 4, 2),  # 2 simulated hosts x 2 ranks: the hierarchical options and the cross algorithm are candidates
    ],
    ids=["mpi-2", "gloo-3", "gloo-2x2"],
)
def test_autotune_converges_with_the_users_cycle_time_fixed(tmp_path, engine, np, hosts):
    """HOROVOD_AUTOTUNE with HOROVOD_CYCLE_TIME given: rank 0 samples fusion thresholds (and, across hosts, the
    hierarchical options) but never the cycle time, logs every sample and its choice to the CSV, every rank ends
    on that choice, and every allreduce along the way is right."""
    import ast
    import csv

    from hvdplus.common.autotune import TUNED

    log = tmp_path / "at.csv"
    env = {
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": str(log),
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "12",
        "HOROVOD_CYCLE_TIME": "2",
    }
    code, output = run_job(
        engine,
        np,
        [str(SCENARIOS / "autotune.py"), "150"],
        env,
        rank_env=lambda rank: {"HOROVOD_HOSTNAME": f"host{rank * hosts // np}"},
        timeout=150,
    )
    assert code == 0, output
    tuned = [dict(ast.literal_eval(found)) for found in re.findall(r"150 steps correct; tuned (\[.*\])", output)]
    assert len(tuned) == np and all(t == tuned[0] for t in tuned), output
    with open(log, newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["sample", "phase", *TUNED, "bytes", "seconds", "score"]
    assert [r["phase"] for r in rows[:2]] == ["warmup", "sample"] and rows[-1]["phase"] == "chosen", rows
    samples = [r for r in rows if r["phase"] == "sample"]
    assert len(samples) >= 6 and {r["cycle_time_ms"] for r in rows} == {"2.0"}, rows
    assert len({r["fusion_threshold"] for r in samples}) >= 6, rows
    assert all(int(r["bytes"]) > 0 and float(r["score"]) > 0 for r in rows), rows
    chosen = rows[-1]
    assert {name: chosen[name] for name in TUNED} == {name: str(tuned[0][name]) for name in TUNED}, (chosen, tuned[0])
    assert {r["hierarchical_allreduce"] for r in samples} == ({"True", "False"} if hosts > 1 else {"False"}), rows


@pytest.mark.parallel
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "engine,np", [pytest.param("mpi", 2, marks=pytest.mark.skipif(not HAS_MPI4PY, reason="needs mpi4py")), ("gloo", 3)]
)
def test_the_elastic_sync_decision_is_collective(engine, np):
    """horovod#3494: one rank needs a sync after a reset and another would skip it: every rank syncs."""
    code, output = run_job(engine, np, [str(SCENARIOS / "elastic_sync_decision.py")], timeout=60)
    assert code == 0, output
    assert all(f"rank {r}: syncs 2, value 0" in output for r in range(np)), output
