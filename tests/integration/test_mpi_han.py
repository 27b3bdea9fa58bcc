"""Hierarchical collectives and Open MPI's han (issue 57): with the venv's Open MPI as it installs (han open, above
tuned), the library's own allreduce is hierarchical already and hvdplus's falls back to flat, saying why; with
`--mca coll ^han` (or OMPI_MCA_coll=^han) hvdplus builds its groups. Real mpirun, 4 ranks on 2 named hosts."""

from __future__ import annotations

import sys

import pytest

from tests.integration.conftest import BIN, SCRIPTS, job_env, reports, run

pytest.importorskip("mpi4py")
MPIRUN = [str(BIN / "mpirun"), "-np", "4", "--oversubscribe", "--allow-run-as-root", "--tag-output"]
PROBE = [sys.executable, str(SCRIPTS / "han_probe.py")]


def test_han_on_runs_flat_and_says_why():
    done = run([*MPIRUN, *PROBE])
    assert done.returncode == 0, done.output
    seen = reports(done.output)
    assert len(seen) == 4 and not any(r["hierarchical"] for r in seen), done.output
    assert all("han component already reduces across hosts" in r["reason"] and r["han"] for r in seen), seen
    assert all(r["thread_level_kept"] for r in seen), seen  # reading MPI_T left MPI at MPI_THREAD_MULTIPLE


@pytest.mark.parametrize("how", ["flag", "env"])
def test_han_off_builds_hvdpluss_groups(how):
    flags, env = (["--mca", "coll", "^han"], job_env()) if how == "flag" else ([], job_env(OMPI_MCA_coll="^han"))
    done = run([*MPIRUN, *flags, *PROBE], env=env)
    assert done.returncode == 0, done.output
    seen = reports(done.output)
    assert len(seen) == 4 and all(r["hierarchical"] and r["han"] == "" for r in seen), done.output
