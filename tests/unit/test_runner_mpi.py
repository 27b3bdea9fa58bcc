"""mpirun command lines for Open MPI and MPICH: hosts and slots, env export, ssh options, root, interfaces."""

import sys

import pytest

from hvdplus.runner.args import parse_args
from hvdplus.runner.job import job_from_args
from hvdplus.runner.mpi_run import RANK_MAIN, abort_on_exception, find_mpirun, launcher_libmpi, mpirun_command


def _spec(*flags):
    return job_from_args(parse_args(["--gloo", *flags, "python", "train.py", "--epochs", "1"]), {"PATH": "/bin"})


def test_open_mpi_command():
    spec = _spec(
        "-np", "3", "-H", "n1:2,n2:2", "-p", "2222", "--network-interfaces", "eth0", "--mpi-args", "--mca btl tcp,self"
    )
    command = mpirun_command("/opt/mpi/bin/mpirun", "openmpi", spec, ["A", "PATH"], as_root=True)
    assert command[:5] == ["/opt/mpi/bin/mpirun", "-np", "3", "-H", "n1:2,n2:1"]
    assert "--allow-run-as-root" in command and "--tag-output" in command
    rsh = command[command.index("plm_rsh_args") + 1]
    assert "-p 2222" in rsh and "BatchMode=yes" in rsh
    assert command[command.index("btl_tcp_if_include") + 1] == "eth0"
    assert command[command.index("oob_tcp_if_include") + 1] == "eth0"
    assert ["-x", "A", "-x", "PATH"] == command[command.index("-x") : command.index("-x") + 4]
    assert command[-9:] == ["--mca", "btl", "tcp,self", "python", "-m", RANK_MAIN, "train.py", "--epochs", "1"]


def test_open_mpi_as_a_user_needs_no_root_flag():
    command = mpirun_command("/opt/mpi/bin/mpirun", "openmpi", _spec("-np", "2"), [], as_root=False)
    assert "--allow-run-as-root" not in command and command[3:5] == ["-H", "localhost:2"]


def test_venv_open_mpi_passes_its_prefix():
    mpirun = f"{sys.prefix}/bin/mpirun"
    command = mpirun_command(mpirun, "openmpi", _spec("-np", "2"), [], as_root=False)
    assert command[command.index("--prefix") + 1] == sys.prefix


def test_mpich_command():
    spec = _spec("-np", "4", "-H", "n1:2,n2:2", "-i", __file__, "--network-interfaces", "ib0")
    command = mpirun_command("mpiexec", "mpich", spec, ["A", "B"], as_root=True)
    assert command[:5] == ["mpiexec", "-np", "4", "-hosts", "n1:2,n2:2"]
    assert "-prepend-rank" in command and "--allow-run-as-root" not in command
    assert command[command.index("-launcher-exec") + 1].startswith("ssh -o BatchMode=yes")
    assert f"-i {__file__}" in command[command.index("-launcher-exec") + 1]
    assert command[command.index("-iface") + 1] == "ib0"
    assert command[command.index("-genvlist") + 1] == "A,B"


@pytest.mark.parametrize("flavor", ["openmpi", "mpich"])
def test_ranks_run_python_under_rank_main(flavor):
    # rank_main: mpi4py's runner, line-buffered output, and the rank's share of the host's cores
    spec = _spec("-np", "2")
    command = mpirun_command("mpiexec", flavor, spec, [], as_root=False)
    assert command[-6:] == ["python", "-m", "hvdplus.runner.rank_main", "train.py", "--epochs", "1"]


def test_hvdplus_mpirun_chooses_the_mpirun(monkeypatch, tmp_path):
    mpirun = tmp_path / "bin" / "mpiexec"
    mpirun.parent.mkdir()
    mpirun.write_text("#!/bin/sh\n")
    mpirun.chmod(0o755)
    monkeypatch.setenv("HVDPLUS_MPIRUN", str(mpirun))
    assert find_mpirun() == str(mpirun)
    monkeypatch.setenv("HVDPLUS_MPIRUN", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="HVDPLUS_MPIRUN=.*is not an executable mpirun"):
        find_mpirun()


def test_mpichs_own_library_is_found_beside_its_mpirun(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    mpirun = tmp_path / "bin" / "mpiexec.hydra"
    mpirun.touch()
    (tmp_path / "bin" / "mpirun").symlink_to(mpirun)
    assert launcher_libmpi(str(tmp_path / "bin" / "mpirun"), "mpich") is None
    (tmp_path / "lib" / "libmpi.so.12").touch()
    assert launcher_libmpi(str(tmp_path / "bin" / "mpirun"), "mpich") == str(tmp_path / "lib" / "libmpi.so.12")
    assert launcher_libmpi(str(tmp_path / "bin" / "mpirun"), "openmpi") is None


def test_unknown_flavor_is_refused():
    with pytest.raises(ValueError, match="MPI flavor must be one of"):
        mpirun_command("mpirun", "lam", _spec("-np", "1"), [], as_root=False)


@pytest.mark.parametrize(
    "command,wrapped",
    [
        (["python", "t.py", "-x"], ["python", "-m", RANK_MAIN, "t.py", "-x"]),
        (["/usr/bin/python3.11", "-m", "pkg"], ["/usr/bin/python3.11", "-m", RANK_MAIN, "-m", "pkg"]),
        (["python", "-u", "t.py"], ["python", "-u", "t.py"]),
        (["./train.sh"], ["./train.sh"]),
    ],
)
def test_python_programs_abort_the_job_on_an_exception(command, wrapped):
    assert abort_on_exception(command) == wrapped
