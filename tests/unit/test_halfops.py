"""bfloat16 conversion/reduction on uint16 storage and in-place scaling."""

import numpy as np
import pytest
import torch

from hvdplus.common.data.halfops import bfloat16_reducer, bfloat16_to_float32, float32_to_bfloat16, scale_inplace
from hvdplus.common.ops import ReduceOp


def _torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return (
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
    )


def _bf16(values) -> np.ndarray:
    return _torch_bf16_bits(np.asarray(values, dtype=np.float32))


def test_random_bit_patterns_match_torch():
    bits = np.random.default_rng(0).integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    ours, ref = float32_to_bfloat16(x), _torch_bf16_bits(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(ours[finite], ref[finite])
    assert np.isnan(bfloat16_to_float32(ours[~finite])).all()


def test_random_normal_values_match_torch():
    x = np.random.default_rng(1).standard_normal(10_000).astype(np.float32) * 1e3
    np.testing.assert_array_equal(float32_to_bfloat16(x), _torch_bf16_bits(x))


def test_ties_round_to_even_like_torch():
    # low 16 bits exactly 0x8000: halfway between two bfloat16 values, both parities of bit 16
    bits = np.array(
        [0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x00018000, 0x7F7F8000, 0x7F7E8000],
        dtype=np.uint32,
    )
    x = bits.view(np.float32)
    np.testing.assert_array_equal(float32_to_bfloat16(x), _torch_bf16_bits(x))
    assert float32_to_bfloat16(x)[0] == 0x3F80 and float32_to_bfloat16(x)[1] == 0x3F82


def test_specials():
    x = np.array([np.inf, -np.inf, 0.0, -0.0, np.finfo(np.float32).max], dtype=np.float32)
    np.testing.assert_array_equal(float32_to_bfloat16(x), _torch_bf16_bits(x))
    assert list(float32_to_bfloat16(x)[:2]) == [0x7F80, 0xFF80]


def test_nan_stays_nan():
    x = np.array([np.nan, -np.nan, np.float32(np.nan)], dtype=np.float32)
    x[2:] = np.array([0x7F800001], dtype=np.uint32).view(np.float32)  # payload that would round to inf
    out = float32_to_bfloat16(x)
    assert np.isnan(bfloat16_to_float32(out)).all()


def test_round_trip_is_exact_for_bfloat16_values():
    bits = np.arange(0, 2**16, dtype=np.uint16)
    widened = bfloat16_to_float32(bits)
    ok = ~np.isnan(widened)
    np.testing.assert_array_equal(float32_to_bfloat16(widened)[ok], bits[ok])


def test_widen_matches_torch():
    bits = _bf16([1.5, -2.25, 3e38, 1e-40])
    expected = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(bfloat16_to_float32(bits), expected)


def test_out_parameter_is_filled():
    out = np.zeros(3, dtype=np.uint16)
    result = float32_to_bfloat16(np.array([1.0, 2.0, -1.0], dtype=np.float32), out=out)
    assert result is out
    np.testing.assert_array_equal(out, _bf16([1.0, 2.0, -1.0]))


def test_scale_float32():
    buf = np.array([1.0, -2.0, 3.0], dtype=np.float32)
    scale_inplace(buf, "float32", 0.5)
    np.testing.assert_array_equal(buf, np.array([0.5, -1.0, 1.5], dtype=np.float32))


def test_scale_float16():
    buf = np.array([1.0, -2.0, 4.0], dtype=np.float16)
    scale_inplace(buf, "float16", 0.25)
    assert buf.dtype == np.float16
    np.testing.assert_array_equal(buf, np.array([0.25, -0.5, 1.0], dtype=np.float16))


def test_scale_float16_with_large_factor():
    buf = np.array([1e-3], dtype=np.float16)
    with np.errstate(over="ignore"):
        scale_inplace(buf, "float16", 1e5)
    assert np.isfinite(buf).all()
    assert buf[0] == pytest.approx(100.0, rel=1e-2)


def test_scale_bfloat16_matches_torch():
    values = np.array([1.0, -3.0, 0.1, 250.0], dtype=np.float32)
    buf = _bf16(values)
    scale_inplace(buf, "bfloat16", 1 / 3)
    assert buf.dtype == np.uint16
    expected = (torch.from_numpy(values).to(torch.bfloat16).float() * np.float32(1 / 3)).to(torch.bfloat16)
    np.testing.assert_array_equal(buf, expected.view(torch.int16).numpy().view(np.uint16))


def test_scale_int32_truncates():
    buf = np.array([3, -3, 10, 7], dtype=np.int32)
    scale_inplace(buf, "int32", 0.5)
    assert buf.dtype == np.int32
    np.testing.assert_array_equal(buf, [1, -1, 5, 3])


def test_scale_by_one_is_a_no_op():
    buf = np.array([np.nan, 1.0], dtype=np.float32)
    before = buf.copy()
    scale_inplace(buf, "float32", 1.0)
    np.testing.assert_array_equal(buf.view(np.uint32), before.view(np.uint32))


@pytest.mark.parametrize(
    "op,combine",
    [(ReduceOp.SUM, np.add), (ReduceOp.MIN, np.minimum), (ReduceOp.MAX, np.maximum), (ReduceOp.PRODUCT, np.multiply)],
)
def test_bfloat16_reducer(op, combine):
    a = np.array([1.0, -2.0, 3.5, 0.5], dtype=np.float32)
    b = np.array([2.0, 5.0, -1.0, 0.25], dtype=np.float32)
    inbuf, inout = _bf16(a), _bf16(b)
    bfloat16_reducer(op)(memoryview(inbuf), memoryview(inout), None)
    np.testing.assert_array_equal(inout, _bf16(combine(a, b)))
    np.testing.assert_array_equal(inbuf, _bf16(a))  # input untouched


def test_bfloat16_reducer_rounds_the_sum():
    a, b = _bf16([1.0]), _bf16([2.0**-9])  # 1 + 2^-9 is not representable; rounds to even (1.0)
    bfloat16_reducer(ReduceOp.SUM)(memoryview(a), memoryview(b), None)
    assert b[0] == _bf16([1.0])[0]
