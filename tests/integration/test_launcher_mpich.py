"""hvdplusrun over MPICH (the mpich wheel's Hydra mpiexec, chosen with HVDPLUS_MPIRUN), and the error every
rank raises when mpi4py loads another MPI than the launcher's (it would otherwise run N jobs of size 1)."""

from __future__ import annotations

import sys

import pytest

from tests.integration.conftest import HVDPLUSRUN, SCRIPTS, job_env, reports, run
from tests.integration.test_launcher_failures import PROMPT
from tests.parallel.jobs import mpich_mpiexec

PY = sys.executable


@pytest.fixture
def mpiexec() -> str:
    pytest.importorskip("mpi4py")
    pytest.importorskip("torch")
    found = mpich_mpiexec()
    if found is None:
        pytest.skip("MPICH is not installed (scripts/test.sh installs the mpich wheel into .venv/mpich)")
    return found


def test_hvdplusrun_runs_a_job_on_the_mpich_named_by_hvdplus_mpirun(mpiexec, tmp_path):
    done = run(
        [HVDPLUSRUN, "-np", "3", "--mpi", "--output-filename", str(tmp_path / "out"), PY, str(SCRIPTS / "report.py")],
        env=job_env(HVDPLUS_MPIRUN=mpiexec),
    )
    assert done.returncode == 0, done.output
    ranks = reports(done.output)
    assert [r["rank"] for r in ranks] == [0, 1, 2], done.output
    assert {r["size"] for r in ranks} == {3}
    assert {r["sum"] for r in ranks} == {3.0}
    assert {r["engine"] for r in ranks} == {"mpi"}
    assert all(r["mpi_library"].startswith("MPICH") for r in ranks), ranks
    for rank in range(3):  # whole lines, tagged with the rank (line-buffered under Hydra's -prepend-rank)
        assert f'[{rank}] {{"rank": {rank},' in done.output, done.output
        written = (tmp_path / "out" / f"rank.{rank}" / "stdout").read_text()
        assert f'"rank": {rank},' in written


def test_a_failing_rank_ends_an_mpich_job_promptly(mpiexec):
    done = run(
        [HVDPLUSRUN, "-np", "3", "--mpi", PY, str(SCRIPTS / "misbehave.py"), "raise"],
        env=job_env(HVDPLUS_MPIRUN=mpiexec),
    )
    assert done.returncode != 0, done.output
    assert "rank 1 fails on purpose" in done.output
    assert done.seconds < PROMPT, f"the job took {done.seconds:.1f} s to end"


def test_mpi4py_on_another_mpi_than_the_launcher_raises_on_every_rank(mpiexec):
    # Without MPI4PY_LIBMPI, mpi4py's wheel loads the venv's Open MPI: each rank would be a job of size 1.
    # Line-buffered stderr (PYTHONUNBUFFERED unset) keeps each traceback line in one Hydra-tagged chunk.
    done = run(
        [mpiexec, "-n", "2", "-prepend-rank", PY, str(SCRIPTS / "report.py")],
        env=job_env(HOROVOD_CPU_OPERATIONS="mpi", PYTHONUNBUFFERED=""),
    )
    assert done.returncode != 0, done.output
    for rank in (0, 1):
        assert (
            f"[{rank}] RuntimeError: the MPI launcher started 2 ranks (PMI_SIZE=2) but MPI.COMM_WORLD has 1"
            in done.output
        ), done.output
    assert "Open MPI" in done.output and "MPI4PY_LIBMPI" in done.output
    assert reports(done.output) == []
    assert done.seconds < PROMPT
