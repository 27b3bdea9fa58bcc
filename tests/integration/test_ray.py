"""hvdplus.ray on a real two-node Ray cluster (two raylets on this machine, `ray.cluster_utils.Cluster`): Horovod's
RayExecutor and its elastic mode, with hvdplus's runtime in the actors.

The cluster is built once for the module (2 nodes of 2 CPUs) and torn down at its end. The training functions
below run inside the actors (cloudpickle ships them by reference to this module, which the actors import: the
cluster's processes get the checkout on PYTHONPATH)."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, job_env, unavailable

torch = pytest.importorskip("torch")

# Each node: 2 CPUs, 2 GPUs that Ray only counts (as Horovod's Ray tests fake them), a small object store, and the
# checkout on its workers' PYTHONPATH (they import hvdplus and this module).
NODE = {
    "num_cpus": 2,
    "num_gpus": 2,
    "object_store_memory": 120 * 1024 * 1024,
    "env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
}


# ---------------------------------------------------------------------------- functions the actors run
def _data() -> tuple:
    inputs = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4) / 48
    return inputs, inputs.sum(dim=1, keepdim=True) * 0.5 - 0.25


def _model_and_optimizer(distributed: bool) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed:
        import hvdplus.torch as hvd

        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    return model, optimizer


def _weights(model) -> list[float]:
    return [round(v, 6) for v in model.weight.flatten().tolist() + model.bias.tolist()]


def reference(steps: int) -> list[float]:
    """The weights after `steps` full-batch steps in one process."""
    model, optimizer = _model_and_optimizer(distributed=False)
    inputs, targets = _data()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return _weights(model)


def train(steps: int = 4) -> dict:
    """Data-parallel training: rank r takes rows r, r + size, ... (equal shards), so the averaged gradient is the
    full batch's and the weights equal `reference(steps)`. Reports where the rank ran."""
    import ray

    import hvdplus.torch as hvd

    hvd.init()
    model, optimizer = _model_and_optimizer(distributed=True)
    inputs, targets = _data()
    mine = slice(hvd.rank(), None, hvd.size())
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
        optimizer.step()
    report = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "host": os.environ["HOROVOD_HOSTNAME"],
        "node": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "sum": hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="ranks").item(),
        "weights": _weights(model),
    }
    hvd.shutdown()
    return report


class Trainer:
    """An executable: start() creates one per worker, execute() calls it."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def train(self) -> dict:
        return train(self.steps)


def fail_on_rank_1(when: str) -> None:
    """Rank 1 raises (after hvd.init, while rank 0 waits in an allreduce; or before hvd.init, while the others
    wait at the rendezvous), or SIGKILLs its own process after hvd.init; every other rank waits for it."""
    import hvdplus.torch as hvd

    if when == "before init" and os.environ["HOROVOD_RANK"] == "1":
        raise ValueError(f"rank 1 fails on purpose before hvd.init at {time.time()}")
    hvd.init()
    hvd.allreduce(torch.ones(1), name="first")
    if hvd.rank() == 1 and when == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if hvd.rank() == 1:
        raise ValueError(f"rank 1 fails on purpose at {time.time()}")
    hvd.allreduce(torch.ones(1), name="never completes")


def elastic_train(progress: str, kill_at: int = 0, stop_file: str = "", steps: int = 20) -> dict:
    """Elastic training (every rank on the full batch, so any size gives the one-process weights). After each
    commit, rank 0 appends "step size time" to `progress`. The worker of rank 1 in the first generation SIGKILLs its
    own process after step `kill_at`. With `stop_file`, training runs until that file exists (agreed by an
    allreduce), else `steps` steps."""
    import hvdplus.torch as hvd
    from hvdplus.common.basics import elastic_worker

    hvd.init()
    model, optimizer = _model_and_optimizer(distributed=True)
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    inputs, targets = _data()

    def done(step: int) -> bool:
        if not stop_file:
            return step >= steps
        seen = torch.tensor([float(os.path.exists(stop_file))])
        return bool(hvd.allreduce(seen, op=hvd.Max, name=f"stop.{step}").item())

    @hvd.elastic.run
    def loop(state) -> None:
        while not done(state.step):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            state.step += 1
            state.commit()
            if hvd.rank() == 0:
                with open(progress, "a") as out:
                    out.write(f"{state.step} {hvd.size()} {time.time()}\n")
            if state.step == kill_at and hvd.rank() == 1 and elastic_worker().plan.generation == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.1)

    loop(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "steps": state.step, "weights": _weights(model)}


# ---------------------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def ray_installed() -> None:
    """Ray can be imported: else skip with the reason (fail under CI=true, where a skip would hide a broken
    install)."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        unavailable(f"Ray is not installed (pip install 'hvdplus[ray]'): {exc}")


@pytest.fixture(scope="module")
def cluster(ray_installed):
    """Two Ray nodes of 2 CPUs and 2 GPUs (Ray's own, none on this machine: Ray hands out their ids as it would
    real ones) on this machine; the driver connected to the head node. Nodes are made without Ray's exit hooks
    (they install signal handlers, which a test's helper thread cannot): this fixture stops them."""
    import ray
    from ray.cluster_utils import Cluster

    made = Cluster(shutdown_at_exit=False)
    try:
        made.add_node(**NODE, include_dashboard=False)
        made.add_node(**NODE)
        made.wait_for_nodes()
        ray.init(address=made.address)
    except Exception as exc:
        made.shutdown()
        unavailable(f"cannot start a Ray cluster here: {exc}")
    try:
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


def _executor(**kwargs):
    from hvdplus.ray import RayExecutor

    return RayExecutor(RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=30), **kwargs)


def _check_layout(reports: list[dict], per_node: list[int]) -> None:
    """Ranks contiguous per Ray node, `per_node` ranks on the nodes (in any order), local and cross ranks as
    Horovod sets them."""
    assert [r["rank"] for r in reports] == list(range(sum(per_node)))
    nodes = list(dict.fromkeys(r["node"] for r in reports))
    assert sorted(sum(r["node"] == n for r in reports) for n in nodes) == sorted(per_node), reports
    assert [r["node"] for r in reports] == sorted((r["node"] for r in reports), key=nodes.index), "not contiguous"
    for r in reports:
        on_node = [o for o in reports if o["node"] == r["node"]]
        assert r["local_rank"] == on_node.index(r) and r["local_size"] == len(on_node)
        assert r["host"] == f"{r['ip']}-{r['node'][:8]}"
        same_local = [o for o in reports if o["local_rank"] == r["local_rank"]]
        assert r["cross_rank"] == same_local.index(r) and r["cross_size"] == len(same_local)


# ---------------------------------------------------------------------------- static jobs
@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers,cpus,per_node", [(2, 2, [1, 1]), (3, 1, [2, 1])])
def test_run_trains_like_one_process_across_nodes(cluster, workers, cpus, per_node):
    """num_workers packs a bundle per worker (PACK): 2 workers of 2 CPUs take one node each, 3 of 1 CPU fill one
    node and use the other. DistributedOptimizer's weights equal one process's; run() works twice on the same
    actors (each call has a rendezvous of its own), and execute() calls the executables start() created."""
    executor = _executor(num_workers=workers, cpus_per_worker=cpus)
    executor.start(executable_cls=Trainer, executable_args=[3])
    try:
        expected = reference(4)
        for _ in range(2):
            reports = executor.run(train, kwargs={"steps": 4})
            _check_layout(reports, per_node)
            assert {r["sum"] for r in reports} == {float(sum(range(workers)))}
            assert all(r["weights"] == pytest.approx(expected, abs=1e-5) for r in reports), (reports, expected)
        executed = executor.execute(lambda trainer: trainer.train())
        assert all(r["weights"] == pytest.approx(reference(3), abs=1e-5) for r in executed)
        assert executor.execute_single(lambda trainer: trainer.steps) == 3
        refs = executor.run_remote(train, args=[2])
        import ray

        assert [r["rank"] for r in ray.get(refs)] == list(range(workers))
    finally:
        executor.shutdown()


def _train_from_a_task(workers: int) -> list[dict]:
    """A Ray task (Ray Tune's trainable, say) that runs a RayExecutor in the placement group it runs in."""
    executor = _executor(num_workers=workers, cpus_per_worker=1)
    executor.start()
    try:
        return executor.run(train, kwargs={"steps": 3})
    finally:
        executor.shutdown()


@pytest.mark.timeout(150)
def test_a_driver_inside_a_placement_group_puts_its_workers_there(cluster):
    """use_current_placement_group: a task in a placement group of 3 one-CPU bundles (its own and two for
    workers), made with horovod.ray.strategy's create_placement_group as Horovod's test_horovod_train_in_pg
    does, runs the executor; the workers take the group's free bundles (the one CPU left outside the group
    could not hold a new group of two: placement_group_timeout_s would fail the test), and train like one
    process."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from hvdplus.ray.strategy import create_placement_group

    group, bundles = create_placement_group({"CPU": 1, "GPU": 0}, 3, 30, "PACK")
    assert bundles == [{"CPU": 1}] * 3 and ray.util.placement_group_table(group)["state"] == "CREATED"
    try:
        inside = PlacementGroupSchedulingStrategy(group, 0, placement_group_capture_child_tasks=True)
        task = ray.remote(_train_from_a_task).options(num_cpus=1, scheduling_strategy=inside)
        reports = ray.get(task.remote(2), timeout=120)
        assert [r["rank"] for r in reports] == [0, 1]
        assert all(r["weights"] == pytest.approx(reference(3), abs=1e-5) for r in reports)
        assert ray.util.placement_group_table(group)["state"] == "CREATED"  # the executor left the group alone
    finally:
        ray.util.remove_placement_group(group)


@pytest.mark.timeout(60)
def test_a_placement_group_the_cluster_cannot_hold_times_out_and_is_removed(cluster):
    import ray

    from hvdplus.ray.strategy import create_placement_group

    before = set(ray.util.placement_group_table())
    missing = r"STRICT_PACK placement group of 1 x \{'CPU': 64\} was not ready within 1 s"
    with pytest.raises(TimeoutError, match=missing):
        create_placement_group({"CPU": 64}, 1, 1, "STRICT_PACK")
    made = set(ray.util.placement_group_table()) - before
    assert all(ray.util.placement_group_table()[g]["state"] == "REMOVED" for g in made), made


@pytest.mark.timeout(150)
def test_num_hosts_puts_workers_per_host_on_distinct_nodes(cluster):
    """num_hosts=2 x num_workers_per_host=2: one STRICT_SPREAD bundle per node, ranks 0-1 on one node and 2-3 on
    the other, local ranks 0, 1, 0, 1 and cross ranks 0, 0, 1, 1."""
    executor = _executor(num_hosts=2, num_workers_per_host=2, cpus_per_worker=1)
    executor.start()
    try:
        reports = executor.run(train, kwargs={"steps": 2})
        _check_layout(reports, [2, 2])
        assert [r["local_rank"] for r in reports] == [0, 1, 0, 1]
        assert [r["cross_rank"] for r in reports] == [0, 0, 1, 1]
        assert all(r["weights"] == pytest.approx(reference(2), abs=1e-5) for r in reports)
    finally:
        executor.shutdown()


@pytest.mark.timeout(150)
def test_a_raising_worker_fails_the_run_within_seconds_and_the_executor_goes_on(cluster):
    """Rank 1 raises while rank 0 waits in an allreduce: the driver gets rank 1's ValueError, its traceback and
    rank within seconds. Rank 1 raising before hvd.init (rank 0 waits at the rendezvous): the stuck rank 0 is
    ended after the grace period and restarted at the next call. Rank 1's process killed: Ray's RayActorError,
    naming rank 1, and its actor restarted at the next call. Each time, the next run() trains normally."""
    import ray

    executor = _executor(num_workers=2, cpus_per_worker=2)
    executor.start()
    try:
        with pytest.raises(ValueError) as failed:
            executor.run(fail_on_rank_1, args=["after init"])
        caught = time.time()
        text = "".join(traceback.format_exception(failed.value))
        raised = float(re.search(r"fails on purpose at ([\d.]+)", text).group(1))
        print(f"\nafter init: the error reached the driver {caught - raised:.2f} s after rank 1 raised")
        assert caught - raised < 5.0, text
        assert "hvdplus.ray: rank 1 of 2 failed" in text and "fail_on_rank_1" in text, text
        assert [r["rank"] for r in executor.run(train, kwargs={"steps": 2})] == [0, 1]

        started = time.monotonic()
        with pytest.raises(ValueError) as failed:
            executor.run(fail_on_rank_1, args=["before init"])
        waited = time.monotonic() - started
        text = "".join(traceback.format_exception(failed.value))
        print(f"before init: the error reached the driver after {waited:.2f} s")
        assert "rank 1 of 2 failed" in text and "rank(s) [0] had not ended" in text, text
        assert waited < 15.0, text
        reports = executor.run(train, kwargs={"steps": 2})
        assert all(r["weights"] == pytest.approx(reference(2), abs=1e-5) for r in reports)

        started = time.monotonic()
        with pytest.raises(ray.exceptions.RayActorError) as failed:
            executor.run(fail_on_rank_1, args=["killed"])
        waited = time.monotonic() - started
        text = "".join(traceback.format_exception(failed.value))
        print(f"killed: the error reached the driver after {waited:.2f} s (hvd.init included)")
        assert "rank 1 of 2 failed" in text and "had not ended" not in text, text
        assert waited < 10.0, text
        reports = executor.run(train, kwargs={"steps": 2})
        assert all(r["weights"] == pytest.approx(reference(2), abs=1e-5) for r in reports)
    finally:
        executor.shutdown()


def test_arguments_are_checked_as_horovod_does(ray_installed):
    from hvdplus.ray import RayExecutor

    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(settings, max_workers=2)
    with pytest.raises(ValueError, match="use_gpu"):
        RayExecutor(settings, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="num_workers"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="not MPI"):
        RayExecutor(settings, num_workers=1).start(extra_env_vars={"HOROVOD_CPU_OPERATIONS": "mpi"})


def gpu_placement() -> dict:
    """Where a GPU worker runs: its rank, local rank and node, the GPU ids Ray gave its actor, and the
    CUDA_VISIBLE_DEVICES it runs with."""
    import ray

    return {
        "rank": int(os.environ["HOROVOD_RANK"]),
        "local_rank": int(os.environ["HOROVOD_LOCAL_RANK"]),
        "node": ray.get_runtime_context().get_node_id(),
        "gpus": [str(gpu) for gpu in ray.get_gpu_ids()],
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


@pytest.mark.timeout(150)
def test_gpu_workers_see_their_node_s_gpus_in_local_rank_order(cluster):
    """use_gpu with one GPU a worker, on the nodes' GPUs as Ray assigns them: two workers a node, each given a GPU
    of its own by Ray, and every worker of a node sees that node's GPUs ordered by local rank (Horovod's
    CUDA_VISIBLE_DEVICES), so local rank i drives device i, its own GPU."""
    executor = _executor(num_workers=4, cpus_per_worker=1, use_gpu=True)
    executor.start()
    try:
        reports = executor.run(gpu_placement)
    finally:
        executor.shutdown()
    assert [r["rank"] for r in reports] == [0, 1, 2, 3], reports
    nodes = {r["node"] for r in reports}
    assert len(nodes) == 2, reports
    for node in nodes:
        workers = sorted((r for r in reports if r["node"] == node), key=lambda r: r["local_rank"])
        assert [w["local_rank"] for w in workers] == [0, 1] and all(len(w["gpus"]) == 1 for w in workers), reports
        node_gpus = [w["gpus"][0] for w in workers]
        assert len(set(node_gpus)) == 2, reports  # Ray gave each worker a GPU of its own
        assert all(w["visible"] == ",".join(node_gpus) for w in workers), reports
        assert all(w["visible"].split(",")[w["local_rank"]] == w["gpus"][0] for w in workers), reports


def test_visible_gpus_follow_local_ranks_when_actors_alternate_nodes(ray_installed):
    """The rank and device arithmetic where Ray interleaves the nodes: actors in creation order A, B, A, B with
    the GPUs Ray gave each: ranks 0-1 on A, 2-3 on B, and every worker of a node sees that node's GPUs ordered
    by local rank, so local rank i drives device i."""
    from hvdplus.ray.ranks import WorkerNode, cuda_visible_devices, place_ranks

    a, b = "a" * 56, "b" * 56
    nodes = [WorkerNode(a, "10.0.0.1", ("3",)), WorkerNode(b, "10.0.0.2", ("0",)), WorkerNode(a, "10.0.0.1", ("1",))]
    nodes.append(WorkerNode(b, "10.0.0.2", ("2",)))
    slots = place_ranks(nodes)
    assert [(s.rank, s.local_rank, s.cross_rank, s.hostname) for s in slots] == [
        (0, 0, 0, "10.0.0.1-aaaaaaaa"),
        (2, 0, 1, "10.0.0.2-bbbbbbbb"),
        (1, 1, 0, "10.0.0.1-aaaaaaaa"),
        (3, 1, 1, "10.0.0.2-bbbbbbbb"),
    ]
    assert cuda_visible_devices(nodes, slots) == {0: "3,1", 1: "0,2", 2: "3,1", 3: "0,2"}
    assert cuda_visible_devices([WorkerNode(a, "10.0.0.1")], place_ranks([WorkerNode(a, "10.0.0.1")])) == {}


def test_the_horovod_alias_imports_hvdplus_ray(ray_installed):
    """The horovod alias maps horovod.ray and the modules Horovod users import from to hvdplus.ray's, as
    hvdplusrun's workers see them."""
    code = (
        "import hvdplus.ray, horovod.ray; from horovod.ray import RayExecutor, ElasticRayExecutor; "
        "assert RayExecutor is hvdplus.ray.RayExecutor and ElasticRayExecutor is hvdplus.ray.ElasticRayExecutor; "
        "from horovod.ray.elastic import ElasticRayExecutor as E, RayHostDiscovery; "
        "from horovod.ray.runner import RayExecutor as R; from horovod.ray.worker import BaseHorovodWorker as W; "
        "from horovod.ray.strategy import create_placement_group; "
        "assert (E, R, W) == (ElasticRayExecutor, RayExecutor, hvdplus.ray.BaseHorovodWorker); "
        "print('alias ok')"
    )
    alias = str(ROOT / "hvdplus" / "runner" / "horovod_alias")
    env = job_env(PYTHONPATH=f"{alias}{os.pathsep}{ROOT}")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "alias ok" in done.stdout, done.stdout + done.stderr


# ---------------------------------------------------------------------------- elastic jobs
def _progress(path: Path) -> list[tuple[int, int]]:
    """(step, size) of each commit rank 0 wrote."""
    return [(int(step), int(size)) for step, size, _ in _lines(path)]


def _lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if len(line.split()) == 3]


def _gap(path: Path, before: int, after: int) -> float:
    """Seconds from the first change from size `before` to size `after`: from the last commit at `before` to the
    first at `after`."""
    sizes = [(int(size), float(t)) for _, size, t in _lines(path)]
    first = next(i for i in range(1, len(sizes)) if sizes[i][0] == after and sizes[i - 1][0] == before)
    return sizes[first][1] - sizes[first - 1][1]


@pytest.mark.timeout(150)
def test_elastic_goes_on_from_the_commit_after_a_worker_is_killed(cluster, tmp_path):
    """One worker per node (2 CPUs each): rank 1's process is SIGKILLed after step 5; its node is blacklisted,
    and the other worker goes on alone from the last commit, ending with the one-process weights."""
    progress = tmp_path / "progress"
    executor = _executor(min_workers=1, max_workers=2, cpus_per_worker=2, elastic_timeout=60)
    executor.start()
    reports = executor.run(elastic_train, kwargs={"progress": str(progress), "kill_at": 5, "steps": 12})
    sizes = [size for _, size in _progress(progress)]
    assert sizes[:5] == [2] * 5 and sizes[-1] == 1, sizes
    assert len(reports) == 1 and reports[0]["steps"] == 12
    print(f"\nrecovery: {_gap(progress, 2, 1):.2f} s from the last commit at size 2 to the first at size 1")
    assert reports[0]["weights"] == pytest.approx(reference(12), abs=1e-5)


@pytest.mark.timeout(200)
def test_elastic_uses_an_added_node_and_goes_on_when_it_is_removed(cluster, tmp_path):
    """ElasticRayExecutor: training at size 2 on the two nodes; a third node joins (its worker comes in at a
    commit: size 3), then it is removed (its worker dies: size 2 again); training ends with the one-process
    weights."""
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    errors: list[BaseException] = []

    def change_the_cluster() -> None:
        try:
            _wait_for(lambda: len(_progress(progress)) >= 3, "3 steps at size 2")
            added = cluster.add_node(**NODE)
            _wait_for(lambda: any(size == 3 for _, size in _progress(progress)), "a step at size 3")
            cluster.remove_node(added)
            seen = len(_progress(progress))
            _wait_for(lambda: _progress(progress)[-1][1] == 2 and len(_progress(progress)) > seen + 3, "size 2")
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.touch()

    changer = threading.Thread(target=change_the_cluster, daemon=True)
    changer.start()
    from hvdplus.ray import ElasticRayExecutor  # Horovod's first elastic API, on the same driver

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3, elastic_timeout=60, timeout_s=20)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2)
    executor.start()
    reports = executor.run(functools.partial(elastic_train, progress=str(progress), stop_file=str(stop)))
    changer.join(timeout=30)
    assert not errors, errors
    sizes = [size for _, size in _progress(progress)]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2, sizes
    print(f"\nscale up: {_gap(progress, 2, 3):.2f} s between the last commit at size 2 and the first at size 3")
    print(f"node removed: {_gap(progress, 3, 2):.2f} s from the last commit at size 3 to the first at size 2")
    assert len(reports) == 2 and len({r["steps"] for r in reports}) == 1
    expected = reference(reports[0]["steps"])
    assert all(r["weights"] == pytest.approx(expected, abs=1e-5) for r in reports), (reports, expected)


def _wait_for(condition, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.1)
