"""The host (numpy) and device (torch) buffer operations give the executor the same results.

The torch operations are what CUDA tensors go through on NCCL; here they run on CPU tensors, element for element
against the numpy ones the host path has always used."""

from __future__ import annotations

import numpy as np
import pytest

from hvdplus.common.data.buffer_ops import NUMPY_OPS

torch = pytest.importorskip("torch")

from hvdplus.torch.device_plane import TorchBufferOps  # noqa: E402

TORCH_OPS = TorchBufferOps("cpu")
_TORCH = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int16": torch.int16,
    "uint8": torch.uint8,
}


def both(values, dtype: str):
    """The same values as a numpy array and as a torch tensor."""
    array = np.asarray(values, dtype=dtype)
    return array, torch.from_numpy(array.copy()).to(_TORCH[dtype])


def as_numpy(buf) -> np.ndarray:
    return buf.numpy() if isinstance(buf, torch.Tensor) else buf


def test_pack_and_unpack_end_to_end():
    for ops, make in ((NUMPY_OPS, np.arange), (TORCH_OPS, lambda n: torch.arange(n, dtype=torch.float32))):
        sources = [make(3) * 1.0, make(1) * 1.0 + 10, make(4) * 1.0 + 20]
        packed = ops.empty((8,), sources[0])
        ops.pack(sources, packed)
        assert as_numpy(packed).tolist() == [0, 1, 2, 10, 20, 21, 22, 23]
        outputs = [ops.empty((ops.numel(s),), s) for s in sources]
        ops.unpack(packed * 2, outputs)
        assert [as_numpy(o).tolist() for o in outputs] == [[0, 2, 4], [20], [40, 42, 44, 46]]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "int16"])
@pytest.mark.parametrize("factor", [1.0, 0.5, 1 / 3, 2.0])
def test_scale_rounds_like_the_host(dtype, factor):
    host, device = both([0, 1, 5, -7, 100], dtype)
    NUMPY_OPS.scale(host, dtype, factor)
    TORCH_OPS.scale(device, dtype, factor)
    tolerance = 1e-3 if dtype == "float16" else 0
    np.testing.assert_allclose(as_numpy(device).astype(np.float64), host.astype(np.float64), rtol=tolerance)


def test_bfloat16_scale_matches_the_host_kernel():
    from hvdplus.common.data.halfops import bfloat16_to_float32

    values = torch.tensor([1.0, 3.0, -0.1, 1000.0], dtype=torch.bfloat16)
    host = values.view(torch.int16).numpy().view(np.uint16).copy()
    NUMPY_OPS.scale(host, "bfloat16", 1 / 3)
    device = values.clone()
    TORCH_OPS.scale(device, "bfloat16", 1 / 3)
    np.testing.assert_array_equal(device.float().numpy(), bfloat16_to_float32(host))


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_nan_positions_and_restore(dtype):
    host, device = both([1.0, np.nan, 3.0, np.nan], dtype)
    host_positions, device_positions = NUMPY_OPS.nan_positions(host, dtype), TORCH_OPS.nan_positions(device, dtype)
    assert as_numpy(device_positions).tolist() == host_positions.tolist() == [0, 1, 0, 1]
    assert device_positions.dtype == torch.uint8
    for ops, buf, positions in (
        (NUMPY_OPS, *both([5, 6, 7, 8], dtype)[:1], host_positions[::-1].copy()),
        (TORCH_OPS, both([5, 6, 7, 8], dtype)[1], device_positions.flip(0)),
    ):
        ops.restore_nan(buf, dtype, positions)
        assert np.isnan(as_numpy(buf).astype(np.float64)).tolist() == [True, False, True, False]


def test_memory_relations():
    for ops, whole in ((NUMPY_OPS, np.zeros(10, dtype=np.float32)), (TORCH_OPS, torch.zeros(10))):
        assert ops.same_start(whole, whole[:3]) and not ops.same_start(whole, whole[1:])
        assert ops.overlaps(whole[2:6], whole[5:]) and not ops.overlaps(whole[:5], whole[5:])
        other = ops.empty((10,), whole)
        assert not ops.overlaps(whole, other)


def test_zeros_copy_and_flat():
    for ops in (NUMPY_OPS, TORCH_OPS):
        zeros = ops.zeros((2, 3), "int64")
        assert tuple(zeros.shape) == (2, 3) and as_numpy(zeros).sum() == 0 and ops.numel(zeros) == 6
        ops.copy(zeros, zeros + 4)
        assert as_numpy(ops.flat(zeros)).tolist() == [4] * 6


def test_cpu_tensors_need_no_ready_event():
    assert TORCH_OPS.ready(torch.zeros(2)) is None and NUMPY_OPS.ready(np.zeros(2)) is None
