"""Gloo transport: torch's own build of gloo (ProcessGroupGloo) over the job's c10d store.

pygloo has no wheels for current Python, so torch's build is the one available everywhere.
When every rank of a communicator is on one host, allreduce, reducescatter, allgather and
broadcast of CPU tensors go through shared memory instead of gloo's TCP loopback (shm.py);
gloo carries the rest, and everything when the ranks span hosts or HVDLITE_SHM=0.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..messages import MAX, MIN, PRODUCT, SUM
from . import shm
from .base import PollableWork, Work

_OPS = {SUM: dist.ReduceOp.SUM, MIN: dist.ReduceOp.MIN, MAX: dist.ReduceOp.MAX,
        PRODUCT: dist.ReduceOp.PRODUCT}
# torch's works offer is_completed(): the engine may poll gloo's (base.PollableWork).
PollableWork.register(dist.Work)
# Gloo has no int16 kernels: reduce those in int32 (wrap-around is the same once cast back).
_WIDEN = {torch.int16: torch.int32}


class _Widened(Work):
    """A pending int16 reduction done in int32: copies back once the transport finishes."""

    def __init__(self, work, wide: torch.Tensor, out: torch.Tensor):
        self.work, self.wide, self.out = work, wide, out

    def wait(self) -> None:
        self.work.wait()
        self.out.copy_(self.wide)


class GlooCommunicator(shm.ShmRouted):
    """Every call launches the collective and returns its pending work (`.wait()`); shared
    memory carries what it can (shm.ShmRouted), gloo the rest."""

    device = "cpu"

    def __init__(self, store, prefix: str, rank: int, size: int, timeout_s: float):
        self.rank = rank
        self.size = size
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                        datetime.timedelta(seconds=timeout_s))
        self.shm = shm.connect(dist.PrefixStore(prefix + "shm/", store), rank, size, timeout_s,
                               self._all_agree)
        # With shared memory, and while every rank has a core (the channel spins), the steady
        # state's rounds run through the segment (shm.ShmAgreement) and the engine may poll a
        # small collective (which then runs on its own thread: ShmChannel._submit) instead of
        # handing it to its finisher. When ranks outnumber cores, rounds stay on the control
        # connections: a round waited for there wakes its thread when the peers' answer
        # arrives, where a round in shared memory would be polled (4 ranks on 2 cores ran the
        # MLP step 42 -> 47 ms so).
        spin = self.shm is not None and self.shm.spin_s > 0
        self.agreement = self.shm.agreement if spin else None
        self.inline_poll_s = self.shm.spin_s if spin else 0.0

    def _all_agree(self, ok: bool) -> bool:
        """True on every rank when `ok` is True on every rank (one gloo allreduce)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([flag], opts).wait()
        return bool(flag.item())

    def _allreduce(self, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(tensor.dtype)
        work = tensor.to(wide) if wide is not None else tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        pending = self.pg.allreduce([work], opts)
        return _Widened(pending, work, tensor) if wide is not None else pending

    def _reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(output.dtype)
        out = output.to(wide) if wide is not None else output
        if wide is not None:
            tensor = tensor.to(wide)
        n = out.numel()
        chunks = [tensor[i * n:(i + 1) * n] for i in range(self.size)]
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        pending = self.pg.reduce_scatter([out], [chunks], opts)
        return _Widened(pending, out, output) if wide is not None else pending

    def _allgather(self, output: torch.Tensor, tensor: torch.Tensor):
        n = tensor.numel()
        outs = [output[i * n:(i + 1) * n] for i in range(self.size)]
        return self.pg.allgather([outs], [tensor])

    def _broadcast(self, tensor: torch.Tensor, root: int):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.pg.broadcast([tensor], opts)

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]):
        return self.pg.alltoall_base(output, tensor, list(out_splits), list(in_splits),
                                     dist.AllToAllOptions())

    def close(self) -> None:
        self.close_shm()
        try:
            self.pg.shutdown()
        except Exception:
            pass
