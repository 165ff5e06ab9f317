"""The data-plane interface every transport implements (gloo, mpi, nccl).

All calls are blocking and collective over the process set: the engine calls them only in the
order the coordinator decided, from its one background thread. Byte-oriented ops (allgather,
broadcast, alltoall) receive uint8 views so a transport needs no dtype knowledge for them.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Communicator(Protocol):
    rank: int
    size: int
    device: str            # "cpu" or "cuda": where buffers must live

    def allreduce(self, tensor: torch.Tensor, op: int) -> None:
        """In place. op is messages.SUM/MIN/MAX/PRODUCT (Average is SUM + postscale)."""

    def reducescatter(self, output: torch.Tensor, chunks: list[torch.Tensor], op: int) -> None:
        """chunks[i] (equal sizes) is this rank's contribution to rank i's output."""

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """uint8: output is size * len(tensor) bytes, rank-major."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """uint8, in place."""

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]) -> None:
        """uint8; splits in bytes."""

    def close(self) -> None:
        ...
