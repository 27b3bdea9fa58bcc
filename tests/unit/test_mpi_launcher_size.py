"""The MPI engine's guard against a COMM_WORLD that is not the launcher's job (another MPI's mpirun)."""

from __future__ import annotations

import pytest

from hvdplus.common.engines.mpi import check_launcher_size

OPEN_MPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution\x00"


@pytest.mark.parametrize("environ", [{}, {"OMPI_COMM_WORLD_SIZE": "3"}, {"PMI_SIZE": "3"}, {"PMI_SIZE": ""}])
def test_a_matching_or_unknown_launcher_size_passes(environ):
    check_launcher_size(3, environ, OPEN_MPI)


def test_a_launcher_job_larger_than_comm_world_names_both_sizes_and_the_library():
    with pytest.raises(RuntimeError) as info:
        check_launcher_size(1, {"PMI_SIZE": "2"}, OPEN_MPI)
    message = str(info.value)
    assert "started 2 ranks (PMI_SIZE=2) but MPI.COMM_WORLD has 1" in message
    assert "'Open MPI v5.0.11'" in message and "MPI4PY_LIBMPI" in message


def test_open_mpis_launcher_size_is_checked_too():
    with pytest.raises(RuntimeError, match=r"OMPI_COMM_WORLD_SIZE=4"):
        check_launcher_size(1, {"OMPI_COMM_WORLD_SIZE": "4"}, "MPICH Version: 5.0.2")
