"""Gloo transport: torch's own build of gloo (ProcessGroupGloo) over the job's c10d store.

pygloo has no wheels for current Python, so torch's build is the one available everywhere.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..messages import MAX, MIN, PRODUCT, SUM

_OPS = {SUM: dist.ReduceOp.SUM, MIN: dist.ReduceOp.MIN, MAX: dist.ReduceOp.MAX,
        PRODUCT: dist.ReduceOp.PRODUCT}
# Gloo has no int16 kernels: reduce those in int32 (wrap-around is the same once cast back).
_WIDEN = {torch.int16: torch.int32}


class GlooCommunicator:
    device = "cpu"

    def __init__(self, store, prefix: str, rank: int, size: int, timeout_s: float):
        self.rank = rank
        self.size = size
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                        datetime.timedelta(seconds=timeout_s))

    def allreduce(self, tensor: torch.Tensor, op: int) -> None:
        wide = _WIDEN.get(tensor.dtype)
        work = tensor.to(wide) if wide is not None else tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self.pg.allreduce([work], opts).wait()
        if wide is not None:
            tensor.copy_(work)

    def reducescatter(self, output: torch.Tensor, chunks: list[torch.Tensor], op: int) -> None:
        wide = _WIDEN.get(output.dtype)
        if wide is not None:
            out = output.to(wide)
            chunks = [c.to(wide) for c in chunks]
        else:
            out = output
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        self.pg.reduce_scatter([out], [chunks], opts).wait()
        if wide is not None:
            output.copy_(out)

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        n = tensor.numel()
        outs = [output[i * n:(i + 1) * n] for i in range(self.size)]
        self.pg.allgather([outs], [tensor]).wait()

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([tensor], opts).wait()

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]) -> None:
        self.pg.alltoall_base(output, tensor, list(out_splits), list(in_splits),
                              dist.AllToAllOptions()).wait()

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:
            pass
