"""NCCL transport for CUDA tensors: torch's ProcessGroupNCCL over the job's c10d store.

Used for responses whose tensors live on a GPU when torch was built with NCCL; CPU tensors keep
using gloo or MPI. The engine launches each call from its own stream (`collectives.on_stream`).
Work objects are torch's: `.wait()`, made on that stream, orders it after NCCL's without
blocking the thread, so what the collective does next there (a fused response's copies out, an
average's scaling) runs after NCCL; `collectives.gpu_done` blocks on that stream once at the
end, before the handle completes — a finished handle means the result is really there,
whichever stream the caller uses next (or, with HOROVOD_ENABLE_ASYNC_COMPLETION=1, queued
behind an event the caller's stream waits for).
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from ..messages import MAX, MIN, PRODUCT, SUM
from .base import Communicator, Work

_WIDEN = {torch.int16: torch.int32, torch.bool: torch.uint8}


def available() -> bool:
    return torch.cuda.is_available() and dist.is_nccl_available()


def nccl_host() -> str:
    """The host as NCCL tells hosts apart: `NCCL_HOSTID` where it is set, else the host name.

    NCCL refuses two ranks on one GPU only when it takes them for ranks of one host (same host
    hash, same bus id); ranks given different `NCCL_HOSTID`s are "hosts" of their own to it,
    and it connects them through its network transport (sockets on loopback). That is how a
    multi-rank NCCL job is tested on a machine with one GPU, and hvdlite must then let NCCL
    have them rather than stage their tensors through host memory."""
    return os.environ.get("NCCL_HOSTID") or socket.gethostname()


def gpu_id(device: int) -> str:
    """A name for this rank's GPU that is the same in every process that NCCL would refuse to
    put on it together: NCCL's host (nccl_host) and the device UUID (CUDA_VISIBLE_DEVICES
    renumbers devices per process, so an index would not do)."""
    index = device if device >= 0 else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"{nccl_host()}/{uuid if uuid is not None else index}"


def shared_gpus(store, prefix: str, rank: int, size: int, device: int) -> list[list[int]]:
    """The groups of ranks (set ranks) that use one GPU between them; empty when each rank has
    its own. NCCL refuses such a communicator ("Duplicate GPU detected") when it first runs a
    collective, so the ranks compare their GPUs through the store before building one."""
    store.set(f"{prefix}gpu/{rank}", gpu_id(device))
    ids = [store.get(f"{prefix}gpu/{r}").decode() for r in range(size)]
    groups: dict = {}
    for r, g in enumerate(ids):
        groups.setdefault(g, []).append(r)
    return [rs for rs in groups.values() if len(rs) > 1]


class _Synced(Work):
    """Order the stream that launched the call after NCCL's (and a widened result's copy back
    after that); the host is not blocked here but once per collective, in
    `collectives.gpu_done`."""

    def __init__(self, device: torch.device, work, wide: torch.Tensor | None = None,
                 out: torch.Tensor | None = None):
        self.work, self.wide, self.out = work, wide, out
        # The stream that launched it on `device` (the engine's, collectives.on_stream): the
        # one that must wait, whichever thread calls wait() and whatever stream is current there.
        self.stream = torch.cuda.current_stream(device)

    def wait(self) -> None:
        with torch.cuda.stream(self.stream):
            self.work.wait()
            if self.wide is not None:
                self.out.copy_(self.wide)


class NCCLCommunicator(Communicator):
    """One process set's NCCL communicator on this rank's GPU. `device` names that GPU
    ("cuda:N"), so fusion buffers and outputs are made there whichever device is current in the
    engine's threads."""

    def __init__(self, store, prefix: str, rank: int, size: int, timeout_s: float,
                 device: int = -1):
        self.rank = rank
        self.size = size
        self._dev = torch.device("cuda", device if device >= 0 else torch.cuda.current_device())
        self.device = str(self._dev)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)
        self._ops = {SUM: dist.ReduceOp.SUM, MIN: dist.ReduceOp.MIN, MAX: dist.ReduceOp.MAX,
                     PRODUCT: dist.ReduceOp.PRODUCT}

    def allreduce(self, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(tensor.dtype)
        work = tensor.to(wide) if wide is not None else tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = self._ops[op]
        return _Synced(self._dev, self.pg.allreduce([work], opts),
                       work if wide is not None else None, tensor)

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(output.dtype)
        out = output.to(wide) if wide is not None else output
        src = tensor.to(wide) if wide is not None else tensor
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = self._ops[op]
        return _Synced(self._dev, self.pg._reduce_scatter_base(out, src, opts),
                       out if wide is not None else None, output)

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor):
        return _Synced(self._dev, self.pg._allgather_base(output, tensor))

    def broadcast(self, tensor: torch.Tensor, root: int):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return _Synced(self._dev, self.pg.broadcast([tensor], opts))

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]):
        return _Synced(self._dev, self.pg.alltoall_base(output, tensor, list(out_splits),
                                                        list(in_splits), dist.AllToAllOptions()))

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:
            pass
