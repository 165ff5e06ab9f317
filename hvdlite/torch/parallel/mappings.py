"""Megatron's conjugate tensor-parallel operators as autograd functions.

| function                               | forward                  | backward                 |
|----------------------------------------|--------------------------|--------------------------|
| copy_to_tensor_parallel_region   (f)   | identity                 | all-reduce (sum)         |
| reduce_from_tensor_parallel_region (g) | all-reduce (sum)         | identity                 |
| scatter_to_tensor_parallel_region      | keep own last-dim slice  | all-gather last dim      |
| gather_from_tensor_parallel_region     | all-gather last dim      | keep own last-dim slice  |

Unlike `hvd.allreduce` (whose gradient is another Average allreduce, Horovod's definition), these
have the gradients tensor parallelism needs. `process_set=None` means the current mesh's tensor-
parallel group (see `mesh()`), else every rank. `name` names the collectives (the backward one
gets a `.grad` suffix); unnamed calls are named after the calling line (`tp.copy@model.py:42`).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _comm
from .groups import default_tp_set


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, name):
        ctx.ps, ctx.name = ps, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _comm.allreduce(g, ctx.ps, _grad_name(ctx.name)), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, name):
        return _comm.allreduce(x, ps, name)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, name):
        ctx.ps, ctx.name = ps, name
        return _comm.split_last_dim(x, ps, "the input of scatter_to_tensor_parallel_region")

    @staticmethod
    def backward(ctx, g):
        return _comm.allgather_last_dim(g.contiguous(), ctx.ps, _grad_name(ctx.name)), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, name):
        ctx.ps = ps
        return _comm.allgather_last_dim(x.contiguous(), ps, name)

    @staticmethod
    def backward(ctx, g):
        return _comm.split_last_dim(g, ctx.ps, "the gradient of gather_from_tensor_parallel_region"
                                    ), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, process_set=None,
                                   name: Optional[str] = None) -> torch.Tensor:
    """Megatron's f: identity forward, gradient summed over the tensor-parallel group."""
    ps = default_tp_set(process_set)
    if _comm.set_size(ps) == 1:
        return x
    return _CopyToRegion.apply(x, ps, name or _comm.site_name("tp.copy"))


def reduce_from_tensor_parallel_region(x: torch.Tensor, process_set=None,
                                       name: Optional[str] = None) -> torch.Tensor:
    """Megatron's g: sum over the tensor-parallel group forward, identity backward."""
    ps = default_tp_set(process_set)
    if _comm.set_size(ps) == 1:
        return x
    return _ReduceFromRegion.apply(x, ps, name or _comm.site_name("tp.reduce"))


def scatter_to_tensor_parallel_region(x: torch.Tensor, process_set=None,
                                      name: Optional[str] = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; the gradient is all-gathered."""
    ps = default_tp_set(process_set)
    if _comm.set_size(ps) == 1:
        return x
    return _ScatterToRegion.apply(x, ps, name or _comm.site_name("tp.scatter"))


def gather_from_tensor_parallel_region(x: torch.Tensor, process_set=None,
                                       name: Optional[str] = None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension; the gradient is sliced."""
    ps = default_tp_set(process_set)
    if _comm.set_size(ps) == 1:
        return x
    return _GatherFromRegion.apply(x, ps, name or _comm.site_name("tp.gather"))


# Megatron-core's names, for code ported from it.
copy_to_tensor_model_parallel_region = copy_to_tensor_parallel_region
reduce_from_tensor_model_parallel_region = reduce_from_tensor_parallel_region
scatter_to_tensor_model_parallel_region = scatter_to_tensor_parallel_region
gather_from_tensor_model_parallel_region = gather_from_tensor_parallel_region
