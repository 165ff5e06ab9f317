"""The routing a transport with a shared-memory channel shares (gloo and MPI).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..base import Communicator
from .channel import ShmChannel

log = logging.getLogger("hvdlite.common.backends.shm")


class ShmRouted(Communicator):
    """The routing a transport with a shared-memory channel shares: allreduce, reducescatter,
    allgather and broadcast go through `self.shm` when it takes the tensors (CPU, a dtype torch
    reduces elementwise, at least `shm_min_bytes`), otherwise to the transport's own
    `_allreduce`, `_reducescatter`, `_allgather` and `_broadcast`. gloo and MPI both use it, so
    the rules live in one place."""

    shm: Optional[ShmChannel] = None
    # Collectives of fewer bytes go to the transport even where the channel could take them: 0
    # for gloo (the channel beats its TCP at every size), MPI's LARGE_MB while its ranks
    # spin (MPICH's own shared memory wins below that size, the channel above it).
    shm_min_bytes: int = 0
    # A fused allreduce of two tensors or more takes the channel from this many bytes on, even
    # below shm_min_bytes (0: not below it). MPI sets it while its ranks spin: the channel
    # copies every member into its slot and out in a few multi-tensor calls, where MPI reduces
    # the large members one call each and the small ones through the engine's fusion buffer
    # (backends/mpi.FUSED_MIN_BYTES has the figures).
    shm_fused_min_bytes: int = 0

    @property
    def fuses_in_place(self) -> bool:
        """Whether a fused allreduce needs no fusion buffer here (allreduce_tensors: the channel
        copies each member into its segment and the results out itself), whatever its size."""
        return self.shm is not None and self.shm_min_bytes == 0

    def _takes(self, tensor: torch.Tensor, reduce: bool) -> bool:
        return (self.shm is not None and self.shm.handles(tensor, reduce)
                and tensor.numel() * tensor.element_size() >= self.shm_min_bytes)

    def allreduce(self, tensor: torch.Tensor, op: int):
        if self._takes(tensor, reduce=True):
            return self.shm.allreduce(tensor, op)
        return self._allreduce(tensor, op)

    def allreduce_tensors(self, inputs: list, outputs: list, op: int, prescale: float,
                          postscale: float):
        """A fused allreduce without the engine's fusion buffer, through shared memory; None
        when that path cannot take these tensors (the engine then packs and calls allreduce,
        or reduces the large members in place: collectives.Executor)."""
        if self.shm is None:
            return None
        # The size first: under MPI most fused batches are below shm_min_bytes, and the sum
        # costs a third of checking every member and output (~0.2 us each: 100 members, 14
        # against 42 us). The rule depends only on the response (sizes and count, the same on
        # every rank), so every rank routes alike; outputs that are not contiguous, which can
        # differ between ranks, reach here already staged (collectives.Executor.allreduce).
        if self.shm_min_bytes:
            nbytes = sum(t.numel() * t.element_size() for t in inputs)
            if nbytes < self.shm_min_bytes and not (
                    len(inputs) > 1 and self.shm_fused_min_bytes
                    and nbytes >= self.shm_fused_min_bytes):
                return None
        if not all(self.shm.handles(t, reduce=True) for t in inputs) or \
                not all(o is None or self.shm.handles(o, reduce=True) for o in outputs):
            return None
        return self.shm.allreduce_tensors(inputs, outputs, op, prescale, postscale)

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int):
        if self._takes(tensor, reduce=True) and self.shm.handles(output, reduce=True):
            return self.shm.reducescatter(output, tensor, op)
        return self._reducescatter(output, tensor, op)

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor):
        if self._takes(output, reduce=False) and self.shm.handles(tensor, reduce=False):
            return self.shm.allgather(output, tensor)
        return self._allgather(output, tensor)

    def broadcast(self, tensor: torch.Tensor, root: int):
        if self._takes(tensor, reduce=False):
            return self.shm.broadcast(tensor, root)
        return self._broadcast(tensor, root)

    def close_shm(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
