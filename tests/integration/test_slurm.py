"""A real one-node Slurm: srun without a launcher, srun --mpi=pmix, sbatch of the example, hvdplusrun in salloc."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.conftest import HVDPLUSRUN, SCRIPTS, job_env, reports, run

PY = sys.executable
REPORT = str(SCRIPTS / "report.py")


def _env(slurm) -> dict[str, str]:
    return job_env(SLURM_CONF=slurm.env["SLURM_CONF"])


@pytest.mark.parametrize("n", [2, 3])
def test_srun_without_launcher(slurm, n):
    done = run(["srun", "-n", str(n), PY, REPORT], env=_env(slurm))
    assert done.returncode == 0, done.output
    ranks = reports(done.output)
    assert [r["rank"] for r in ranks] == list(range(n)) and {r["sum"] for r in ranks} == {float(sum(range(n)))}
    assert [r["local_rank"] for r in ranks] == list(range(n)) and {r["engine"] for r in ranks} == {"gloo"}


def test_srun_rendezvous_admits_only_the_job(slurm, tmp_path):
    """Plain srun: rank 0 serves an HMAC-authenticated store and publishes its secret in a 0600 file under
    HVDPLUS_SECRET_DIR; a wrong secret and torch's plain TCPStore client are refused; the file goes with the job."""
    env = {**_env(slurm), "HVDPLUS_SECRET_DIR": str(tmp_path / "secrets")}
    done = run(["srun", "-n", "2", PY, str(SCRIPTS / "srun_secret.py")], env=env)
    assert done.returncode == 0, done.output
    assert done.output.count("secret ok") == 2, done.output
    assert list((tmp_path / "secrets").iterdir()) == []
    assert (tmp_path / "secrets").stat().st_mode & 0o777 == 0o700


def test_srun_with_pmix_uses_mpi(slurm):
    plugins = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, env=_env(slurm))
    if "pmix" not in plugins.stdout + plugins.stderr:
        pytest.skip("this Slurm has no PMIx plugin (Debian: slurm-wlm with libpmix-dev)")
    done = run(["srun", "--mpi=pmix", "-n", "2", PY, REPORT], env=_env(slurm))
    assert done.returncode == 0, done.output
    assert [(r["rank"], r["engine"], r["sum"]) for r in reports(done.output)] == [(0, "mpi", 1.0), (1, "mpi", 1.0)]


def test_sbatch_of_the_example_job_script(slurm, tmp_path):
    out = tmp_path / "job.out"
    done = run(["sbatch", "--wait", f"--output={out}", "examples/slurm/train.sbatch"], env=_env(slurm))
    assert done.returncode == 0, done.output + (out.read_text() if out.exists() else "")
    text = out.read_text()
    assert "[rank 0/2, Gloo] allreduce(Sum) of ones*rank: [1.0, 1.0, 1.0]" in text, text
    assert "[rank 1/2, Gloo] allgather_object: [{'rank': 0}, {'rank': 1}]" in text, text


def test_hvdplusrun_inside_an_allocation_takes_its_hosts(slurm):
    done = run(["salloc", "-n", "3", HVDPLUSRUN, "--gloo", PY, REPORT], env=_env(slurm))
    assert done.returncode == 0, done.output
    ranks = reports(done.output)
    assert [r["rank"] for r in ranks] == [0, 1, 2] and {r["size"] for r in ranks} == {3}, done.output
    assert "[2]<stdout>:" in done.output


@pytest.mark.parametrize("engine", ["gloo", "mpi"])
def test_pipeline_example_under_srun(slurm, engine):
    """hvd.pipeline under plain srun (Gloo) and srun --mpi=pmix (MPI): 2 stages, the unpipelined loss matched."""
    mpi = []
    if engine == "mpi":
        plugins = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, env=_env(slurm))
        if "pmix" not in plugins.stdout + plugins.stderr:
            pytest.skip("this Slurm has no PMIx plugin (Debian: slurm-wlm with libpmix-dev)")
        mpi = ["--mpi=pmix"]
    done = run(
        ["srun", *mpi, "-n", "2", PY, "examples/pytorch_pipeline.py", "--epochs", "1", "--check"], env=_env(slurm)
    )
    assert done.returncode == 0, done.output
    assert "1 pipeline(s) x 2 stages" in done.output and "final loss" in done.output, done.output
