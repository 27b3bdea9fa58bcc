"""Ranks sharing a host get their share of its cores as OMP_NUM_THREADS (issue 57) on every path hvdplusrun starts
them by (Gloo, MPI, elastic), unless the user set it; hvdplusrun says so in one line."""

from __future__ import annotations

import json
import re
import sys

import pytest

from hvdplus.runner.agent import usable_cores
from tests.integration.conftest import HVDPLUSRUN, SCRIPTS, job_env, run

PROBE = [sys.executable, str(SCRIPTS / "threads_probe.py")]
NOTE = "hvdplusrun: OMP_NUM_THREADS is not set"


def _seen(output: str) -> list[dict]:
    """What each rank printed, after Gloo's `[1]`, Open MPI's `[1,1]` or elastic mode's `[host/slot]` prefix."""
    return [json.loads(m) for m in re.findall(r"^\[[^\]]+\]<stdout>: ?(\{.*\})\s*$", output, re.M)]


def _unset(**extra: str) -> dict[str, str]:
    env = job_env(**extra)
    del env["OMP_NUM_THREADS"]  # job_env pins it to 1 for the other tests
    return env


@pytest.mark.parametrize("flags", [["-np", "2", "--gloo"], ["-np", "3", "--mpi"], ["-np", "2", "--min-np", "2"]])
def test_each_local_rank_gets_its_share_of_the_cores(flags):
    done = run([HVDPLUSRUN, *flags, *PROBE], env=_unset())
    assert done.returncode == 0, done.output
    size = int(flags[1])
    share = str(max(1, usable_cores() // size))
    assert sorted((r["rank"], r["omp"]) for r in _seen(done.output)) == [(rank, share) for rank in range(size)]
    assert done.output.count(NOTE) == 1, done.output


def test_torch_starts_that_many_intra_op_threads():
    done = run([HVDPLUSRUN, "-np", "2", "--gloo", *PROBE, "--torch"], env=_unset())
    assert done.returncode == 0, done.output
    share = max(1, usable_cores() // 2)
    assert [r["torch_threads"] for r in _seen(done.output)] == [share, share]


@pytest.mark.parametrize("mode", ["--gloo", "--mpi"])
def test_the_users_value_wins(mode):
    from_flag = run([HVDPLUSRUN, "-np", "2", mode, "-x", "OMP_NUM_THREADS=3", *PROBE], env=_unset())
    from_env = run([HVDPLUSRUN, "-np", "2", mode, *PROBE], env=job_env(OMP_NUM_THREADS="5"))
    for done, value in ((from_flag, "3"), (from_env, "5")):
        assert done.returncode == 0, done.output
        assert [r["omp"] for r in _seen(done.output)] == [value, value]
        assert NOTE not in done.output


def test_a_rank_alone_on_its_host_keeps_every_core():
    done = run([HVDPLUSRUN, "-np", "1", "--gloo", *PROBE], env=_unset())
    assert done.returncode == 0, done.output
    assert [r["omp"] for r in _seen(done.output)] == [None]
    assert NOTE not in done.output
