"""Keras 2 idioms on Keras 3 (hvdplus.tensorflow.keras2_compat): on through the `horovod` alias, off for hvdplus.

Each check runs in a fresh interpreter: the compatibility patches are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras", minversion="3")
ROOT = Path(__file__).resolve().parents[2]
ALIAS = ROOT / "hvdplus" / "runner" / "horovod_alias"


def _python(code: str, *path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (*path, ROOT)), "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(150)
def test_hvdplus_imports_leave_keras_untouched():
    _python("""
        import pytest, keras
        import hvdplus.tensorflow, hvdplus.keras, hvdplus.tensorflow.keras
        from hvdplus.tensorflow import keras2_compat
        assert not keras2_compat.enabled()
        with pytest.raises(ValueError, match="not recognized"):
            keras.optimizers.SGD(lr=0.1)
        optimizer = keras.optimizers.SGD(0.1)
        assert type(optimizer.variables) is list and not hasattr(optimizer, "lr")
        with pytest.raises(TypeError, match="experimental_run_tf_function"):
            keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)]).compile(experimental_run_tf_function=False)
    """)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("module", ["horovod.tensorflow", "horovod.keras", "horovod.tensorflow.keras"])
def test_horovod_alias_accepts_keras2_idioms_and_warns_once_each(module):
    out = _python(
        f"""
        import warnings
        import keras, tensorflow as tf
        import {module} as hvd
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = keras.optimizers.Adam(lr=0.5)
            assert float(optimizer.learning_rate) == 0.5 and float(optimizer.lr) == 0.5
            optimizer.lr = 0.25
            assert float(optimizer.learning_rate) == 0.25
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
            model.compile(optimizer=optimizer, loss="mse", experimental_run_tf_function=False)
            model.fit(tf.ones([4, 2]), tf.ones([4, 1]), verbose=0)
            assert optimizer.variables() == optimizer.variables and len(optimizer.variables()) == 6
            plain = tf.optimizers.SGD(0.01, momentum=0.9)
            plain.build(model.trainable_variables)
            assert len(plain.variables()) == 4  # iterations, learning rate, a momentum per variable
            scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(lr=0.1))
            scaled.build(model.trainable_variables)
            assert scaled.variables() == scaled.variables
            keras.optimizers.SGD(lr=0.1)
        for warning in caught:
            if "Keras 2" in str(warning.message):
                print(warning.category.__name__, warning.filename, str(warning.message))
    """,
        ALIAS,
    )
    lines = out.splitlines()
    assert len(lines) == 4, out  # one per idiom, however often it is used
    assert all(line.startswith("Keras2IdiomWarning <string> ") for line in lines), out  # pointing at the script
    for idiom, keras3 in (
        ("the optimizer argument lr=", "learning_rate="),
        ("optimizer.lr", "optimizer.learning_rate"),
        ("model.compile(experimental_run_tf_function=...)", "leave it out"),
        ("optimizer.variables()", "optimizer.variables (a list property)"),
    ):
        assert any(f"{idiom} is Keras 2" in line and f"Keras 3: {keras3}" in line for line in lines), (idiom, out)
