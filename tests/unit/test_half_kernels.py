"""torch's float16/bfloat16 kernels, handed to the core, give the numpy reference results bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from hvdplus.common.data import halfops
from hvdplus.common.ops import ReduceOp

torch_kernels = pytest.importorskip("hvdplus.torch._half_kernels")
OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


def _storage(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(np.float16) if dtype == "float16" else halfops.float32_to_bfloat16(values)


def _assert_same_bits(got: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    """Equal bits, except that any NaN matches any NaN (payloads and signs of NaN may differ)."""
    as_float = (lambda a: a.astype(np.float32)) if dtype == "float16" else halfops.bfloat16_to_float32
    nan = np.isnan(as_float(expected))
    np.testing.assert_array_equal(np.isnan(as_float(got)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])


def _numpy_reference(dtype: str, op: ReduceOp, incoming: np.ndarray, inout: np.ndarray) -> np.ndarray:
    out = inout.copy()
    if dtype == "bfloat16":
        halfops.bfloat16_reducer(op)(memoryview(incoming), memoryview(out), None)
    else:
        with np.errstate(over="ignore"):  # products overflow float16 to inf on purpose
            out[...] = halfops._COMBINE[op](incoming.astype(np.float32), out.astype(np.float32))
    return out


@pytest.fixture(autouse=True)
def registered() -> None:
    torch_kernels.register()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_registered_reducer_matches_numpy_bit_for_bit(dtype: str, op: ReduceOp) -> None:
    rng = np.random.default_rng(7)
    values = rng.standard_normal((2, 10_001)).astype(np.float32) * 100
    values[0, :3] = [np.nan, np.inf, -0.0]
    incoming, inout = _storage(values[0], dtype), _storage(values[1], dtype)
    expected = _numpy_reference(dtype, op, incoming, inout)
    assert halfops.has_fast_kernels(dtype, op)
    halfops.half_reducer(dtype, op)(memoryview(incoming), memoryview(inout), None)
    _assert_same_bits(inout, expected, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_registered_scale_matches_numpy_bit_for_bit(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = _storage(np.random.default_rng(3).standard_normal(10_001).astype(np.float32) * 1000, dtype)
    fast = buf.copy()
    halfops.scale_inplace(fast, dtype, 1 / 3)
    monkeypatch.delitem(halfops._fast_scale, dtype)
    reference = buf.copy()
    halfops.scale_inplace(reference, dtype, 1 / 3)
    _assert_same_bits(fast, reference, dtype)


def test_float16_without_a_kernel_is_left_to_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(halfops._fast_combine, ("float16", ReduceOp.SUM))
    assert not halfops.has_fast_kernels("float16", ReduceOp.SUM)
    with pytest.raises(ValueError, match="MPI reduces float16 itself"):
        halfops.half_reducer("float16", ReduceOp.SUM)
