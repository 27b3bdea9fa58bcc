"""PyTorch jobs beyond the 2- and 3-rank worker suite: Adasum's second recursive-doubling level on 4 ranks."""

from __future__ import annotations

import pytest

from tests.parallel.jobs import WORKERS, mpirun, pytest_argv, run_job

pytest.importorskip("torch")


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["mpi"])  # Adasum runs on every engine at 2 ranks in the worker suite
def test_adasum_on_four_ranks(engine: str) -> None:
    """4 ranks pair as (0, 1), (2, 3), then the two results: allreduce and DistributedOptimizer."""
    if engine == "mpi":
        pytest.importorskip("mpi4py")
        if mpirun() is None:
            pytest.skip("no mpirun found (pip install 'hvdplus[mpi]')")
    code, output = run_job(engine, 4, pytest_argv("--color=no", str(WORKERS / "test_torch_adasum.py")))
    assert code == 0, f"{engine} job with 4 ranks failed (exit {code}):\n{output[-20000:]}"
    # Every power-of-two test ran (only the non-power-of-two error test is skipped), on every rank.
    assert output.count("4 passed, 1 skipped") == 4, output[-5000:]
