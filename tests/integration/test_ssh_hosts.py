"""hvdplusrun across two hosts (network namespaces, each with its own sshd) over real ssh and real TCP."""

from __future__ import annotations

import shlex
import sys
import time

import pytest

from tests.integration.conftest import HVDPLUSRUN, ROOT, SCRIPTS, alive, reports, run

PY = sys.executable


def _on_launcher(ssh_hosts, *argv: str) -> list[str]:
    args = [HVDPLUSRUN, "-i", str(ssh_hosts.key), *argv]
    return ssh_hosts.launcher_argv(shlex.join(args))


@pytest.mark.parametrize("mode", ["--gloo", "--mpi"])
def test_four_ranks_on_two_hosts(ssh_hosts, mode):
    done = run(_on_launcher(ssh_hosts, "-np", "4", "-H", "hostA:2,hostB:2", mode, PY, str(SCRIPTS / "report.py")))
    assert done.returncode == 0, done.output
    ranks = reports(done.output)
    assert [(r["rank"], r["host"], r["local_rank"], r["cross_rank"]) for r in ranks] == [
        (0, "hostA", 0, 0),
        (1, "hostA", 1, 0),
        (2, "hostB", 0, 1),
        (3, "hostB", 1, 1),
    ], done.output
    assert {r["sum"] for r in ranks} == {6.0} and {r["engine"] for r in ranks} == {mode[2:]}


@pytest.mark.parametrize("mode", ["--gloo", "--mpi"])
def test_hierarchical_collectives_across_real_hosts(ssh_hosts, mode):
    """--hierarchical-allreduce and --hierarchical-allgather across two ssh hosts: results equal the flat ones on
    the global set and on process sets, with sizes that do not divide by the ranks per host; the hierarchical path
    ran (counted), and the sets that cannot use it fall back and say why."""
    scenario = ROOT / "tests" / "parallel" / "scenarios" / "hierarchical.py"
    done = run(
        _on_launcher(
            ssh_hosts,
            "-np",
            "4",
            "-H",
            "hostA:2,hostB:2",
            mode,
            *(["--mpi-args=--mca coll ^han"] if mode == "--mpi" else []),  # Open MPI's own hierarchy off (mpi_tool.py)
            "--hierarchical-allreduce",
            "--hierarchical-allgather",
            "-x",
            "HOSTS=2,2",
            "-x",
            "REAL_HOSTS=1",
            "-x",
            f"EXPECT={'engine' if mode == '--gloo' else 'halving-doubling'}",
            PY,
            str(scenario),
        )
    )
    assert done.returncode == 0, done.output
    assert done.output.count("hierarchical ok") == 4, done.output
    assert "fall back to flat: its hosts run different numbers of ranks (hostA: 2, hostB: 1)" in done.output


def test_worker_killed_on_remote_host_ends_the_job_everywhere(ssh_hosts):
    argv = _on_launcher(
        ssh_hosts, "-np", "4", "-H", "hostA:2,hostB:2", "--gloo", PY, str(SCRIPTS / "misbehave.py"), "kill"
    )
    done = run(argv)
    ended = time.time()
    assert done.returncode == 137, done.output
    assert "rank 1 on hostA failed with exit code 137 (killed by SIGKILL); stopping 3 other workers." in done.output
    failed_at = float(done.output.split("failing at ")[1].split()[0])
    print(f"\nremote kill: job ended {ended - failed_at:.2f} s after rank 1 died")
    assert ended - failed_at < 10, done.output
    time.sleep(0.5)
    pids = [int(line.split()[-1]) for line in done.output.splitlines() if "<stdout>:pid " in line]
    assert len(pids) == 4 and not [p for p in pids if alive(p)], "workers left running on the hosts"


def test_unknown_host_is_named(ssh_hosts):
    done = run(_on_launcher(ssh_hosts, "-np", "2", "-H", "hostA:1,hostC:1", "--gloo", PY, "-c", "pass"))
    assert done.returncode == 1
    assert "cannot reach hostC over ssh" in done.output, done.output
    assert done.seconds < 20


def test_elastic_job_loses_a_remote_worker_and_goes_on(ssh_hosts):
    """Elastic mode over real ssh: a worker on hostB is SIGKILLed after step 4; hostB is blacklisted and the two
    workers on hostA go on from the commit to the end (the tiny model's result does not depend on the size)."""
    script = ROOT / "tests" / "integration" / "scripts" / "elastic_train.py"
    done = run(
        _on_launcher(
            ssh_hosts,
            "-np",
            "4",
            "--min-np",
            "2",
            "-H",
            "hostA:2,hostB:2",
            "-x",
            "STEPS=8",
            "-x",
            "FAIL=hostB/1:4:kill",
            PY,
            str(script),
        ),
        timeout=120,
    )
    assert done.returncode == 0, done.output
    assert "worker hostB/1 (rank 3 of generation 0) failed with exit code 137 (killed by SIGKILL)" in done.output
    assert "generation 1 (worker hostB/1 failed): 2 worker(s): hostA/0, hostA/1" in done.output
    finals = [line for line in done.output.splitlines() if '"final"' in line]
    assert len(finals) == 2 and all('"size": 2' in line for line in finals), done.output
