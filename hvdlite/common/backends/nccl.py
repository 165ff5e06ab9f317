"""NCCL transport for CUDA tensors: torch's ProcessGroupNCCL over the job's c10d store.

Used for responses whose tensors live on a GPU when torch was built with NCCL; CPU tensors keep
using gloo or MPI. Work objects are torch's: `.wait()` makes the waiting thread's current stream
wait for NCCL's, so the finisher synchronizes that stream before it completes a handle — a
finished handle means the result is really there, whichever stream the caller uses next.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..messages import MAX, MIN, PRODUCT, SUM

_WIDEN = {torch.int16: torch.int32, torch.bool: torch.uint8}


def available() -> bool:
    return torch.cuda.is_available() and dist.is_nccl_available()


class _Synced:
    """Wait for NCCL, then block until the current stream (copies included) has caught up."""

    def __init__(self, work, wide: torch.Tensor | None = None, out: torch.Tensor | None = None):
        self.work, self.wide, self.out = work, wide, out

    def wait(self) -> None:
        self.work.wait()
        if self.wide is not None:
            self.out.copy_(self.wide)
        torch.cuda.current_stream().synchronize()


class NCCLCommunicator:
    device = "cuda"

    def __init__(self, store, prefix: str, rank: int, size: int, timeout_s: float):
        self.rank = rank
        self.size = size
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
        return _Synced(self.pg.allreduce([work], opts), work if wide is not None else None,
                       tensor)

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(output.dtype)
        out = output.to(wide) if wide is not None else output
        src = tensor.to(wide) if wide is not None else tensor
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = self._ops[op]
        return _Synced(self.pg._reduce_scatter_base(out, src, opts),
                       out if wide is not None else None, output)

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor):
        return _Synced(self.pg._allgather_base(output, tensor))

    def broadcast(self, tensor: torch.Tensor, root: int):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return _Synced(self.pg.broadcast([tensor], opts))

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]):
        return _Synced(self.pg.alltoall_base(output, tensor, list(out_splits), list(in_splits),
                                             dist.AllToAllOptions()))

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:
            pass
