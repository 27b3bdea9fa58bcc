"""SyncBatchNorm on uneven per-rank batches equals torch.nn.BatchNorm on the concatenated batch in one process.

Written to pass at any world size: rank r holds 2 + r samples (so no two ranks hold the same number)."""

from __future__ import annotations

import pytest
import torch

# Statistics are combined in float64 and the elementwise maths runs in float32, like torch's own kernels:
# outputs, running stats and gradients differ from the reference by float32 rounding of O(1) values
# (a few ulps, ~1e-6); 1e-5 leaves margin yet catches any per-rank (unsynchronized) statistic, which is
# off by O(0.1) on these random inputs.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def rows(rank: int) -> slice:
    start = sum(2 + r for r in range(rank))
    return slice(start, start + 2 + rank)


def full_batch(size: int, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated inputs of every rank and fixed random output weights (the loss is sum(w * y))."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(2 + r for r in range(size))
    x = torch.randn((total,) + shape, generator=generator) * 3 + 1
    return x, torch.randn((total,) + shape, generator=generator)


@pytest.mark.parametrize(
    "shape,reference_class",
    [((3,), torch.nn.BatchNorm1d), ((3, 4), torch.nn.BatchNorm1d), ((3, 2, 2), torch.nn.BatchNorm2d)],
)
def test_matches_batch_norm_on_the_concatenated_batch(hvd, shape, reference_class):
    x, w = full_batch(hvd.size(), shape, seed=len(shape))
    reference, synced = reference_class(3, momentum=0.3), hvd.SyncBatchNorm(3, momentum=0.3)
    for module in (reference, synced):
        with torch.no_grad():
            module.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
            module.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    x_all = x.clone().requires_grad_()
    for _ in range(2):  # twice: the running statistics accumulate
        y_all = reference(x_all)
    (y_all * w).sum().backward()

    mine = x[rows(hvd.rank())].clone().requires_grad_()
    for _ in range(2):
        y = synced(mine)
    (y * w[rows(hvd.rank())]).sum().backward()

    torch.testing.assert_close(y, y_all[rows(hvd.rank())].detach(), **TOLERANCE)
    torch.testing.assert_close(mine.grad, x_all.grad[rows(hvd.rank())], **TOLERANCE)
    torch.testing.assert_close(synced.running_mean, reference.running_mean, **TOLERANCE)
    torch.testing.assert_close(synced.running_var, reference.running_var, **TOLERANCE)
    assert int(synced.num_batches_tracked) == 2
    # Weight and bias gradients are per-rank sums: over all ranks they add up to the full-batch gradient.
    # (The two forward passes each added to the graph only through the last output, as in the reference.)
    for part in ("weight", "bias"):
        got = hvd.allreduce(getattr(synced, part).grad, op=hvd.Sum, name=f"sbn.grad.{len(shape)}.{part}")
        torch.testing.assert_close(got, getattr(reference, part).grad, **TOLERANCE)

    synced.eval()
    reference.eval()  # eval uses the (synchronized) running statistics, no collective
    torch.testing.assert_close(synced(mine.detach()), reference(x_all.detach())[rows(hvd.rank())], **TOLERANCE)


def test_no_affine_and_cumulative_average(hvd):
    x, w = full_batch(hvd.size(), (2,), seed=5)
    reference = torch.nn.BatchNorm1d(2, affine=False, momentum=None)
    synced = hvd.SyncBatchNorm(2, affine=False, momentum=None)
    x_all = x.clone().requires_grad_()
    (reference(x_all) * w).sum().backward()
    mine = x[rows(hvd.rank())].clone().requires_grad_()
    (synced(mine) * w[rows(hvd.rank())]).sum().backward()
    torch.testing.assert_close(mine.grad, x_all.grad[rows(hvd.rank())], **TOLERANCE)
    torch.testing.assert_close(synced.running_var, reference.running_var, **TOLERANCE)


def test_is_a_batch_norm_and_rejects_1d_input(hvd):
    synced = hvd.SyncBatchNorm(4)
    assert isinstance(synced, torch.nn.modules.batchnorm._BatchNorm)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        synced(torch.ones(4))
