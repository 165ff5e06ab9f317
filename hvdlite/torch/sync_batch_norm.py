"""Horovod's `hvd.SyncBatchNorm`: batch normalisation with statistics over the whole global batch.

Unlike Horovod's (which called CUDA-only torch kernels), this one is written with plain tensor ops
and works on CPU and GPU alike. Per-rank batches may differ in size (even be empty): each rank
shares its count, mean and sum of squared deviations, and the global mean and variance are combined
with Chan's parallel formula, which stays accurate where sum/sum-of-squares would cancel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import Function, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ..common import basics as _basics
from .mpi_ops import Sum, allgather_async, allreduce_async, synchronize


class SyncBatchNorm(_BatchNorm):
    """Applies synchronous N-dimensional batch normalisation over all ranks.

    In training mode the mean and variance are those of the global batch (every rank's local
    batch together); running statistics are updated with the global unbiased variance. In eval
    mode it is plain batch normalisation with the running statistics. Gradients with respect to
    the input are those of the global batch; weight and bias gradients stay local, to be
    allreduced by `DistributedOptimizer` like every other gradient.

    See `torch.nn.BatchNorm2d` for the arguments.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got {}D input)".format(input.dim()))

    def _run_bn(self, input, exponential_average_factor):
        return F.batch_norm(
            input, self.running_mean, self.running_var, self.weight, self.bias,
            self.training or not self.track_running_stats, exponential_average_factor, self.eps)

    def forward(self, input):
        self._check_input_dim(input)

        exponential_average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)

        if not self.training and self.track_running_stats:
            return self._run_bn(input, exponential_average_factor)
        if _basics.size() == 1:
            return self._run_bn(input, exponential_average_factor)
        update = self.training and self.track_running_stats
        return _SyncBatchNorm.apply(input, self.weight, self.bias,
                                    self.running_mean if update else None,
                                    self.running_var if update else None,
                                    self.eps, exponential_average_factor)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def _reduce_dims(t: torch.Tensor) -> list:
    return [0] + list(range(2, t.dim()))


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (like.dim() - 2))


class _SyncBatchNorm(Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        cdtype = _compute_dtype(input)
        x = input.contiguous().to(cdtype)
        channels = x.size(1)
        dims = _reduce_dims(x)
        count = x.numel() // channels if channels else 0

        # Local statistics in float64: count, mean, sum of squared deviations (M2).
        x64 = x.to(torch.float64)
        if count > 0:
            mean_l = x64.mean(dims)
            m2_l = ((x64 - _per_channel(mean_l, x64)) ** 2).sum(dims)
        else:
            mean_l = x64.new_zeros(channels)
            m2_l = x64.new_zeros(channels)
        local = torch.cat([x64.new_tensor([float(count)]), mean_l, m2_l]).unsqueeze(0)
        gathered = synchronize(allgather_async(local, name=f"sync_batch_norm.stats.{channels}"))

        counts = gathered[:, 0]
        means = gathered[:, 1:channels + 1]
        m2s = gathered[:, channels + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError("Expected more than 1 value per channel when training, got "
                             f"{int(total)} over all ranks")
        mean = (counts[:, None] * means).sum(0) / total
        m2 = (m2s + counts[:, None] * (means - mean) ** 2).sum(0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
        if running_var is not None:
            unbiased = m2 / (total - 1)
            running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))

        mean_c = mean.to(cdtype)
        invstd_c = invstd.to(cdtype)
        out = (x - _per_channel(mean_c, x)) * _per_channel(invstd_c, x)
        if weight is not None:
            out = out * _per_channel(weight.to(cdtype), x)
        if bias is not None:
            out = out + _per_channel(bias.to(cdtype), x)

        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.total = total
        ctx.has_bias = bias is not None
        ctx.input_dtype = input.dtype
        return out.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[0:3]
        g = grad_output.contiguous().to(x.dtype)
        dims = _reduce_dims(x)
        channels = x.size(1)
        xmu = x - _per_channel(mean, x)

        sum_dy = g.sum(dims)
        sum_dy_xmu = (g * xmu).sum(dims)

        grad_input = grad_weight = grad_bias = None
        if need_weight and weight is not None:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if need_bias and ctx.has_bias:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else grad_output.dtype)

        if need_input:
            # The input gradient needs both sums over the global batch.
            sums = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), op=Sum,
                                               name=f"sync_batch_norm.sum_dy.{channels}"))
            mean_dy = _per_channel(sums[:channels] / ctx.total, x)
            mean_dy_xmu = _per_channel(sums[channels:] / ctx.total, x)
            scale = invstd if weight is None else invstd * weight.to(x.dtype)
            grad_input = (g - mean_dy - xmu * _per_channel(invstd * invstd, x) * mean_dy_xmu) \
                * _per_channel(scale, x)
            grad_input = grad_input.to(ctx.input_dtype)

        return grad_input, grad_weight, grad_bias, None, None, None, None


__all__ = ["SyncBatchNorm"]
