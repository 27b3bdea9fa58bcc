"""Unmodified Horovod TensorFlow and Keras scripts through hvdplusrun's `horovod` alias, 2 ranks on this machine.

Horovod's own TF2 synthetic benchmark (a verbatim copy) and a Keras 2-era script: both use Keras 2 idioms
that Keras 3 rejects, which the alias accepts with one warning each (hvdplus.tensorflow.keras2_compat)."""

from __future__ import annotations

import re
import sys

import pytest

from tests.integration.conftest import HVDPLUSRUN, SCRIPTS, job_env, run

PY = sys.executable


@pytest.fixture(autouse=True)
def _tensorflow():
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras", minversion="3")


@pytest.mark.timeout(240)
def test_horovods_tensorflow2_synthetic_benchmark_runs_unmodified():
    done = run(
        [
            HVDPLUSRUN,
            "-np",
            "2",
            PY,
            str(SCRIPTS / "tensorflow2_synthetic_benchmark.py"),
            "--model",
            "MobileNetV2",
            "--batch-size",
            "8",
            "--no-cuda",
            "--num-warmup-batches",
            "1",
            "--num-batches-per-iter",
            "1",
            "--num-iters",
            "2",
        ],
        timeout=200,
        env=job_env(TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert done.returncode == 0, done.output[-5000:]
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", done.output), done.output[-5000:]
    # opt.variables() (Keras 2) warned about once per rank, naming the Keras 3 form
    assert done.output.count("Keras2IdiomWarning: optimizer.variables() is Keras 2") == 2, done.output[-5000:]


@pytest.mark.timeout(240)
def test_keras2_era_horovod_script_runs_unmodified():
    done = run(
        [HVDPLUSRUN, "-np", "2", PY, str(SCRIPTS / "keras2_horovod_script.py")],
        timeout=200,
        env=job_env(TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert done.returncode == 0, done.output[-5000:]
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: lr 0\.20, loss [\d.]+, weights agree: True", done.output), done.output[-5000:]
    for idiom in ("the optimizer argument lr=", "model.compile(experimental_run_tf_function=...)", "optimizer.lr"):
        assert done.output.count(f"Keras2IdiomWarning: {idiom} is Keras 2") == 2, (idiom, done.output[-5000:])
