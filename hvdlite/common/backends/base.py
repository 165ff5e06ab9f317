"""The data-plane interface every transport implements (gloo, mpi, nccl).

Every call is collective over the process set and returns a pending work object with `.wait()`:
the engine launches calls only in the order the coordinator decided, from its one background
thread, and a finisher thread waits for them in that order. Byte-oriented ops (allgather,
broadcast, alltoall) receive uint8 views so a transport needs no dtype knowledge for them.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Work(Protocol):
    def wait(self) -> None:
        """Block until the collective finished; raise if it failed."""


class Done:
    """Work that is already finished (a one-rank set, or a transport that ran synchronously).
    The engine finishes a collective that yields DONE on its own thread, without a hand-off."""

    @staticmethod
    def wait() -> None:
        pass


DONE = Done()


class Communicator(Protocol):
    rank: int
    size: int
    device: str            # "cpu" or "cuda": where buffers must live

    def allreduce(self, tensor: torch.Tensor, op: int) -> Work:
        """In place. op is messages.SUM/MIN/MAX/PRODUCT (Average is SUM + postscale)."""

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int) -> Work:
        """tensor holds size equal chunks; chunk i is this rank's contribution to rank i."""

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        """uint8: output is size * len(tensor) bytes, rank-major."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        """uint8, in place."""

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]) -> Work:
        """uint8; splits in bytes."""

    def close(self) -> None:
        ...
