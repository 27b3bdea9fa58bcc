"""The PyTorch examples run as real 2-rank jobs with tiny settings, under mpirun and under Gloo."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.parallel.jobs import ROOT, mpirun, run_job, worker_env

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("tqdm")
TRAIN = "examples/pytorch_train.py"


def _need_mpi() -> None:
    pytest.importorskip("mpi4py")
    if mpirun() is None:
        pytest.skip("no mpirun found (pip install 'hvdplus[mpi]')")


def _final_accuracy(output: str) -> float:
    found = re.findall(r"Final test accuracy: ([\d.]+) \(2 ranks\)", output)
    assert len(found) == 1, output[-5000:]  # printed by rank 0 only
    return float(found[0])


@pytest.mark.parallel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine,np", [("mpi", 2), ("mpi", 3), ("gloo", 2), ("gloo", 3)])
def test_the_demo_runs_every_collective_without_a_warning(engine, np):
    """The README's demo script: every collective prints its result on every rank, and no rank prints a warning
    (Gloo used to get torch's "NumPy array is not writable" from the pickled object collectives)."""
    if engine == "mpi":
        _need_mpi()
    code, output = run_job(engine, np, ["examples/pytorch_collectives.py"])
    assert code == 0, output[-5000:]
    assert output.count("allgather_object: [") == np and output.count("mismatched shapes raise") == np, output
    assert "Warning" not in output and "warnings.warn" not in output, output


@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_train_learns_digits_and_resumes_from_its_checkpoint(tmp_path):
    _need_mpi()
    checkpoints = ["--checkpoint-dir", str(tmp_path)]
    code, output = run_job("mpi", 2, [TRAIN, "--epochs", "3", *checkpoints])
    assert code == 0, output[-5000:]
    assert "Epoch 3:" in output and "Resuming" not in output
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"checkpoint-{e}.pt" for e in (1, 2, 3)]

    summary = tmp_path / "summary.json"
    code, output = run_job("mpi", 2, [TRAIN, "--epochs", "5", *checkpoints, "--summary-json", str(summary)])
    assert code == 0, output[-5000:]
    assert output.count("Resuming from checkpoint of epoch 3") == 1
    assert "Epoch 3:" not in output and "Epoch 4:" in output and "Epoch 5:" in output
    # Measured 0.976 after 5 epochs on 2 ranks (the run is deterministic); a model that did not learn scores ~0.1.
    assert _final_accuracy(output) > 0.9, output[-5000:]
    found = json.loads(summary.read_text())  # written by rank 0 alone
    assert found["test_accuracy"] == pytest.approx(_final_accuracy(output), abs=5e-5)
    assert (found["ranks"], found["epochs"], found["epochs_trained"]) == (2, 5, 2)
    assert (found["global_batch_size"], found["learning_rate"]) == (64, pytest.approx(0.04))
    assert found["images_per_second"] > 0 and found["train_seconds"] > 0


@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_train_with_fp16_accumulation_and_sync_bn_over_gloo(tmp_path):
    code, output = run_job(
        "gloo",
        2,
        [
            TRAIN,
            "--epochs",
            "1",
            "--fp16",
            "--batches-per-allreduce",
            "2",
            "--sync-bn",
            "--checkpoint-dir",
            str(tmp_path),
        ],
    )
    assert code == 0, output[-5000:]
    assert _final_accuracy(output) > 0.2, output[-5000:]  # one short epoch: well above chance (0.1)
    assert (tmp_path / "checkpoint-1.pt").exists()


def _one_process(argv: list[str]) -> str:
    """Run `python argv` as one process with no launcher, as scripts/demo.sh does for its comparison; its output."""
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=worker_env({"TF_ENABLE_ONEDNN_OPTS": "0"}),  # as demo.sh: else TensorFlow's oneDNN notice
        capture_output=True,
        text=True,
        timeout=100,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return output


@pytest.mark.timeout(150)
def test_train_examples_write_the_summary_json_that_the_demo_compares(tmp_path):
    """scripts/demo.sh's single-process runs (one short epoch here): each example writes --summary-json with the
    demo's global batch and learning rate, prints no warning, and scripts/demo_summary.py reads the files."""
    pytest.importorskip("tensorflow")
    same_step = ["--epochs", "1", "--batch-size", "64", "--lr", "0.04"]
    runs = {
        "pytorch": [TRAIN, "--checkpoint-dir", str(tmp_path / "pytorch")],
        "keras": ["examples/keras_train.py", "--checkpoint", str(tmp_path / "keras" / "best.keras")],
    }
    for name, argv in runs.items():
        output = _one_process([*argv, *same_step, "--summary-json", str(tmp_path / f"{name}-1.json")])
        assert "Final test accuracy" in output and "(1 rank)" in output, output[-5000:]
        assert "Warning" not in output and "warn" not in output and "I0000" not in output, output
        found = json.loads((tmp_path / f"{name}-1.json").read_text())
        assert (found["ranks"], found["epochs"], found["global_batch_size"]) == (1, 1, 64), found
        assert found["learning_rate"] == pytest.approx(0.04) and found["images_per_second"] > 0
        assert 0.1 < found["test_accuracy"] <= 1  # measured 0.246 (PyTorch), 0.68 (Keras) after one epoch
        shutil.copy(tmp_path / f"{name}-1.json", tmp_path / f"{name}-2.json")  # stands in for the 2-rank run
    summary = subprocess.run(
        [sys.executable, "scripts/demo_summary.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert summary.returncode == 0, summary.stderr
    assert re.search(r"^PyTorch +test accuracy 0\.\d{3}, +\d+ images/s", summary.stdout, re.M), summary.stdout
    assert re.search(r"^Keras +test accuracy 0\.\d{3}, +\d+ images/s", summary.stdout, re.M), summary.stdout


@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_synthetic_benchmark_prints_horovods_summary():
    _need_mpi()
    code, output = run_job(
        "mpi",
        2,
        [
            "examples/pytorch_synthetic_benchmark.py",
            "--batch-size",
            "8",
            "--num-warmup-batches",
            "1",
            "--num-batches-per-iter",
            "2",
            "--num-iters",
            "2",
            "--fp16-allreduce",
        ],
    )
    assert code == 0, output[-5000:]
    per_cpu = re.findall(r"Img/sec per CPU: ([\d.]+) \+-([\d.]+)", output)
    total = re.findall(r"Total img/sec on 2 CPU\(s\): ([\d.]+) \+-([\d.]+)", output)
    assert len(per_cpu) == 1 and len(total) == 1, output[-5000:]
    assert float(per_cpu[0][0]) > 0
    # Both figures are printed to one decimal: doubling the rounded per-CPU figure can be off by 0.1, and
    # the total's own rounding adds up to 0.05, so the two agree to within 0.15.
    assert float(total[0][0]) == pytest.approx(2 * float(per_cpu[0][0]), abs=0.16)


@pytest.mark.parallel
@pytest.mark.timeout(200)
def test_zero_example_halves_the_state_and_learns_as_distributed_optimizer_does():
    _need_mpi()
    found = {}
    for flag in ("--zero", "--offload", None):
        code, output = run_job(
            "mpi", 2, ["examples/pytorch_zero.py", "--epochs", "3", *([flag] if flag else [])], timeout=150
        )
        assert code == 0, output[-5000:]
        lines = re.findall(
            r"rank (\d): (\w+), \d+ parameters, optimizer state (\d+) KiB on this rank \((\w+)\), "
            r"test accuracy ([\d.]+)",
            output,
        )
        assert len(lines) == 2, output[-3000:]
        found[flag] = lines
    zero_state, full_state = int(found["--zero"][0][2]), int(found[None][0][2])
    assert abs(zero_state - full_state / 2) <= 1  # each of 2 ranks holds half of AdamW's state
    assert float(found["--zero"][0][4]) == pytest.approx(float(found[None][0][4]), abs=0.02)
    # Offloaded: the same half, on the host (the CPU here, so only the values say it stepped the host copy)
    assert found["--offload"][0][1:4] == (found["--zero"][0][1], found["--zero"][0][2], "cpu")
    assert float(found["--offload"][0][4]) == pytest.approx(float(found["--zero"][0][4]), abs=1e-3)
    assert float(found["--zero"][0][4]) > 0.8


@pytest.mark.parallel
@pytest.mark.timeout(200)
def test_zero3_example_trains_a_meta_built_gpt_and_its_checkpoint_loads_into_a_plain_model():
    _need_mpi()
    code, output = run_job("mpi", 2, ["examples/pytorch_zero3.py", "--steps", "60"], timeout=150)
    assert code == 0, output[-5000:]
    held = re.findall(r"rank (\d): holds (\d+) of the model's (\d+) parameter bytes", output)
    assert sorted(rank for rank, _, _ in held) == ["0", "1"], output[-3000:]
    assert all(abs(int(mine) - int(total) / 2) <= 8 for _, mine, total in held)  # half each (+- an element)
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", output)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, losses  # it learns (from ~4.4, uniform over ~90)
    result = json.loads(re.findall(r"^.*(\{\"sharded_eval_loss.*\}).*$", output, re.M)[0])
    # the plain model computes in another order than the sharded one (no gather), the same float32 values
    assert result["plain_eval_loss"] == pytest.approx(result["sharded_eval_loss"], abs=1e-4)


def _pipeline_run(np: int, flags: list[str]) -> dict:
    """Run the pipeline example with --check on `np` ranks; return what rank 0 printed."""
    _need_mpi()
    code, output = run_job("mpi", np, ["examples/pytorch_pipeline.py", "--check", "--epochs", "2", *flags], timeout=100)
    assert code == 0, output[-5000:]
    epochs = re.findall(r"epoch (\d+): loss ([\d.]+), (\d+) samples/s", output)
    final = re.findall(r"final loss ([\d.]+) \(unpipelined ([\d.]+), difference ([\d.e+-]+)\)", output)
    accuracy = re.findall(r"test accuracy ([\d.]+)", output)
    assert [int(e[0]) for e in epochs] == [1, 2] and len(final) == 1 and len(accuracy) == 1, output[-5000:]
    return {
        "losses": [float(e[1]) for e in epochs],
        "throughputs": [int(e[2]) for e in epochs],
        "final": [float(v) for v in final[0]],
        "accuracy": float(accuracy[0]),
        "output": output,
    }


def _check_pipeline_run(found: dict) -> None:
    pipelined, unpipelined, difference = found["final"]
    assert pipelined == pytest.approx(unpipelined, rel=1e-4), found["output"][-3000:]
    assert difference <= 1e-4 * unpipelined  # measured 6e-8 on 0.535: float32 sums in another order
    assert pipelined == pytest.approx(found["losses"][-1], abs=5e-5)  # the last epoch's loss, to 4 decimals
    assert found["losses"][-1] < 0.5 * found["losses"][0]  # measured 1.62 -> 0.54 over 2 epochs
    assert all(t > 0 for t in found["throughputs"])
    assert found["accuracy"] > 0.85  # measured 0.911 after 2 epochs; chance is 0.1


@pytest.mark.parallel
@pytest.mark.timeout(150)
def test_pipeline_example_on_two_stages_matches_the_unpipelined_model():
    found = _pipeline_run(2, [])
    assert "2 ranks: 1 pipeline(s) x 2 stages, schedule 1f1b" in found["output"]
    _check_pipeline_run(found)


@pytest.mark.parallel
@pytest.mark.timeout(150)
def test_pipeline_example_with_two_zero_bubble_v_replicas_matches_the_unpipelined_model():
    found = _pipeline_run(4, ["--schedule", "zero-bubble", "--virtual-stages", "2"])
    assert "4 ranks: 2 pipeline(s) x 2 stages, schedule zero-bubble, 2 chunk(s) per rank" in found["output"]
    _check_pipeline_run(found)
