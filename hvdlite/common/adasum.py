"""Adasum (adaptive summation) arithmetic: Horovod's `op=hvd.Adasum`, written once for the engine.

For two gradients a and b Adasum returns

    (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

which is a + b when they are orthogonal and their average when they are equal. Horovod combines
the ranks' tensors with vector-halving distance-doubling (ops/adasum/adasum.h): at level 1 rank r
pairs with r ^ 1, at level 2 the pair {0, 1} with {2, 3}, and so on, with the dot products and
norms taken over the whole tensor at every level. The result is therefore the binary tree

    adasum(adasum(adasum(x0, x1), adasum(x2, x3)), adasum(adasum(x4, x5), adasum(x6, x7)))

over consecutive ranks, which `tree_reduce` computes; a fused buffer is reduced tensor by tensor
(each tensor has its own dot product and norms). As in Horovod, a coefficient whose squared norm
is below 1e-8 is taken as 1 (so a zero contribution, e.g. from a joined rank, leaves the other
side unchanged), dot products and norms are accumulated in float64, and the combined values are
rounded to the tensor's dtype after every level.
"""
from __future__ import annotations

import torch

NORM_EPSILON = 1e-8

NON_POWER_OF_TWO = "Running Adasum with non-power of 2 ranks is not supported yet."
NON_GLOBAL_SET = "Adasum does not support non-global process sets yet."
GPU_TENSOR = ("op=Adasum runs on CPU tensors in hvdlite (Horovod's GPU Adasum, an NCCL reduction "
              "within each node followed by Adasum across nodes, is not implemented); move the "
              "tensor or the model to the CPU.")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _segments(counts: list[int], device) -> torch.Tensor:
    """Tensor index of every element of a fused buffer."""
    return torch.repeat_interleave(torch.arange(len(counts), device=device),
                                   torch.tensor(counts, dtype=torch.long, device=device))


def pairwise(a: torch.Tensor, b: torch.Tensor, counts: list[int],
             segments: torch.Tensor | None = None) -> torch.Tensor:
    """Adasum of two flat buffers holding len(counts) tensors back to back; a's dtype."""
    dtype = a.dtype
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    if segments is None:
        segments = _segments(counts, a.device)
    n = len(counts)
    dot = torch.zeros(n, dtype=torch.float64, device=a.device).index_add_(0, segments, a64 * b64)
    anorm = torch.zeros_like(dot).index_add_(0, segments, a64 * a64)
    bnorm = torch.zeros_like(dot).index_add_(0, segments, b64 * b64)
    acoeff = torch.where(anorm >= NORM_EPSILON, 1.0 - dot / anorm.clamp_min(NORM_EPSILON) * 0.5,
                         torch.ones_like(dot))
    bcoeff = torch.where(bnorm >= NORM_EPSILON, 1.0 - dot / bnorm.clamp_min(NORM_EPSILON) * 0.5,
                         torch.ones_like(dot))
    return (acoeff[segments] * a64 + bcoeff[segments] * b64).to(dtype)


def tree_reduce(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Adasum of rows[0..size) (one row per rank, each a fused buffer of `counts` tensors) in
    Horovod's VHDD pairing order. Every rank computing this on the same rows gets the same bits."""
    size = rows.shape[0]
    if not is_power_of_two(size):
        raise NotImplementedError(NON_POWER_OF_TWO)
    segments = _segments(counts, rows.device)
    level = [rows[r] for r in range(size)]
    while len(level) > 1:
        level = [pairwise(level[i], level[i + 1], counts, segments)
                 for i in range(0, len(level), 2)]
    return level[0].clone() if size == 1 else level[0]
