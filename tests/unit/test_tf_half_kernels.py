"""TensorFlow's float16/bfloat16 kernels, handed to the core, give the numpy reference results bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from hvdplus.common.data import halfops
from hvdplus.common.ops import ReduceOp

tf_kernels = pytest.importorskip("hvdplus.tensorflow._half_kernels")
reference = pytest.importorskip("tests.unit.test_half_kernels")  # its numpy references and bit comparison


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(halfops, "_fast_combine", {})
    monkeypatch.setattr(halfops, "_fast_scale", {})
    tf_kernels.register()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", reference.OPS, ids=lambda op: op.name)
def test_registered_reducer_matches_numpy_bit_for_bit(dtype: str, op: ReduceOp) -> None:
    rng = np.random.default_rng(7)
    values = rng.standard_normal((2, 10_001)).astype(np.float32) * 100
    values[0, :3] = [np.nan, np.inf, -0.0]
    incoming, inout = reference._storage(values[0], dtype), reference._storage(values[1], dtype)
    expected = reference._numpy_reference(dtype, op, incoming, inout)
    halfops.half_reducer(dtype, op)(memoryview(incoming), memoryview(inout), None)
    reference._assert_same_bits(inout, expected, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_registered_scale_matches_numpy_bit_for_bit(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = reference._storage(np.random.default_rng(3).standard_normal((7, 1429)).astype(np.float32) * 1000, dtype)
    fast = buf.copy()
    halfops.scale_inplace(fast, dtype, 1 / 3)
    monkeypatch.delitem(halfops._fast_scale, dtype)
    expected = buf.copy()
    halfops.scale_inplace(expected, dtype, 1 / 3)
    reference._assert_same_bits(fast, expected, dtype)
