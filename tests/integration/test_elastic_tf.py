"""hvd.elastic for TensorFlow and Keras 3 as a Horovod Elastic user runs it: real hvdplusrun jobs in Gloo mode on
local "hosts" (`localhost` and `127.0.0.1` count as two), and one-process checks of the states and callbacks.

Every job trains on the same batch on every rank, so the averaged gradient does not depend on the size: whatever
fails or joins, the final weights must equal a one-process run of the same number of steps (the scripts run
without hvdplusrun are the references). The tolerance is 1e-6: the ranks' gradients are equal, so each step's
average is exact up to one float32 rounding of a sum of at most 3 equal numbers, over at most 24 steps of a small
SGD whose updates shrink.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import HVDPLUSRUN, SCRIPTS, discovery_script, job_env, run

pytest.importorskip("tensorflow")
pytest.importorskip("keras", minversion="3")

PY = str(Path(sys.executable))
KERAS = str(SCRIPTS / "elastic_tf_keras.py")
LOOP = str(SCRIPTS / "elastic_tf_loop.py")
UNIT = str(SCRIPTS / "elastic_tf_unit.py")
TIMEOUT = 120  # TensorFlow starts slowly on a busy machine; these jobs take 15-35 s
EPOCHS, STEPS = 4, 6
UNIT_CHECKS = [
    "tensorflow_state_restores_the_commit_into_reused_arrays",
    "tensorflow_state_keeps_keras_variables_too",
    "tensorflow_state_sync_keeps_rank_0s_values_and_commits_them",
    "tensorflow_state_in_a_graph_uses_the_session",
    "tensorflow_state_in_a_graph_needs_a_session",
    "keras_state_builds_the_optimizer_and_restores_weights_and_slots",
    "keras_state_reset_empties_a_distributed_optimizers_gradient_accumulation",
    "keras_state_refuses_an_unbuilt_model_no_optimizer_or_a_zero_optimizer",
    "run_restores_the_commit_after_a_collective_failed_in_a_graph",
    "run_lets_other_tensorflow_errors_through",
    "callbacks_resume_an_epoch_at_its_batch_with_initial_epoch",
    "callbacks_count_epochs_when_fit_starts_at_zero",
    "commit_state_callback_commits_every_few_batches_and_at_epoch_ends",
]


def _lines(output: str, worker: str | None = None) -> list[dict]:
    """The JSON lines the workers printed (of one worker, by its id, if given); a one-process run's too."""
    found = [json.loads(m) for m in re.findall(r"^(?:\[[^\]]+\]<stdout>:)?(\{.*\})\s*$", output, re.M)]
    return [line for line in found if worker is None or line.get("worker") == worker]


def _finals(output: str) -> list[dict]:
    return [line for line in _lines(output) if "final" in line]


def _reference(script: str, **env: str) -> list[float]:
    """The final weights of `script` run as one process, without hvdplusrun and without failures."""
    done = run([PY, script], timeout=TIMEOUT, env=job_env(**env))
    assert done.returncode == 0, done.output[-4000:]
    [final] = _finals(done.output)
    return final["final"]


@pytest.fixture(scope="module")
def keras_reference() -> list[float]:
    return _reference(KERAS, EPOCHS=str(EPOCHS), STEPS=str(STEPS))


@pytest.fixture(scope="module")
def unit_results(tmp_path_factory) -> dict[str, str | None]:
    """Runs the one-process checks as a one-rank Gloo job; each check's traceback, or None."""
    rendezvous = tmp_path_factory.mktemp("elastic_tf_unit") / "rendezvous"
    done = run(
        [PY, UNIT],
        timeout=TIMEOUT,
        env=job_env(HOROVOD_RANK="0", HOROVOD_SIZE="1", HVDPLUS_RENDEZVOUS_FILE=str(rendezvous)),
    )
    assert done.returncode == 0, done.output[-4000:]
    results = {line["check"]: line["error"] for line in _lines(done.output) if "check" in line}
    assert sorted(results) == sorted(UNIT_CHECKS), done.output[-4000:]
    return results


@pytest.mark.parametrize("check", UNIT_CHECKS)
def test_one_process(unit_results, check):
    assert unit_results[check] is None, unit_results[check]


def _keras_job(*flags: str, **env: str):
    return run(
        [HVDPLUSRUN, *flags, PY, KERAS], timeout=TIMEOUT, env=job_env(EPOCHS=str(EPOCHS), STEPS=str(STEPS), **env)
    )


def _assert_every_batch_once(output: str, worker: str, first: tuple[int, int] = (0, 1)) -> list[int]:
    """`worker` went through every batch of every epoch from `first` once, in order, with fit's epoch numbers
    equal to the job's (state.epoch after each epoch is the next one); returns the size at each batch."""
    lines = _lines(output, worker)
    batches = [(line["epoch"], line["batch"]) for line in lines if "batch" in line]
    expected = [(e, b) for e in range(EPOCHS) for b in range(1, STEPS + 1)]
    assert batches == expected[expected.index(first) :], output[-4000:]
    ends = [(line["epoch_end"], line["state_epoch"]) for line in lines if "epoch_end" in line]
    assert ends == [(e, e + 1) for e in range(first[0], EPOCHS)], output[-4000:]
    return [line["size"] for line in lines if "batch" in line]


def _assert_finished_like_one_process(output: str, size: int, reference: list[float]) -> None:
    finals = _finals(output)
    assert len(finals) == size and {f["size"] for f in finals} == {size}, output[-4000:]
    assert all(f["final"] == finals[0]["final"] for f in finals), finals  # the same weights on every rank
    assert {f["iterations"] for f in finals} == {EPOCHS * STEPS}, finals  # no step lost or repeated
    assert finals[0]["final"] == pytest.approx(reference, abs=1e-6)


def test_keras_fit_goes_on_from_the_commit_after_a_worker_is_killed_mid_epoch(keras_reference):
    """3 workers on 2 hosts; the one on 127.0.0.1 is SIGKILLed after the commit of batch 3 of epoch 1. The other two
    go on at size 2 from batch 4 of epoch 1 (fit resumed at initial_epoch=state.epoch, the epoch cut to the batches
    it still had), and end like a one-process run of EPOCHS * STEPS steps."""
    done = _keras_job("-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1", KILL="127.0.0.1/0:1:3")
    assert done.returncode == 0, done.output[-4000:]
    assert "worker 127.0.0.1/0 (rank 2 of generation 0) failed with exit code 137" in done.output, done.output[-4000:]
    for survivor in ("localhost/0", "localhost/1"):
        sizes = _assert_every_batch_once(done.output, survivor)
        assert sizes == [3] * (STEPS + 3) + [2] * (EPOCHS * STEPS - STEPS - 3), sizes
    _assert_finished_like_one_process(done.output, 2, keras_reference)


def test_keras_epochs_stay_right_after_a_scale_up(tmp_path, keras_reference):
    """horovod#2844: after a worker joins, fit must go on at the job's epoch. One worker trains; after batch 2 of
    epoch 1 it adds 127.0.0.1 to the discovery script's hosts; the commit of batch 3 raises HostsUpdatedInterrupt,
    and both workers go on from batch 4 of epoch 1, numbering epochs as the job does."""
    hosts, script = discovery_script(tmp_path, "localhost:1\n")
    done = _keras_job("-np", "1", "--min-np", "1", "--host-discovery-script", str(script), GROW=f"{hosts}:1:2")
    assert done.returncode == 0, done.output[-4000:]
    assert re.search(r"generation 1 \(.*\): 2 worker\(s\): localhost/0, 127\.0\.0\.1/0", done.output), done.output[
        -4000:
    ]
    sizes = _assert_every_batch_once(done.output, "localhost/0")
    assert sizes == [1] * (STEPS + 3) + [2] * (EPOCHS * STEPS - STEPS - 3), sizes
    assert set(_assert_every_batch_once(done.output, "127.0.0.1/0", first=(1, 4))) == {2}
    _assert_finished_like_one_process(done.output, 2, keras_reference)


def test_custom_loop_restores_the_commit_after_a_worker_raises():
    """A tf.function step with DistributedGradientTape and a TensorFlowState; the worker on 127.0.0.1 raises right
    after the commit of step 5. The survivors' next allreduce fails inside the tf.function (an OpError that
    hvd.elastic.run turns into HorovodInternalError), they restore step 5's commit and end like one process."""
    reference = _reference(LOOP, STEPS="12")
    done = run(
        [HVDPLUSRUN, "-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1", PY, LOOP],
        timeout=TIMEOUT,
        env=job_env(STEPS="12", RAISE="127.0.0.1/0:5"),
    )
    assert done.returncode == 0, done.output[-4000:]
    assert "worker 127.0.0.1/0 (rank 2 of generation 0) failed with exit code 1" in done.output, done.output[-4000:]
    steps = [(line["step"], line["size"]) for line in _lines(done.output, "localhost/0") if "step" in line]
    assert steps == [(s, 3) for s in range(1, 6)] + [(s, 2) for s in range(6, 13)], done.output[-4000:]
    finals = _finals(done.output)
    assert len(finals) == 2 and finals[0]["final"] == finals[1]["final"], finals
    assert finals[0]["final"] == pytest.approx(reference, abs=1e-6)


def test_a_custom_loop_traced_at_size_1_reduces_once_the_job_grows(tmp_path):
    """The tf.function step is traced while the job has one worker; after step 3 a second one joins. The traced
    step must still allreduce (in an elastic job the gradient reduction is traced even at size 1), or the new
    worker would wait for it forever; both end like one process."""
    reference = _reference(LOOP, STEPS="12")
    hosts, script = discovery_script(tmp_path, "localhost:1\n")
    done = run(
        [HVDPLUSRUN, "-np", "1", "--min-np", "1", "--host-discovery-script", str(script), PY, LOOP],
        timeout=TIMEOUT,
        env=job_env(STEPS="12", GROW=f"{hosts}:3"),
    )
    assert done.returncode == 0, done.output[-4000:]
    steps = [(line["step"], line["size"]) for line in _lines(done.output, "localhost/0") if "step" in line]
    # step 4's commit raises HostsUpdatedInterrupt before it is printed; the state keeps it (no restore)
    assert steps == [(s, 1) for s in range(1, 4)] + [(s, 2) for s in range(5, 13)], done.output[-4000:]
    finals = _finals(done.output)
    assert len(finals) == 2 and finals[0]["final"] == finals[1]["final"], finals
    assert finals[0]["final"] == pytest.approx(reference, abs=1e-6)


def test_the_elastic_keras_example_runs(tmp_path):
    """examples/keras_elastic.py as its docstring runs it, for one short epoch."""
    example = Path(__file__).resolve().parents[2] / "examples" / "keras_elastic.py"
    done = run(
        [HVDPLUSRUN, "-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1", PY, str(example), "--epochs", "1"],
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.output[-4000:]
    assert re.search(r"Final test accuracy: 0\.\d+ \(workers at the end: 2\)", done.output), done.output[-4000:]
