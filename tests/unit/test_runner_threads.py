"""Each rank's share of its host's cores (OMP_NUM_THREADS): the arithmetic, where each launcher path finds the local
rank count, that a value already set wins, and hvdplusrun's one-line note."""

from __future__ import annotations

import pytest

from hvdplus.runner.agent import thread_share, usable_cores
from hvdplus.runner.args import parse_args
from hvdplus.runner.cluster_env import worker_environ
from hvdplus.runner.job import job_from_args, threads_note
from hvdplus.runner.rank_main import mpi_local_size


@pytest.mark.parametrize("local_size,cores,share", [(4, 16, "4"), (3, 16, "5"), (2, 2, "1"), (3, 2, "1")])
def test_the_cores_are_divided_among_the_local_ranks(local_size, cores, share):
    assert thread_share({}, local_size, cores) == {"OMP_NUM_THREADS": share}


def test_the_local_size_defaults_to_horovods_variable():
    assert thread_share({"HOROVOD_LOCAL_SIZE": "4"}, cores=8) == {"OMP_NUM_THREADS": "2"}


def test_a_set_value_or_a_rank_alone_on_its_host_is_left_as_it_is():
    assert thread_share({"OMP_NUM_THREADS": "7"}, 4, 16) == {}
    assert thread_share({}, 1, 16) == {}
    assert thread_share({}, cores=16) == {}  # no local size said: one rank


@pytest.mark.parametrize(
    "env,size",
    [({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3), ({"MPI_LOCALNRANKS": "2"}, 2), ({"OMPI_COMM_WORLD_LOCAL_SIZE": ""}, 1)],
)
def test_rank_main_reads_the_local_size_mpirun_gives(env, size):
    assert mpi_local_size(env) == size


def test_spark_ranks_get_their_share_unless_spark_or_the_user_set_it():
    launch = {"HOROVOD_LOCAL_SIZE": "2", "HOROVOD_RANK": "1"}
    share = str(max(1, usable_cores() // 2))
    assert worker_environ({"PATH": "/bin"}, {}, launch)["OMP_NUM_THREADS"] == share
    assert worker_environ({"OMP_NUM_THREADS": "1"}, {}, launch)["OMP_NUM_THREADS"] == "1"  # Spark's executor cores
    assert worker_environ({"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "3"}, launch)["OMP_NUM_THREADS"] == "3"


def _spec(flags: list[str], environ: dict[str, str]):
    return job_from_args(parse_args([*flags, "python", "train.py"]), {"PATH": "/bin", **environ})


def test_hvdplusrun_says_it_once_where_ranks_share_a_host():
    assert "OMP_NUM_THREADS is not set" in (threads_note(_spec(["-np", "2", "--gloo"], {}), elastic=False) or "")
    assert threads_note(_spec(["-np", "2", "-H", "a:1,b:1", "--gloo"], {}), elastic=False) is None
    assert threads_note(_spec(["-np", "2", "--gloo"], {"OMP_NUM_THREADS": "2"}), elastic=False) is None
    assert threads_note(_spec(["-np", "2", "--gloo", "-x", "OMP_NUM_THREADS=2"], {}), elastic=False) is None
    assert threads_note(_spec(["-np", "1", "--min-np", "1"], {}), elastic=True) is not None
