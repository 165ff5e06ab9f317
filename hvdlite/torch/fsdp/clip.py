"""Gradient clipping by the global norm of fully sharded gradients.

Each rank holds a disjoint piece of every sharded gradient, so the global norm is the p-th root
of the sum over the shard group of each rank's sum of |g|^p (the max for p = inf); parameters
`fully_shard` does not hold are whole on every rank and count once.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .. import mpi_ops as _mpi


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole (unsharded) gradients; a collective over
    the shard group. Returns the global norm (the same on every rank of the group)."""
    every = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    # The shard group comes from every parameter passed, with a gradient or not, so every rank
    # of the group takes part in the one allreduce.
    groups = {tuple(p._hvd_fsdp.group.shard.ranks): p._hvd_fsdp.group.shard
              for p in every if getattr(p, "_hvd_fsdp", None) is not None}
    if len(groups) > 1:
        raise ValueError(f"clip_grad_norm_: the parameters are sharded over different process "
                         f"sets {sorted(groups)}; clip each set's parameters separately")
    params = [p for p in every if p.grad is not None]
    norm_type = float(norm_type)
    sharded = [p for p in params if getattr(p, "_hvd_fsdp", None) is not None]
    plain = [p for p in params if getattr(p, "_hvd_fsdp", None) is None]
    inf = math.isinf(norm_type)
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in every) else torch.float32

    def partial(ps) -> torch.Tensor:
        if not ps:
            return torch.zeros((), dtype=dtype)
        if inf:
            return torch.stack([p.grad.detach().abs().max().to(dtype).cpu() if p.grad.numel()
                                else torch.zeros((), dtype=dtype) for p in ps]).max()
        return torch.stack([p.grad.detach().to(dtype).abs().pow(norm_type).sum().cpu()
                            for p in ps]).sum()

    mine = partial(sharded)
    if groups:
        (ps,) = groups.values()
        mine = _mpi.allreduce(mine.reshape(1), name="fsdp.clip_grad_norm",
                              op=_mpi.Max if inf else _mpi.Sum, process_set=ps).reshape(())
    rest = partial(plain)
    total = torch.maximum(mine, rest) if inf else (mine + rest) ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is "
                           f"non-finite ({float(total)}); error_if_nonfinite=False skips this")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
