"""Gradient norms and clipping across tensor- and pipeline-parallel ranks.

`torch.nn.utils.clip_grad_norm_` on one rank sees only that rank's shards and stage. Here the
norm covers the whole model: sharded parameters contribute every shard, replicated ones (layer
norms, row-parallel biases, whose gradients are identical on every tensor-parallel rank) are
counted once, and stages are summed over the pipeline group. Data-parallel replicas are not
involved: call it after the data-parallel gradient reduction (for DistributedOptimizer:
`opt.synchronize()`, clip, then `with opt.skip_synchronize(): opt.step()`).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from .. import mpi_ops
from . import _comm
from .groups import Mesh, current_mesh


def grad_norm(parameters: Iterable[torch.Tensor], mesh: Optional[Mesh] = None,
              norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of the model this rank holds a part of (a collective over the
    mesh's tp and pp groups; every rank of them must call it)."""
    m = mesh if mesh is not None else current_mesh()
    params = [p for p in parameters if p.grad is not None]
    tp_rank = _comm.set_rank(m.tp) if m is not None else 0
    inf = math.isinf(norm_type)
    acc = torch.zeros(1, dtype=torch.float64)
    for p in params:
        if not getattr(p, "tensor_parallel", False) and tp_rank != 0:
            continue                      # replicated: counted once, on tp rank 0
        g = p.grad.detach().to(torch.float64)
        if inf:
            acc = torch.maximum(acc, g.abs().max().reshape(1))
        else:
            acc += g.abs().pow(norm_type).sum()
    if m is not None:
        op = mpi_ops.Max if inf else mpi_ops.Sum
        acc = _comm.allreduce(acc, m.tp, "hvdlite.grad_norm.tp", op=op)
        acc = _comm.allreduce(acc, m.pp, "hvdlite.grad_norm.pp", op=op)
    total = acc[0] if inf else acc[0] ** (1.0 / norm_type)
    return total.to(torch.float32)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    mesh: Optional[Mesh] = None, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)) where total_norm is
    `grad_norm` over the whole model (torch.nn.utils.clip_grad_norm_'s rule); returns
    total_norm. A collective over the mesh's tp and pp groups."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, mesh, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"non-finite ({total.item()}), so it cannot be clipped")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
