"""8-bit gradient quantisation with error feedback (Bagua's ByteGrad), for every frontend.

Each rank adds its residual to the gradient, splits it into one chunk per rank, quantises every
block of `block` elements to int8 with its own float32 scale (max|x|/127), and keeps what the
quantisation lost as the new residual. An alltoall sends chunk j to rank j; rank j dequantises
the N copies of its chunk, sums (averages) them, adds its own second residual, requantises, and
an allgather returns every chunk to every rank. Bytes a rank sends: about 2(N-1)/N bytes per
element, a quarter of a float32 ring allreduce, at any N.

Error feedback makes the sum of applied updates over many steps follow the sum of the true
averaged gradients: what one step rounds away is sent in a later step.
"""
from __future__ import annotations

import math
from typing import Generator

import torch

from .stateful_compression import (StatefulCompressor, allgather_stage, alltoall_stage,
                                   set_size)


def _quantise(x: torch.Tensor):
    """x: (..., B) float32 -> (int8 codes, float32 scales (...), dequantised x)."""
    scale = x.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    deq = q.to(torch.float32) * scale.unsqueeze(-1)
    return q, scale.to(torch.float32).contiguous(), deq


def _pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows of int8 codes followed by the bytes of their float32 scales."""
    rows = q.shape[0]
    return torch.cat([q.reshape(rows, -1), scale.reshape(rows, -1).view(torch.int8)], dim=1)


def _unpack(payload: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    rows = payload.shape[0]
    q = payload[:, :nb * block].reshape(rows, nb, block).to(torch.float32)
    scale = payload[:, nb * block:].contiguous().view(torch.float32).reshape(rows, nb)
    return q * scale.unsqueeze(-1)


class Int8Compressor(StatefulCompressor):
    """8-bit quantisation, one scale per `block` elements, with error feedback on both the
    sending side (per rank, full tensor) and the reducing side (per rank, its chunk)."""

    def __init__(self, block: int = 1024) -> None:
        super().__init__()
        if block <= 0:
            raise ValueError("block must be > 0")
        self.block = int(block)

    def _reduce(self, tensor, name: str, average: bool, process_set) -> Generator:
        n = set_size(process_set)
        shape, dtype = tensor.shape, tensor.dtype
        x = tensor.detach().reshape(-1).to(torch.float32)
        length = x.numel()
        chunk = max(1, math.ceil(length / n))
        block = min(self.block, chunk)
        nb = math.ceil(chunk / block)
        padded = n * nb * block
        st = self.state.setdefault(name, {})
        res = st.get("residual")
        if res is not None and res.shape == x.shape and res.device == x.device:
            x = x + res
        xp = torch.zeros(padded, dtype=torch.float32, device=x.device)
        xp[:length] = x
        q, scale, deq = _quantise(xp.view(n, nb, block))
        st["residual"] = (xp - deq.reshape(-1))[:length].clone()
        payload = _pack(q, scale)
        self.wire_bytes += payload.numel() * (n - 1) / n
        recv, _ = yield alltoall_stage(payload, f"{name}.int8.a2a", process_set)
        y = _unpack(recv, nb, block).sum(dim=0)
        if average:
            y /= n
        res2 = st.get("residual_chunk")
        if res2 is not None and res2.shape == y.shape:
            y = y + res2
        q2, s2, deq2 = _quantise(y.unsqueeze(0))
        st["residual_chunk"] = (y - deq2[0]).clone()
        payload2 = _pack(q2, s2)
        self.wire_bytes += payload2.numel() * (n - 1)
        gathered = yield allgather_stage(payload2, f"{name}.int8.ag", process_set)
        out = _unpack(gathered, nb, block).reshape(-1)[:length]
        return out.reshape(shape).to(dtype)


__all__ = ["Int8Compressor"]
