"""hvdplus.spark on a real Spark cluster of separate executor JVMs on this machine (`local-cluster[2,2,1024]`: two
executors of two task slots each, the master Spark's own tests use): run() trains as one process does, with ranks
grouped by host; a failing rank ends the job within seconds, naming it; too few slots end it within start_timeout;
run_elastic() goes on when Spark loses a task, and takes the task Spark runs again back in."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, job_env, unavailable

pytestmark = pytest.mark.timeout(180)

SLOTS = 4  # local-cluster[2,2,1024]
ROWS, FEATURES, STEPS, LR = 12, 4, 5, 0.1


def _spark_home(installed: Path) -> Path:
    """A SPARK_HOME of links to pip's PySpark: local-cluster starts its executors from SPARK_HOME and gives them
    work directories under SPARK_HOME/work, which stay out of the installed package this way."""
    home = Path(tempfile.mkdtemp(prefix="hvdplus-spark-home-"))
    for entry in installed.iterdir():
        if entry.name != "work":
            (home / entry.name).symlink_to(entry)
    return home


def _start_session(builder):
    """The session, once both executors of local-cluster have registered with the driver."""
    session = (
        builder.master(f"local-cluster[2,{SLOTS // 2},1024]")
        .appName("hvdplus-spark-tests")
        .config("spark.executorEnv.PYTHONPATH", str(ROOT))
        .config("spark.executorEnv.OMP_NUM_THREADS", "1")
        .config("spark.ui.enabled", "false")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
        .getOrCreate()
    )
    deadline = time.monotonic() + 60
    while session.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3:  # the driver and 2 executors
        if time.monotonic() > deadline:
            session.stop()
            raise RuntimeError("the 2 executors of local-cluster did not register within 60 s")
        time.sleep(0.5)
    return session


@pytest.fixture(scope="module")
def spark():
    """A SparkSession on local-cluster[2,2,1024] (two executor JVMs); stopped after the module."""
    try:
        import pyspark
        from pyspark import cloudpickle
        from pyspark.sql import SparkSession
    except ImportError:
        unavailable("PySpark is not installed: pip install -e '.[spark]'")
    saved = {k: os.environ.get(k) for k in ("SPARK_HOME", "PYSPARK_PYTHON")}
    home = _spark_home(Path(pyspark.__file__).parent)
    os.environ.update(SPARK_HOME=str(home), PYSPARK_PYTHON=sys.executable)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need not import this test module
    try:
        try:
            session = _start_session(SparkSession.builder)
        except Exception as exc:  # noqa: BLE001 - any failure to build the cluster is reported the same way
            unavailable(f"cannot start Spark's local-cluster here: {exc}")
        try:
            yield session
        finally:
            session.stop()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        shutil.rmtree(home, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _data():
    import torch

    x = torch.arange(ROWS * FEATURES, dtype=torch.float64).reshape(ROWS, FEATURES).sin()
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.25


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1).double()


def train():
    """Each rank fits its rows (rank::size) with hvdplus.torch's DistributedOptimizer; its place and weights."""
    import torch

    import hvdplus.torch as hvd

    hvd.init()
    x, y = _data()
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    mine = slice(hvd.rank(), ROWS, hvd.size())
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
    print(f"rank {hvd.rank()} trained", flush=True)
    place = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
    }
    hvd.shutdown()
    return place


def _reference(steps: int = STEPS):
    """The same training in one process, on every row."""
    import torch

    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.mark.parametrize("num_proc", [2, 3])
def test_run_trains_as_one_process_does(spark, num_proc):
    import hvdplus.spark

    out = io.StringIO()
    results = hvdplus.spark.run(train, num_proc=num_proc, start_timeout=60, stdout=out)
    assert [r["rank"] for r in results] == list(range(num_proc))
    assert {r["size"] for r in results} == {num_proc}
    # one machine: every task's host is the same, so the ranks share one local rank space
    assert [r["local_rank"] for r in results] == list(range(num_proc))
    assert {r["local_size"] for r in results} == {num_proc} and {r["cross_rank"] for r in results} == {0}
    reference = _reference()
    for result in results:
        for got, want in zip(result["weights"], reference):
            assert got == pytest.approx(want, abs=1e-9)
    for rank in range(num_proc):
        assert f"[{rank}]<stdout>:rank {rank} trained" in out.getvalue()


def _fail_on_rank_1():
    import torch

    import hvdplus.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError(f"rank 1 gives up at {time.time()!r}")
    hvd.allreduce(torch.ones(1), name="never completes")  # rank 0 waits here for a rank that is gone
    return hvd.rank()


def test_a_failing_rank_ends_the_job_within_seconds_naming_it(spark):
    import hvdplus.spark

    start = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        hvdplus.spark.run(_fail_on_rank_1, num_proc=2, start_timeout=60)
    raised_at, seconds = time.time(), time.monotonic() - start
    message = str(failure.value)
    assert "rank 1 (Spark task 1 on" in message and "ValueError: rank 1 gives up at" in message, message
    failed_at = float(re.search(r"gives up at ([0-9.]+)", message).group(1))
    assert raised_at - failed_at < 5, f"run() raised {raised_at - failed_at:.1f} s after rank 1 failed"
    assert seconds < 60, f"the job took {seconds:.1f} s to fail"
    print(f"run() raised {raised_at - failed_at:.2f} s after rank 1 failed ({seconds:.1f} s after it was called)")
    # nothing was left running: the next job gets every slot at once
    assert hvdplus.spark.run(_rank, num_proc=SLOTS, start_timeout=30) == list(range(SLOTS))


def _kill_the_task_of_rank_1(log):
    import hvdplus.torch as hvd

    hvd.init()
    with open(log, "a") as out:
        out.write(f"rank {hvd.rank()} ran\n")
    if hvd.rank() == 1:
        Path(f"{log}.killed").write_text(repr(time.time()))
        os.kill(os.getppid(), signal.SIGKILL)  # the task's Python worker: Spark fails the barrier stage
    # No collective: rank 0 cannot fail by itself once rank 1 is gone, so only Spark's handling of the lost task can
    # end the job (Spark's kill of task 0 ends this process with its Python worker).
    time.sleep(120)
    return hvd.rank()


def test_a_lost_task_fails_the_job_within_seconds_and_fn_never_runs_twice(spark, tmp_path):
    """Rank 1's task loses its Python worker while rank 0 sleeps (2 minutes): Spark aborts the job (it never
    retries a failed barrier result stage), and run() raises Spark's error naming the lost task within seconds of
    the loss, not when rank 0's sleep ends; fn ran once on each rank, and the job left every slot free."""
    import hvdplus.spark

    log = tmp_path / "runs"
    lost = r"(?s)the Spark job failed: .*barrier task ResultTask\(\d+, 1\) finished unsuccessfully"
    with pytest.raises(RuntimeError, match=lost) as failure:
        hvdplus.spark.run(_kill_the_task_of_rank_1, args=(str(log),), num_proc=2, start_timeout=60)
    seconds = time.time() - float(Path(f"{log}.killed").read_text())
    print(f"run() raised {seconds:.1f} s after rank 1's task was lost: {str(failure.value)[:300]}")
    assert seconds < 30, f"run() raised {seconds:.1f} s after rank 1's task was lost"
    time.sleep(3)  # a retry of the stage, had Spark started one, has had time to run fn again
    assert sorted(log.read_text().splitlines()) == ["rank 0 ran", "rank 1 ran"]
    assert hvdplus.spark.run(_rank, num_proc=SLOTS, start_timeout=30) == list(range(SLOTS))


def _rank():
    return int(os.environ["HOROVOD_RANK"])


def test_too_few_slots_is_a_clear_error_within_start_timeout(spark):
    import hvdplus.spark

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"only 0 of the {SLOTS + 1} Spark task.*start_timeout 5 s"):
        hvdplus.spark.run(_rank, num_proc=SLOTS + 1, start_timeout=5)
    seconds = time.monotonic() - start
    assert seconds < 5 + 10, f"run() raised {seconds:.1f} s after it was called"
    print(f"run() raised {seconds:.1f} s after it was called")


def test_mpi_is_refused_with_the_reason(spark):
    import hvdplus.spark

    with pytest.raises(ValueError, match="over Gloo"):
        hvdplus.spark.run(_rank, num_proc=2, use_mpi=True)


def _elastic_train(total):
    """Elastic training; Spark's first attempt of task 1 has its Python worker killed at batch 3."""
    import torch

    import hvdplus.torch as hvd

    hvd.init()
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model, optimizer, batch=0)
    sizes_at_resets = []  # in this process: it lives on through the resets
    state.register_reset_callbacks([lambda: sizes_at_resets.append(hvd.size())])
    x, y = _data()
    worker = os.environ["HVDPLUS_ELASTIC_WORKER"]

    @hvd.elastic.run
    def fit(state):
        while state.batch < total or hvd.size() < 2:
            if state.batch >= total:  # trained, but alone: wait for Spark's new attempt of the lost task
                if not state.wait_for_host_updates(90):
                    raise RuntimeError("Spark's new attempt of task 1 did not join within 90 s")
                state.check_host_updates()
                continue
            if worker == "spark-task-1-0/0" and state.batch == 3:
                os.kill(os.getppid(), signal.SIGKILL)  # the task's Python worker: Spark loses the task
                time.sleep(60)
            mine = slice(hvd.rank(), ROWS, hvd.size())
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            optimizer.step()
            state.batch += 1
            state.commit()

    fit(state)
    result = {
        "worker": worker,
        "rank": hvd.rank(),
        "size": hvd.size(),
        "batch": state.batch,
        "sizes_at_resets": sizes_at_resets,
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
    }
    hvd.shutdown()
    return result


def test_run_elastic_goes_on_when_spark_loses_a_task(spark, capsys):
    """Spark loses task 1 at batch 3: task 0's worker trains on alone from the last commit, and Spark's second
    attempt of task 1 joins it as a new host. Every batch is a full-batch step at any size (the ranks' rows
    together are all the rows), so both end with the weights of 8 steps in one process."""
    import hvdplus.spark

    results = hvdplus.spark.run_elastic(
        _elastic_train, args=(8,), num_proc=2, min_num_proc=1, start_timeout=60, elastic_timeout=60
    )
    said = capsys.readouterr().err
    assert "worker spark-task-1-0/0 (rank" in said and "blacklisting host spark-task-1-0" in said, said
    assert "1 worker(s): spark-task-0-0/0" in said, said
    assert [r["rank"] for r in results] == [0, 1] and {r["size"] for r in results} == {2}, results
    survivor, newcomer = results
    assert survivor["worker"] == "spark-task-0-0/0", results  # it holds the state: rank 0
    assert newcomer["worker"].startswith("spark-task-1-") and newcomer["worker"] != "spark-task-1-0/0", results
    assert survivor["sizes_at_resets"][0] == 1 and survivor["sizes_at_resets"][-1] == 2, results
    assert {r["batch"] for r in results} == {8}, results
    for result in results:
        for got, want in zip(result["weights"], _reference(8)):
            assert got == pytest.approx(want, abs=1e-9), results


def test_run_elastic_too_few_slots_is_a_clear_error_within_start_timeout(spark):
    import hvdplus.spark

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"only {SLOTS} of the {SLOTS + 1} Spark task.*start_timeout 5 s"):
        hvdplus.spark.run_elastic(_rank, num_proc=SLOTS + 1, start_timeout=5)
    seconds = time.monotonic() - start
    assert seconds < 5 + 10, f"run_elastic() raised {seconds:.1f} s after it was called"
    assert hvdplus.spark.run(_rank, num_proc=SLOTS, start_timeout=30) == list(range(SLOTS))  # all slots free


def test_horovod_spark_is_hvdplus_spark():
    """`import horovod.spark` under hvdplus's alias (what hvdplusrun puts first on PYTHONPATH) loads hvdplus.spark."""
    code = (
        "import sys; from hvdplus.runner.alias import ALIAS_PATH; sys.path.insert(0, ALIAS_PATH)\n"
        "import horovod.spark, hvdplus.spark\n"
        "assert horovod.spark.run is hvdplus.spark.run and horovod.spark.run_elastic is hvdplus.spark.run_elastic\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=job_env(), timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_importing_hvdplus_spark_does_not_import_pyspark():
    code = "import sys, hvdplus.spark; assert 'pyspark' not in sys.modules, 'pyspark imported'; print('ok')"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=job_env(), cwd=Path(ROOT), timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_ranks_are_grouped_by_host_in_the_order_of_their_first_task():
    from hvdplus.runner.cluster_env import place_by_host

    slots = place_by_host(["b", "a", "b", "a", "c"])  # the hosts of Spark tasks 0..4
    assert [s.rank for s in slots] == [0, 2, 1, 3, 4]
    assert [(s.local_rank, s.local_size) for s in slots] == [(0, 2), (0, 2), (1, 2), (1, 2), (0, 1)]
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 3), (1, 3), (0, 2), (1, 2), (2, 3)]
