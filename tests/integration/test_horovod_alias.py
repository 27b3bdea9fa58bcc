"""`hvdplus-horovod-alias on`: unmodified Horovod scripts under plain srun (with and without PMIx), mpirun and
torchrun, in a fresh environment where pip installed hvdplus from a wheel; a real Horovod is never shadowed; `off`
and `pip uninstall hvdplus` both remove the alias.

The environment is a new venv whose site-packages holds hvdplus (pip-installed from a wheel of this checkout) and
reaches the test venv's frameworks and MPI through a site dir appended after its own, so that what the alias
command writes lands in it and never in the test venv."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, SCRIPTS, job_env, run

ALIAS_PTH = "hvdplus-horovod-alias.pth"


class AliasVenv:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.python = str(path / "bin" / "python")
        self.site = Path(
            subprocess.run(
                [self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pip", "--python", self.python, *args], capture_output=True, text=True, timeout=300
        )

    def alias(self, action: str) -> str:
        done = subprocess.run(
            [str(self.path / "bin" / "hvdplus-horovod-alias"), action], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def env(self, **extra: str) -> dict[str, str]:
        """The job environment without the checkout on PYTHONPATH: hvdplus comes from this venv's install."""
        env = job_env(LD_LIBRARY_PATH=str(Path(sys.prefix) / "lib"))  # the test venv's Open MPI, for mpi4py
        env.pop("PYTHONPATH")
        env["PATH"] = f"{self.path / 'bin'}:{env['PATH']}"
        return {**env, **extra}

    def imports(self, code: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.python, "-c", code], capture_output=True, text=True, env=self.env(**extra), cwd="/", timeout=120
        )


def make_venv(tmp: Path) -> AliasVenv:
    """A new venv with hvdplus pip-installed from a wheel of this checkout."""
    wheel_dir = tmp / "wheel"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=120)
    venv = AliasVenv(tmp / "venv")
    outer = sysconfig.get_paths()["purelib"]  # torch, tensorflow, mpi4py: after the venv's own site-packages
    (venv.site / "zz-test-frameworks.pth").write_text(f"import site; site.addsitedir({outer!r})\n")
    installed = venv.pip("install", "--no-deps", "--no-index", *map(str, wheel_dir.glob("hvdplus-*.whl")))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> AliasVenv:
    return make_venv(tmp_path_factory.mktemp("alias"))


@pytest.fixture
def alias_on(venv):
    out = venv.alias("on")
    assert "pip uninstall hvdplus` removes it too" in out, out
    yield venv
    venv.alias("off")


def test_on_serves_horovod_and_off_removes_it(venv):
    assert "ModuleNotFoundError" in venv.imports("import horovod").stderr
    venv.alias("on")
    assert (venv.site / ALIAS_PTH).exists()
    done = venv.imports(
        "import horovod.torch as hvd, hvdplus.torch; assert hvd is hvdplus.torch; "
        "import horovod.tensorflow.keras as k, hvdplus.tensorflow.keras; "
        "assert k is hvdplus.tensorflow.keras; print('alias ok')"
    )
    assert "alias ok" in done.stdout, done.stdout + done.stderr
    assert "alias on" in venv.alias("status")
    venv.alias("off")
    assert not (venv.site / ALIAS_PTH).exists()
    record = next(venv.site.glob("hvdplus-*.dist-info")) / "RECORD"
    assert ALIAS_PTH not in record.read_text()
    assert "ModuleNotFoundError" in venv.imports("import horovod").stderr


def test_a_real_horovod_is_never_shadowed(alias_on, tmp_path):
    """A real Horovod on PYTHONPATH, and one installed in the venv's own site-packages, is the one imported."""
    real = tmp_path / "real" / "horovod"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    (real / "torch.py").write_text("REAL = True\n")
    done = alias_on.imports(
        "import horovod.torch; assert horovod.REAL and horovod.torch.REAL; print('real')",
        PYTHONPATH=str(tmp_path / "real"),
    )
    assert "real" in done.stdout, done.stdout + done.stderr
    installed = alias_on.site / "horovod"
    installed.mkdir()
    try:
        (installed / "__init__.py").write_text("REAL = True\n")
        done = alias_on.imports("import horovod; assert horovod.REAL; print('real')")
        assert "real" in done.stdout, done.stdout + done.stderr
        assert "a real Horovod" in alias_on.alias("status")
    finally:
        (installed / "__init__.py").unlink()
        installed.rmdir()


def test_pip_uninstall_removes_the_alias(tmp_path_factory):
    """A venv of its own: uninstalling hvdplus takes the .pth with it (it is in hvdplus's RECORD)."""
    venv = make_venv(tmp_path_factory.mktemp("uninstall"))
    venv.alias("on")
    assert (venv.site / ALIAS_PTH).exists()
    removed = venv.pip("uninstall", "-y", "hvdplus")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert not (venv.site / ALIAS_PTH).exists()
    done = venv.imports("import horovod")
    assert "No module named 'horovod'" in done.stderr and "Error processing" not in done.stderr, done.stderr


HOROVOD_SCRIPT = str(SCRIPTS / "horovod_script.py")


def _horovod_ranks(output: str, n: int) -> None:
    for rank in range(n):
        assert f"horovod rank {rank}/{n} sum {[float(sum(range(1, n + 1)))] * 2} module hvdplus.torch" in output, output


@pytest.mark.parametrize("mpi", [None, "pmix"])
def test_unmodified_torch_script_under_plain_srun(slurm, alias_on, mpi):
    if mpi:
        plugins = subprocess.run(
            ["srun", "--mpi=list"], capture_output=True, text=True, env=alias_on.env(SLURM_CONF=slurm.env["SLURM_CONF"])
        )
        if "pmix" not in plugins.stdout + plugins.stderr:
            pytest.skip("this Slurm has no PMIx plugin (Debian: slurm-wlm with libpmix-dev)")
    argv = ["srun", *([f"--mpi={mpi}"] if mpi else []), "-n", "2", alias_on.python, HOROVOD_SCRIPT]
    done = run(argv, env=alias_on.env(SLURM_CONF=slurm.env["SLURM_CONF"]), cwd=Path("/"))
    assert done.returncode == 0, done.output
    _horovod_ranks(done.output, 2)


def test_keras2_era_tf_script_under_plain_srun(slurm, alias_on):
    done = run(
        ["srun", "-n", "2", alias_on.python, str(SCRIPTS / "keras2_horovod_script.py")],
        timeout=240,
        env=alias_on.env(SLURM_CONF=slurm.env["SLURM_CONF"], TF_CPP_MIN_LOG_LEVEL="2"),
        cwd=Path("/"),
    )
    assert done.returncode == 0, done.output[-5000:]
    for rank in (0, 1):  # trained, weights equal on both ranks; the Keras 2 idioms layer came with the alias
        assert re.search(rf"rank {rank}: lr 0\.20, loss [\d.]+, weights agree: True", done.output), done.output[-5000:]
    assert done.output.count("Keras2IdiomWarning: the optimizer argument lr= is Keras 2") == 2, done.output[-5000:]


@pytest.mark.parametrize("n", [2, 3])
def test_unmodified_torch_script_under_mpirun(alias_on, n):
    mpirun = str(Path(sys.executable).parent / "mpirun")
    done = run(
        [mpirun, "-np", str(n), "--oversubscribe", "--bind-to", "none", alias_on.python, HOROVOD_SCRIPT],
        env=alias_on.env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"),
        cwd=Path("/"),
    )
    assert done.returncode == 0, done.output
    _horovod_ranks(done.output, n)


def test_unmodified_torch_script_under_torchrun(alias_on):
    done = run(
        [alias_on.python, "-m", "torch.distributed.run", "--nproc-per-node", "2", HOROVOD_SCRIPT],
        env=alias_on.env(),
        cwd=Path("/"),
    )
    assert done.returncode == 0, done.output
    _horovod_ranks(done.output, 2)
