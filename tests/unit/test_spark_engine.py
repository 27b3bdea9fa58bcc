"""hvdplus.spark.run refuses MPI however it is asked for (Spark starts the ranks: there is no mpirun)."""

import pytest

from hvdplus.spark.runner import check_engine


@pytest.mark.parametrize(
    "use_mpi, use_gloo, extra_mpi_args, message",
    [
        (True, None, None, "drop use_mpi=True"),
        (None, False, None, "use_gloo=False asks for MPI"),  # Horovod's launcher: not Gloo means MPI
        (None, None, "-x FOO", "extra_mpi_args='-x FOO' needs MPI"),
    ],
)
def test_mpi_is_refused_with_the_reason(use_mpi, use_gloo, extra_mpi_args, message):
    with pytest.raises(ValueError, match=message):
        check_engine(use_mpi, use_gloo, extra_mpi_args)


def test_gloo_is_the_default_and_may_be_asked_for():
    check_engine(None, None, None)
    check_engine(False, True, None)
    with pytest.raises(TypeError, match="use_gloo must be True, False or None, got 'yes'"):
        check_engine(None, "yes", None)
