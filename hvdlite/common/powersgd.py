"""PowerSGD (Vogels et al., 2019) with error feedback and warm start (every frontend).

A gradient of shape (n, ...) is seen as an n x m matrix M (plus this rank's residual). With the
previous step's Q (m x r; warm start), P = M Q is averaged over the ranks and orthonormalised,
then Q = M^T P is averaged; every rank applies P Q^T and keeps M - P Q^T as its residual. Only
r (n + m) numbers per matrix cross the wire instead of n m.

Vectors (biases, norms) and matrices too small to gain are allreduced uncompressed, as DDP's
PowerSGD hook does; so are all tensors for the first `warmup_steps` steps.
"""
from __future__ import annotations

import zlib
from typing import Generator

import torch

from .messages import AVERAGE, SUM
from .stateful_compression import (StatefulCompressor, allreduce_stage, ring_allreduce_bytes,
                                   set_size)


class PowerSGDCompressor(StatefulCompressor):
    """Rank-`rank` PowerSGD; `warmup_steps` uncompressed steps first."""

    def __init__(self, rank: int = 4, warmup_steps: int = 0) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError("PowerSGD rank must be >= 1")
        self.rank = int(rank)
        self.warmup_steps = int(warmup_steps)

    def _plain(self, tensor, name, average, process_set, n):
        out = tensor.detach().clone()
        self.wire_bytes += ring_allreduce_bytes(out.numel() * out.element_size(), n)
        yield allreduce_stage(out, f"{name}.psgd.full", AVERAGE if average else SUM,
                              process_set)
        return out

    def _reduce(self, tensor, name: str, average: bool, process_set) -> Generator:
        n = set_size(process_set)
        st = self.state.setdefault(name, {"steps": 0})
        st["steps"] += 1
        rows = tensor.shape[0] if tensor.dim() >= 2 else 1
        cols = tensor.numel() // max(rows, 1)
        r = min(self.rank, rows, cols)
        if (tensor.dim() < 2 or r * (rows + cols) >= rows * cols
                or st["steps"] <= self.warmup_steps):
            return (yield from self._plain(tensor, name, average, process_set, n))
        op = AVERAGE if average else SUM
        wdtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        m = tensor.detach().reshape(rows, cols).to(wdtype)
        err = st.get("error")
        if err is not None and err.shape == m.shape:
            m = m + err
        q = st.get("q")
        if q is None or q.shape != (cols, r) or q.dtype != wdtype:
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            q = torch.randn(cols, r, generator=g, dtype=wdtype).to(m.device)
        p = m @ q
        self.wire_bytes += ring_allreduce_bytes(p.numel() * p.element_size(), n)
        yield allreduce_stage(p, f"{name}.psgd.p", op, process_set)
        p = torch.linalg.qr(p).Q
        q = m.t() @ p
        self.wire_bytes += ring_allreduce_bytes(q.numel() * q.element_size(), n)
        yield allreduce_stage(q, f"{name}.psgd.q", op, process_set)
        approx = p @ q.t()
        # Residual: what this rank's matrix has that the shared approximation does not. For Sum
        # the approximation is of the sum, so compare against this rank's share of it.
        st["error"] = m - (approx if average else approx / n)
        st["q"] = q
        return approx.reshape(tensor.shape).to(tensor.dtype)


__all__ = ["PowerSGDCompressor"]
