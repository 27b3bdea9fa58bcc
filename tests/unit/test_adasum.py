"""Adasum's pairwise maths and recursive-doubling order, against the formula written out directly."""

import numpy as np
import pytest

from hvdplus.common.data import halfops
from hvdplus.common.data.adasum import adasum_allreduce, check_adasum_size, combine, partners
from hvdplus.common.engines.local import LocalEngine
from hvdplus.common.engines.waited import Waited


def formula(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Horovod's Adasum of two vectors: (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    dot = a @ b
    return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b


def pair(a: np.ndarray, b: np.ndarray, counts=None, dtype="float64") -> np.ndarray:
    out = np.empty_like(a)
    combine(a, b, counts or [a.size], dtype, out)
    return out


def test_two_vectors_match_the_formula():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    np.testing.assert_allclose(pair(a, b), formula(a, b), rtol=1e-12)


def test_orthogonal_vectors_add_and_parallel_ones_average():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    np.testing.assert_array_equal(pair(a, b), [1.0, 2.0])
    np.testing.assert_array_equal(pair(a * 3, a * 3), a * 3)


def test_zero_vector_contributes_nothing():
    b = np.array([1.0, -2.0, 3.0])
    np.testing.assert_array_equal(pair(np.zeros(3), b), b)


def test_four_vectors_pair_level_by_level():
    # Level 1: partners rank ^ 1, i.e. (0, 1) and (2, 3); level 2: rank ^ 2 combines those two results.
    rng = np.random.default_rng(1)
    g = [rng.standard_normal(20) for _ in range(4)]
    assert [partners(r, 4) for r in range(4)] == [[1, 2], [0, 3], [3, 0], [2, 1]]
    want = formula(formula(g[0], g[1]), formula(g[2], g[3]))
    np.testing.assert_allclose(pair(pair(g[0], g[1]), pair(g[2], g[3])), want, rtol=1e-12)
    assert not np.allclose(want, formula(formula(g[0], g[2]), formula(g[1], g[3])))  # the order matters


def test_each_tensor_of_a_fused_buffer_keeps_its_own_dot_and_norms():
    rng = np.random.default_rng(2)
    a1, a2, b1, b2 = (rng.standard_normal(n) for n in (7, 5, 7, 5))
    fused = pair(np.concatenate([a1, a2]), np.concatenate([b1, b2]), counts=[7, 5])
    np.testing.assert_allclose(fused, np.concatenate([formula(a1, b1), formula(a2, b2)]), rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_narrow_dtypes_are_widened(dtype):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    if dtype == "bfloat16":
        a_bits, b_bits = halfops.float32_to_bfloat16(a), halfops.float32_to_bfloat16(b)
        bits = pair(a_bits, b_bits, dtype=dtype)
        assert bits.dtype == np.uint16
        got = halfops.bfloat16_to_float32(bits)
        want = formula(halfops.bfloat16_to_float32(a_bits), halfops.bfloat16_to_float32(b_bits))
        rtol = 2**-8  # one bfloat16 rounding of the result (8 significant bits)
    else:
        a, b = a.astype(dtype), b.astype(dtype)
        got, want = pair(a, b, dtype=dtype), formula(a, b)
        rtol = {"float16": 2**-11, "float32": 2**-24}[dtype]  # one rounding of the float64 result
        assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_parallel_vectors_near_the_smallest_normal_average(dtype):
    # Horovod's test_stability: parallel gradients of magnitude ~finfo.tiny average, not add; their squared norms
    # (~1e-76 for float32) are tiny but nonzero in float64, above Horovod's sqrt(DBL_MIN) bound.
    rng = np.random.default_rng(4)
    a = (np.finfo(dtype).tiny * rng.uniform(1, 2, 1024) * rng.choice([-1, 1], 1024)).astype(dtype)
    got = pair(a, a * 2, dtype=dtype)
    np.testing.assert_allclose(got.astype(np.float64), a.astype(np.float64) * 1.5, rtol=np.finfo(dtype).eps)


@pytest.mark.parametrize("size", [0, 3, 6, 12])
def test_non_power_of_two_sizes_are_rejected_with_the_size(size):
    with pytest.raises(ValueError, match=f"power-of-two number of ranks in the process set, got {size}"):
        check_adasum_size(size)


def test_one_rank_is_the_identity():
    buffer = np.array([1.0, 2.0, 3.0])
    adasum_allreduce(Waited(LocalEngine()), "world", 0, 1, buffer, [3], "float64")
    np.testing.assert_array_equal(buffer, [1.0, 2.0, 3.0])
    assert partners(0, 1) == []
