"""hvdplusrun on this machine, end to end: Gloo and MPI mode, output, tuning flags, the horovod alias, run()."""

from __future__ import annotations

import sys

import pytest

from tests.integration.conftest import HVDPLUSRUN, ROOT, SCRIPTS, reports, run

PY = sys.executable


@pytest.mark.parametrize("mode,np", [("--gloo", 2), ("--mpi", 3)])
def test_local_job_runs_every_rank(mode, np, tmp_path):
    done = run(
        [HVDPLUSRUN, "-np", str(np), mode, "--output-filename", str(tmp_path / "out"), PY, str(SCRIPTS / "report.py")]
    )
    assert done.returncode == 0, done.output
    ranks = reports(done.output)
    assert [r["rank"] for r in ranks] == list(range(np)), done.output
    assert {r["sum"] for r in ranks} == {float(sum(range(np)))}
    assert {r["engine"] for r in ranks} == {mode[2:]}
    assert "[1]<stdout>:{" in done.output if mode == "--gloo" else "[1,1]<stdout>:" in done.output
    for rank in range(np):
        written = (tmp_path / "out").rglob(f"rank.{rank}/stdout")
        assert any(f'"rank": {rank}' in path.read_text() for path in written), f"no output file for rank {rank}"


def test_tuning_flags_and_config_file_reach_the_workers(tmp_path):
    config = tmp_path / "hvd.yaml"
    config.write_text(
        "params:\n  fusion_threshold_mb: 4\n  cycle_time_ms: 2.5\n"
        "stall_check:\n  enabled: false\n  warning_time_seconds: 9\nlogging:\n  level: info\n"
    )
    done = run(
        [
            HVDPLUSRUN,
            "-np",
            "2",
            "--gloo",
            "--config-file",
            str(config),
            "--cycle-time-ms",
            "7",
            "--hierarchical-allreduce",
            "--timeline-filename",
            "/tmp/tl.json",
            "-x",
            "HVDPLUS_CACHE_CAPACITY=5",
            PY,
            str(SCRIPTS / "settings_probe.py"),
        ]
    )
    assert done.returncode == 0, done.output
    for seen in reports(done.output):
        assert seen["fusion_threshold"] == 4 * 1024 * 1024
        assert seen["cycle_time_ms"] == 7.0  # the command line wins over the config file
        assert (seen["stall_check_disable"], seen["stall_check_time_seconds"]) == (True, 9.0)
        assert (seen["log_level"], seen["hierarchical_allreduce"], seen["timeline"]) == ("info", True, "/tmp/tl.json")
        assert (seen["cache_capacity"], seen["cpu_operations"]) == (5, "gloo")
        explicit = {"fusion_threshold", "cycle_time_ms", "hierarchical_allreduce", "cache_capacity"}
        assert explicit <= set(seen["explicit"])


def test_unmodified_horovod_script_runs_through_the_alias():
    done = run([HVDPLUSRUN, "-np", "2", "--gloo", PY, str(SCRIPTS / "horovod_script.py")])
    assert done.returncode == 0, done.output
    assert "horovod rank 1/2 sum [3.0, 3.0] module hvdplus.torch" in done.output


def test_no_horovod_alias_flag_turns_the_alias_off():
    done = run([HVDPLUSRUN, "-np", "1", "--gloo", "--no-horovod-alias", PY, str(SCRIPTS / "horovod_script.py")])
    assert done.returncode == 1
    assert "No module named 'horovod'" in done.output
    assert "rank 0 on localhost failed with exit code 1" in done.output


def test_check_build_lists_frameworks_engines_and_mpi():
    done = run([HVDPLUSRUN, "--check-build"])
    assert done.returncode == 0, done.output
    assert "[X] PyTorch" in done.output and "[X] Gloo" in done.output
    assert "mpirun: " in done.output


def test_python_api_run_returns_results_by_rank():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import functions

        from hvdplus.runner import run as hvd_run

        env = {"PYTHONPATH": f"{SCRIPTS}:{ROOT}"}
        assert hvd_run(functions.rank_and_sum, args=(10,), np=2, use_gloo=True, env=env) == [(0, 21.0), (1, 21.0)]
        assert hvd_run(functions.rank_and_sum, args=(1,), np=2, use_mpi=True, env=env) == [(0, 3.0), (1, 3.0)]
        with pytest.raises(RuntimeError, match="(?s)rank 1 ---.*rank one refuses"):
            hvd_run(functions.fail_on_rank_one, np=2, use_gloo=True, env=env)
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.parametrize("mode", ["--gloo", "--mpi"])
def test_pipeline_example_under_hvdplusrun(mode):
    """hvd.pipeline under hvdplusrun on both engines: 2 stages, the unpipelined loss matched (--check)."""
    done = run(
        [HVDPLUSRUN, "-np", "2", mode, PY, str(ROOT / "examples" / "pytorch_pipeline.py"), "--epochs", "1", "--check"]
    )
    assert done.returncode == 0, done.output
    assert "1 pipeline(s) x 2 stages" in done.output and "final loss" in done.output, done.output


def test_planned_groups_of_successive_jobs_in_one_process_meet_apart():
    """shutdown() then init() in the same processes under hvdplusrun --gloo, three times. torch's groups and the
    planned groups of each job meet in hvdplusrun's store under the job's own incarnation (0, 1, 2, the same on every
    rank); before, a later job could read an earlier job's addresses there and fail to connect, or hang (4 runs in
    6). Each job freezes its plan and trains to the same weights on every rank."""
    done = run([HVDPLUSRUN, "-np", "2", "--gloo", PY, str(SCRIPTS / "planned_reinit.py")])
    assert done.returncode == 0, done.output
    jobs = reports(done.output)
    assert sorted((r["rank"], r["job"], r["incarnation"]) for r in jobs) == [
        (rank, job, job) for rank in range(2) for job in range(3)
    ], done.output
    assert all(r["planned"] and r["agree"] for r in jobs), done.output
    assert len({tuple(r["weight"]) for r in jobs}) == 1, done.output
