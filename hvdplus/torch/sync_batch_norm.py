"""horovod.torch's SyncBatchNorm: batch statistics over the samples of every rank, on any device.

Forward allgathers each rank's (count, mean, M2) per channel and combines them exactly (Chan et al.'s
parallel variance), so ranks may hold different numbers of samples, even none. Backward allreduces the
two per-channel sums the input gradient needs; weight and bias gradients stay local, and
DistributedOptimizer averages them like any other gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.ops import ReduceOp
from hvdplus.torch.mpi_ops import allgather_async, allreduce_async, synchronize

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover the whole batch of every rank in `process_set`.

    Collective in training mode: every rank in the process set must call forward (and backward) together."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize with global batch statistics in training, with the running ones in eval."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or self.running_mean is None
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not batch_stats or self.process_set.size() == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats, factor, self.eps)
        result: torch.Tensor = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, self.process_set
        )
        return result


def _channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (N * prod(*), C): one row per sample and position."""
    return tensor.transpose(0, 1).reshape(tensor.shape[1], -1).t()


def _compute_dtype(input: torch.Tensor) -> torch.dtype:
    """Elementwise work runs in float32 for half inputs, else in the input's dtype (statistics in float64)."""
    return torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype


def _per_channel(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (C,) vector shaped to broadcast over (N, C, *)."""
    return values.view((1, -1) + (1,) * (like.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Global-statistics batch norm; forward and backward each make one collective call."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        rows = _channels_last(input.detach()).double()
        count = rows.shape[0]
        mean = rows.mean(0) if count else rows.new_zeros(rows.shape[1])
        m2 = (rows - mean).pow(2).sum(0)
        local = torch.cat([rows.new_tensor([count]), mean, m2]).unsqueeze(0)
        stats = synchronize(allgather_async(local.cpu(), process_set=process_set)).to(input.device)
        counts, means, m2s = stats[:, :1], stats[:, 1 : 1 + mean.numel()], stats[:, 1 + mean.numel() :]
        total = counts.sum()
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size "
                f"{list(input.shape)} and {int(total)} values per channel over all ranks"
            )
        global_mean = (counts * means).sum(0) / total
        var = (m2s + counts * (means - global_mean).pow(2)).sum(0) / total
        if running_mean is not None:
            assert running_var is not None  # BatchNorm keeps both running statistics or neither
            running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((var * total / (total - 1)).to(running_var.dtype), alpha=momentum)
        compute = _compute_dtype(input)
        invstd = (var + eps).rsqrt().to(compute)
        xhat = (input.to(compute) - _per_channel(global_mean.to(compute), input)) * _per_channel(invstd, input)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.process_set = float(total), process_set
        out = xhat
        if weight is not None:
            assert bias is not None  # affine BatchNorm has both
            out = out * _per_channel(weight.to(compute), input) + _per_channel(bias.to(compute), input)
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xhat, weight, invstd = ctx.saved_tensors
        dy = grad.to(xhat.dtype)
        sum_dy = _channels_last(dy).double().sum(0)
        sum_dy_xhat = _channels_last(dy * xhat).double().sum(0)
        both = synchronize(
            allreduce_async(torch.cat([sum_dy, sum_dy_xhat]).cpu(), op=ReduceOp.SUM, process_set=ctx.process_set)
        ).to(grad.device)
        mean_dy = (both[: sum_dy.numel()] / ctx.total).to(xhat.dtype)
        mean_dy_xhat = (both[sum_dy.numel() :] / ctx.total).to(xhat.dtype)
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        centred = dy - _per_channel(mean_dy, dy) - xhat * _per_channel(mean_dy_xhat, dy)
        grad_input = centred * _per_channel(scale, dy)
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight, grad_bias = sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype)
        return grad_input.to(grad.dtype), grad_weight, grad_bias, None, None, None, None, None
