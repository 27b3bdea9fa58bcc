"""PyTorch jobs beyond the 2- and 3-rank worker suite: Adasum's second recursive-doubling level on 4 ranks, and
ZeroOptimizer in a fresh job on the device path's CPU simulation."""

from __future__ import annotations

import json
import re

import pytest

from tests.parallel.jobs import ROOT, WORKERS, mpirun, pytest_argv, run_job

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


@pytest.mark.parallel
@pytest.mark.timeout(200)
@pytest.mark.parametrize("engine, np", [("gloo", 2), ("mpi", 3)])
def test_zero_optimizer_as_the_first_collective_on_the_device_path(engine: str, np: int) -> None:
    """HVDPLUS_DEVICE_PATH_ON_CPU=1, ZeroOptimizer before any other collective: it trains, equal to
    DistributedOptimizer (1e-6: SGD with momentum, 4 steps of a small model; the sums differ in order only)."""
    if engine == "mpi":
        pytest.importorskip("mpi4py")
    scenario = ROOT / "tests" / "parallel" / "scenarios" / "zero_first_on_device_path.py"
    code, output = run_job(engine, np, [str(scenario)], extra_env={"HVDPLUS_DEVICE_PATH_ON_CPU": "1"}, timeout=150)
    assert code == 0, output[-6000:]
    results = [json.loads(line) for line in re.findall(r'(\{"rank".*\})', output)]
    assert sorted(r["rank"] for r in results) == list(range(np)), output[-6000:]
    assert all(r["max_diff"] < 1e-6 for r in results), results
