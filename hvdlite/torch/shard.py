"""One rank's piece of a tensor sharded across ranks.

This is the vocabulary that sharded state (``fully_shard``'s sharded state dicts, ZeRO's partitions)
and ``hvdlite.torch.checkpoint`` share: a checkpoint writes each piece as one chunk of the global
tensor, in torch.distributed.checkpoint's terms a box at ``offsets`` of ``local``'s shape, so it can
be loaded back on any number of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LocalShard:
    """The box ``global_tensor[offsets[0]:offsets[0] + local.shape[0], offsets[1]:..., ...]``.

    Attributes:
        local: This rank's piece. It may be empty (a rank with no rows of a short tensor).
        global_shape: The shape of the whole tensor across all ranks.
        offsets: Where ``local`` starts in every dimension of the whole tensor.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        shape, glob, offs = tuple(self.local.shape), tuple(self.global_shape), tuple(self.offsets)
        if len(glob) != len(shape) or len(offs) != len(shape):
            raise ValueError(f"LocalShard: a piece of shape {shape} cannot sit at offsets {offs} "
                             f"of a tensor of shape {glob}: the ranks differ")
        for dim, (size, start, whole) in enumerate(zip(shape, offs, glob)):
            if start < 0 or start + size > whole:
                raise ValueError(f"LocalShard: dimension {dim} of the piece covers "
                                 f"[{start}, {start + size}) but the tensor has {whole}")
