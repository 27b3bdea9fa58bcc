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
        with pytest.raises(ValueError, match="fused"):
            keras.layers.BatchNormalization(fused=False)
        assert not hasattr(keras.Variable(1.0), "ref")
        with pytest.raises(AttributeError):
            import tensorflow as tf; tf.keras.losses.mean_squared_error
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


@pytest.mark.timeout(150)
def test_horovod_alias_accepts_keras2_layers_variables_and_losses():
    """BatchNormalization(fused=...), variable.ref(), tf.keras.losses.mean_squared_error and a Session fetching a
    Keras variable, as Horovod's test_tensorflow.py and test_tensorflow2_keras.py use them; each warns once,
    pointing at the script."""
    out = _python(
        """
        import warnings
        import numpy as np
        import keras, tensorflow as tf
        import horovod.tensorflow as hvd
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plain = tf.keras.layers.BatchNormalization(axis=1, fused=False)
            assert plain.axis == 1 and keras.layers.BatchNormalization(1).axis == 1
            assert plain(np.ones([4, 2], np.float32), training=True).shape == (4, 2)
            assert hvd.SyncBatchNormalization(fused=False, axis=1).axis == 1
            layer = keras.layers.Dense(2)
            layer.build((None, 3))
            refs = {v.ref(): v for v in layer.weights}
            assert [refs[v.ref()] is v for v in layer.weights] == [True, True]
            assert layer.kernel.ref().deref() is layer.kernel
            assert hvd.refs_to_vars(hvd.vars_to_refs([layer.bias])) == [layer.bias]
            assert tf.keras.losses.mean_squared_error is keras.losses.mean_squared_error
            assert tf.keras.losses.MSE is not None  # Keras 3's own names are untouched
            try:
                tf.keras.losses.no_such_loss
            except AttributeError as error:
                assert "no_such_loss" in str(error)
            else:
                raise AssertionError("tf.keras.losses.no_such_loss did not raise")
            graph = tf.Graph()
            with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
                norm = keras.layers.BatchNormalization()
                norm(tf.ones([2, 3]), training=True)
                session.run(tf.compat.v1.global_variables_initializer())
                assert session.run(norm.moving_variance).tolist() == [1.0] * 3
                assert [v.tolist() for v in session.run([norm.gamma, norm.beta])] == [[1.0] * 3, [0.0] * 3]
        for warning in caught:
            if "Keras 2" in str(warning.message):
                print(warning.category.__name__, warning.filename, str(warning.message))
    """,
        ALIAS,
    )
    lines = out.splitlines()
    assert len(lines) == 4 and all(line.startswith("Keras2IdiomWarning <string> ") for line in lines), out
    idioms = ("BatchNormalization(fused=...)", "variable.ref()", "tf.keras.losses.mean_squared_error")
    for idiom in (*idioms, "session.run(keras_variable)"):
        assert any(f"{idiom} is Keras 2" in line for line in lines), (idiom, out)
