"""Real multi-process jobs for hvdplus.tensorflow and hvdplus.keras: the TF worker suite on 2 and 3 ranks.

One job per (engine, ranks) runs every TF worker test, since importing TensorFlow dominates a rank's start-up.
MPI runs 2 and 3 ranks; Gloo runs 2 (the adapter is engine-agnostic; the torch suite covers Gloo at 3 ranks)."""

from __future__ import annotations

import pytest

from tests.parallel.jobs import ROOT, mpirun, pytest_argv, run_job

WORKERS_TF = ROOT / "tests" / "parallel" / "workers_tf"


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine,np", [("mpi", 2), ("mpi", 3), ("gloo", 2)])
def test_tf_worker_suite(engine: str, np: int) -> None:
    """Every TF worker test passes on every rank (a failure on any rank fails the job)."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras", minversion="3")
    if engine == "mpi":
        pytest.importorskip("mpi4py")
        if mpirun() is None:
            pytest.skip("no mpirun found (pip install 'hvdplus[mpi]')")
    else:
        pytest.importorskip("torch")  # the Gloo engine is torch.distributed's
    code, output = run_job(engine, np, pytest_argv("--color=no", str(WORKERS_TF)),
                           extra_env={"TF_CPP_MIN_LOG_LEVEL": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"})
    assert code == 0, f"{engine} job with {np} ranks failed (exit {code}):\n{output[-20000:]}"
