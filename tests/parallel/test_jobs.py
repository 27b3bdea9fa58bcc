"""Real multi-process jobs: the worker suite at 2 and 3 ranks over Open MPI and Gloo, its engine files over MPICH."""

from __future__ import annotations

import re

import pytest

from tests.parallel.jobs import (
    ROOT,
    WORKERS,
    assert_every_file_ran,
    assert_every_rank_ran,
    assert_stress_ran,
    mpich_mpiexec,
    mpirun,
    pytest_argv,
    run_job,
    stress_job,
)


def _skip_if_missing(engine: str) -> None:
    if engine in ("mpi", "mpich"):
        pytest.importorskip("mpi4py")
    if engine == "mpi" and mpirun() is None:
        pytest.skip("no mpirun found (pip install 'hvdplus[mpi]')")
    if engine == "mpich" and mpich_mpiexec() is None:
        pytest.skip("MPICH is not installed (scripts/test.sh installs the mpich wheel into .venv/mpich)")
    pytest.importorskip("torch")


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine, np", [("mpi", 2), ("mpi", 3), ("gloo", 2), ("gloo", 3)])
def test_worker_suite(engine: str, np: int) -> None:
    """Every worker test passes on every rank (a failure on any rank fails the job)."""
    _skip_if_missing(engine)
    code, output = run_job(engine, np, pytest_argv(str(WORKERS)))
    assert code == 0, f"{engine} job with {np} ranks failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran(engine, np, output, at_least=150)


@pytest.mark.parallel
@pytest.mark.timeout(400)
# Under stress the suite takes about twice as long (2 cores, 2026-11-27: Gloo 2 ranks 37 s quiet, 68 s stressed;
# MPI 3 ranks 84 s; MPI 2 61 s; Gloo 3 94 s), so CI runs one stress job per engine, at the sizes the TF suite's
# quiet jobs use (all four pairs passed by hand).
@pytest.mark.parametrize("engine, np", [("mpi", 3), ("gloo", 2)])
def test_worker_suite_under_stress(engine: str, np: int) -> None:
    """The worker suite with each rank sleeping a random time before each submit, beside processes that keep every
    core busy (tests/parallel/stress.py): ranks that drift apart still agree on every outcome."""
    _skip_if_missing(engine)
    code, output = stress_job(engine, np, pytest_argv(str(WORKERS)), timeout=360)
    assert code == 0, f"{engine} stress job with {np} ranks failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran(engine, np, output, at_least=150)
    assert_stress_ran(np, output)


# MPICH is a second MPI under the same engine: its job runs the files whose tests reach the engine in every way
# (collectives, errors, the optimizers' negotiated and planned paths, idle rounds), at 3 ranks; the rest (joins
# on process sets, ZeRO-3, pipelines, SyncBatchNorm, Adasum) differ in nothing MPICH could change.
MPICH_FILES = (
    "test_coordinator_idle.py",
    "test_errors.py",
    "test_flat_collectives.py",
    "test_torch_ops.py",
    "test_torch_optimizer.py",
    "test_torch_sparse_groups.py",
    "test_torch_planned.py",
    "test_torch_zero.py",
)


@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_engine_files_over_mpich():
    """The worker files that exercise the MPI engine, on MPICH at 3 ranks."""
    _skip_if_missing("mpich")
    code, output = run_job("mpich", 3, pytest_argv(*(str(WORKERS / name) for name in MPICH_FILES)))
    assert code == 0, f"mpich job with 3 ranks failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran("mpich", 3, output, at_least=100)


@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_optimizer_without_buckets():
    """HVDPLUS_BUCKET_BYTES=0: DistributedOptimizer allreduces each gradient on its own (Horovod's own path)."""
    _skip_if_missing("mpi")
    code, output = run_job(
        "mpi", 3, pytest_argv(str(WORKERS / "test_torch_optimizer.py")), extra_env={"HVDPLUS_BUCKET_BYTES": "0"}
    )
    assert code == 0, f"job failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran("mpi", 3, output, at_least=10)


@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_optimizer_negotiated_every_step():
    """HVDPLUS_PLANNED_PATH=0: every DistributedOptimizer step takes Horovod's negotiated path (with the planned
    path on, the optimizer tests negotiate only their first step)."""
    _skip_if_missing("mpi")
    # (The sparse and grouped optimizer tests never plan: explicit groups and sparse gradients stay negotiated.)
    files = [str(WORKERS / "test_torch_optimizer.py")]
    code, output = run_job("mpi", 3, pytest_argv(*files), extra_env={"HVDPLUS_PLANNED_PATH": "0"})
    assert code == 0, f"job failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran("mpi", 3, output, at_least=10)


DEVICE_PLANE_FILES = (
    "test_torch_device_plane.py",
    "test_torch_ops.py",
    "test_torch_optimizer.py",
    "test_torch_sparse_groups.py",
    "test_torch_planned.py",
    "test_torch_zero.py",  # ZeroOptimizer's reduce-scatters and allgathers on the plane (ZeRO-3's units too)
    "test_torch_zero3.py",
    "test_torch_pipeline.py",
    "test_coordinator_idle.py::test_a_rank_left_out_of_its_peers_collectives_stops_holding_them_back",
)
MPI_DEVICE_PLANE_FILES = (
    "test_torch_device_plane.py",
    "test_torch_planned.py",
    "test_torch_optimizer.py::test_buckets_follow_the_engine_unless_set",
    "test_coordinator_idle.py::test_a_rank_left_out_of_its_peers_collectives_stops_holding_them_back",
)


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine, np, files", [("gloo", 2, DEVICE_PLANE_FILES), ("mpi", 3, MPI_DEVICE_PLANE_FILES)])
def test_device_plane_on_cpu_tensors(engine, np, files):
    """HVDPLUS_DEVICE_PATH_ON_CPU=1: CUDA tensors' code path (torch buffer operations, the torch.distributed device
    engine, the executor's device plane, the planned path's groups on the device engine) on CPU tensors. Over Gloo
    the collective and optimizer worker tests run through it; over MPI the device engine makes its own
    torch.distributed job, as a GPU job under mpirun does."""
    _skip_if_missing(engine)
    code, output = run_job(
        engine, np, pytest_argv(*(str(WORKERS / name) for name in files)), extra_env={"HVDPLUS_DEVICE_PATH_ON_CPU": "1"}
    )
    assert code == 0, f"{engine} job with {np} ranks failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran(engine, np, output, at_least=100 if engine == "gloo" else 25)


# ZeroOptimizer's, stage 3's and the pipeline's own CUDA tests beside the collectives', and how many tests of each
# file pass on every rank at 1 rank (NCCL) and at 2 or 3 (ranks sharing a GPU over Gloo). At 1 rank ZeRO-3's
# out-of-memory test (it needs a rank left waiting) and the multi-stage pipeline tests skip.
CUDA_TESTS_RUN = {
    1: {
        "test_torch_cuda.py": 15,
        "test_torch_cuda_zero.py": 5,
        "test_torch_cuda_zero3.py": 8,
        "test_torch_cuda_pipeline.py": 1,
    },
    2: {
        "test_torch_cuda.py": 15,
        "test_torch_cuda_zero.py": 5,
        "test_torch_cuda_zero3.py": 9,
        "test_torch_cuda_pipeline.py": 5,
    },
}
CUDA_FILES = tuple(str(WORKERS / name) for name in CUDA_TESTS_RUN[1])


SHARDING_FILES = ("test_torch_zero.py", "test_torch_zero3.py", "test_torch_pipeline.py")


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine, np", [("gloo", 3), ("mpi", 2), ("mpi", 3)])
def test_sharding_and_pipelines_on_the_device_plane(engine, np):
    """HVDPLUS_DEVICE_PATH_ON_CPU=1: ZeRO 1-3, offload and the pipeline run their whole worker suites through the
    device plane (the GPU's code path) at the sizes and on the engines the Gloo 2-rank job above does not."""
    _skip_if_missing(engine)
    argv = pytest_argv(*(str(WORKERS / name) for name in SHARDING_FILES))
    code, output = run_job(engine, np, argv, extra_env={"HVDPLUS_DEVICE_PATH_ON_CPU": "1"})
    assert code == 0, f"{engine} job with {np} ranks failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran(engine, np, output, at_least=60)


@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_sharding_and_pipelines_staged_through_host_copies():
    """HVDPLUS_STAGED_PATH_ON_CPU=1: ZeRO 1-3, offload and the pipeline on the path of CUDA tensors that no device
    plane takes (HOROVOD_GPU_OPERATIONS=mpi), where a tensor's host buffer is a copy that never shares its memory:
    a result that is not copied back fails here, as it would on a GPU."""
    argv = pytest_argv(*(str(WORKERS / name) for name in SHARDING_FILES))
    code, output = run_job("gloo", 2, argv, extra_env={"HVDPLUS_STAGED_PATH_ON_CPU": "1"})
    assert code == 0, f"staged job with 2 ranks failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran("gloo", 2, output, at_least=70)


@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_cuda_suite_on_one_rank():
    """The CUDA worker tests on NCCL, at 1 rank (NCCL refuses two ranks on one GPU); on machines with a GPU."""
    torch = pytest.importorskip("torch")
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        pytest.skip("needs a CUDA device and torch with NCCL")
    code, output = run_job("gloo", 1, pytest_argv(*CUDA_FILES, list_passed=True))
    assert code == 0, f"CUDA job failed (exit {code}):\n{output[-20000:]}"
    assert_every_file_ran("gloo", 1, output, CUDA_TESTS_RUN[1])


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("np", [2, 3])
def test_cuda_suite_on_ranks_sharing_a_gpu(np):
    """The CUDA worker tests with several ranks on one GPU: HOROVOD_GPU_OPERATIONS=gloo (Gloo on CUDA tensors), the
    planned path included; on machines with a GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    argv = pytest_argv(*CUDA_FILES, list_passed=True)
    code, output = run_job("gloo", np, argv, extra_env={"HOROVOD_GPU_OPERATIONS": "gloo"})
    assert code == 0, f"CUDA job with {np} ranks failed (exit {code}):\n{output[-20000:]}"
    assert_every_file_ran("gloo", np, output, CUDA_TESTS_RUN[2])


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["mpi"])  # ZeRO itself runs on every engine in the worker suite
def test_zero_checkpoint_from_2_ranks_resumes_on_3(engine, tmp_path):
    """ZeroOptimizer's consolidated state saved by a 2-rank job is resharded by a 3-rank job, which then trains on
    to the parameters of an uninterrupted one-process run."""
    _skip_if_missing(engine)
    script, path = str(ROOT / "tests" / "parallel" / "scenarios" / "zero_reshard.py"), str(tmp_path / "zero.pt")
    code, output = run_job(engine, 2, [script, "save", path], timeout=120)
    assert code == 0, f"save job failed (exit {code}):\n{output[-10000:]}"
    code, output = run_job(engine, 3, [script, "resume", path], timeout=120)
    assert code == 0, f"resume job failed (exit {code}):\n{output[-10000:]}"
    assert output.count("resumed state matches the uninterrupted reference") == 3, output[-5000:]


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["gloo"])  # stage 3 itself runs on every engine in the worker suite
def test_zero3_checkpoints_from_2_ranks_resume_on_3(engine, tmp_path):
    """A ZeRO-3 model's consolidated file and per-rank shards, saved by a 2-rank job (a plain model loads the
    file), each resume a meta-built model in a 3-rank job, which then trains on as one process does."""
    _skip_if_missing(engine)
    script = str(ROOT / "tests" / "parallel" / "scenarios" / "zero3_reshard.py")
    paths = [str(tmp_path / "full.pt"), str(tmp_path / "shards")]
    code, output = run_job(engine, 2, [script, "save", *paths], timeout=120)
    assert code == 0, f"save job failed (exit {code}):\n{output[-10000:]}"
    assert "a plain model loads the consolidated checkpoint" in output
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["rank-0-of-2.pt", "rank-1-of-2.pt"]
    code, output = run_job(engine, 3, [script, "resume", *paths], timeout=120)
    assert code == 0, f"resume job failed (exit {code}):\n{output[-10000:]}"
    for kind in ("consolidated", "sharded"):
        assert output.count(f"resumed from the {kind} checkpoint as one process trains") == 3, output[-5000:]


@pytest.mark.parallel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["gloo"])  # 4 ranks over MPI: the ZB-V example test (test_examples.py)
def test_pipeline_suite_on_4_ranks(engine):
    """The pipeline worker tests on 4 ranks: 2 stages x 2 data-parallel replicas, and 4 stages x 1 (the 2- and
    3-rank jobs above cover 2 x 1 and 3 x 1)."""
    _skip_if_missing(engine)
    zero3 = "test_torch_zero3.py::test_pipeline_stages_sharded_over_their_data_parallel_set"
    code, output = run_job(
        engine, 4, pytest_argv(str(WORKERS / "test_torch_pipeline.py"), str(WORKERS / zero3)), timeout=280
    )
    assert code == 0, f"{engine} job with 4 ranks failed (exit {code}):\n{output[-20000:]}"
    assert_every_rank_ran(engine, 4, output, at_least=15)


# Rank 1 lets mpi4py initialise MPI at MPI_THREAD_SERIALIZED, as an application that set mpi4py.rc would.
_SERIALIZED_RANK_1 = """
import os, time
import mpi4py
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
if rank == 1:
    mpi4py.rc.thread_level = "serialized"
import hvdplus.torch as hvd
start = time.monotonic()
try:
    hvd.init()
except RuntimeError as exc:
    print(f"rank {rank} refused in {time.monotonic() - start:.1f} s: {exc}", flush=True)
else:
    print(f"rank {rank} went on", flush=True)
"""


@pytest.mark.parallel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["mpi", "mpich"])
def test_mpi_below_thread_multiple_is_refused_on_every_rank(engine):
    """One rank's MPI initialised at MPI_THREAD_SERIALIZED: every rank's hvd.init() raises the same error naming
    that rank and the fix, within seconds, instead of calling MPI from several threads."""
    _skip_if_missing(engine)
    code, output = run_job(engine, 3, ["-c", _SERIALIZED_RANK_1], timeout=60)
    assert code == 0, output
    refusals = re.findall(
        r"rank (\d) refused in ([\d.]+) s: hvdplus calls MPI from several threads and needs MPI_THREAD_MULTIPLE, "
        r"but MPI was initialised with MPI_THREAD_SERIALIZED on rank\(s\) 1\.",
        output,
    )
    assert sorted(rank for rank, _ in refusals) == ["0", "1", "2"], output
    assert max(float(seconds) for _, seconds in refusals) < 30, output
    assert "went on" not in output, output


_HUNG_TEST = """
import threading
import time


def wait_for_a_peer_that_never_comes():
    time.sleep(60)


def test_hangs():
    threading.Thread(target=time.sleep, args=(60,), name="busy-elsewhere", daemon=True).start()
    wait_for_a_peer_that_never_comes()
"""


@pytest.mark.parallel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["mpi", "gloo"])
def test_a_job_that_hangs_ends_with_where_each_rank_waited(engine, tmp_path):
    """A worker test that times out is reported, at the end of the job's output (what CI shows), with each rank's
    own traceback: where its main thread waited, not only the dump of every other thread that pytest-timeout prints
    after it."""
    _skip_if_missing(engine)
    (tmp_path / "test_hung.py").write_text(_HUNG_TEST)
    code, output = run_job(engine, 2, [*pytest_argv(str(tmp_path / "test_hung.py")), "--timeout=3"], timeout=60)
    assert code != 0, output
    first_report = re.search(r"----- rank \d: its failure -----", output)
    assert first_report is not None, output[-3000:]
    digest = output[first_report.start() :]  # the output's end
    # Open MPI ends the job when the first rank exits: a rank whose timeout fires later may be stopped before it
    # reports. Gloo jobs wait for every rank.
    reported = [rank for rank in (0, 1) if f"----- rank {rank}: its failure -----" in digest]
    assert reported == [0, 1] or (engine == "mpi" and reported), digest
    for rank in reported:
        own = digest[digest.index(f"----- rank {rank}: its failure -----") :]
        assert "in wait_for_a_peer_that_never_comes" in own and "Timeout (>3.0s)" in own, digest
    assert "Stack of busy-elsewhere" in output and "Stack of busy-elsewhere" not in digest, digest
    assert len(digest) < 3000, digest


_INIT_WITH_REPEATED_RANKS = """
import torch
import hvdplus.torch as hvd

first, again, everyone = hvd.ProcessSet([0]), hvd.ProcessSet([0]), hvd.ProcessSet([1, 0])
try:
    hvd.init(process_sets=[first, again, everyone])
except ValueError as exc:
    print(f"rank {hvd.rank()}: {exc}", flush=True)
assert first.process_set_id not in (None, 0) and again.process_set_id is None and everyone.process_set_id is None
if hvd.rank() == 0:  # the sets before the duplicate are registered, and collectives go on
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=first).item() == 1
assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 2
hvd.shutdown()
"""


@pytest.mark.parallel
@pytest.mark.timeout(120)
def test_init_refuses_repeated_ranks_on_every_rank():
    """As Horovod's init: a process_sets entry with the ranks of an earlier one (or every rank: the global set's)
    raises ValueError on every rank naming the first such entry, once the others are registered."""
    _skip_if_missing("gloo")
    code, output = run_job("gloo", 2, ["-c", _INIT_WITH_REPEATED_RANKS], timeout=60)
    message = "Horovod could not be initialized because process_sets entry number 1 is a duplicate: ProcessSet("
    assert code == 0 and output.count(message) == 2, output
