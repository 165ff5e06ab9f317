"""PyTorch collectives with Horovod's names and signatures (horovod.torch.mpi_ops).

This module only adapts torch tensors (and autograd) to the op layer, `common/ops.py`, which
submits every collective to the common engine.
"""
from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from ..common import basics as _basics
from ..common import ops as _ops
from ..common.basics import (ccl_built, cross_rank, cross_size, cuda_built,  # noqa: F401
                             ddl_built, gloo_built, gloo_enabled, is_homogeneous,
                             is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rank, rocm_built, size,
                             start_timeline, stop_timeline)
from ..common.ops import add_process_set, remove_process_set  # noqa: F401
from ..common.exceptions import HorovodInternalError
from ..common.messages import (ADASUM, AVERAGE, MAX, MIN, PRODUCT, SUM,
                               handle_average_backwards_compatibility)
from ..common.process_sets import ProcessSet, global_process_set
from .compression import Compression

Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT

# Horovod's API hands out integer handles; each maps to the op layer's public Handle.
_handle_map: dict[int, tuple] = {}     # int handle -> (ops.Handle, postprocess)
_handle_lock = threading.Lock()
_next_handle = 0


def _register(handle: _ops.Handle, post: Callable[[Any], Any]) -> int:
    """An integer handle for `handle`; synchronize() returns `post(result)`. A grouped op's
    post is `tuple`: Horovod's handle map holds a group's outputs as a tuple, so its
    synchronize(), grouped_allreduce_ and grouped_allgather return one (grouped_allreduce and
    grouped_reducescatter return lists, as there)."""
    global _next_handle
    with _handle_lock:
        _next_handle += 1
        h = _next_handle
        _handle_map[h] = (handle, post)
    return h


def get_handle(handle: int) -> _ops.Handle:
    """The op layer's handle behind an integer handle (for `wait(timeout=...)`, `done()`,
    `add_done_callback`); `synchronize(handle)` still returns the result and frees the name."""
    entry = _handle_map.get(handle)
    if entry is None:
        raise ValueError(f"unknown handle {handle}")
    return entry[0]


def _single(res: Any) -> Any:
    return res[0]


def _compress_all(tensors: Sequence[torch.Tensor], compression: Any) -> tuple[list, list]:
    """(compressed tensors, their contexts) of a grouped call's `tensors`; an empty list
    gives two empty lists (unpacking zip(*...) of none raised ValueError)."""
    pairs = [compression.compress(t) for t in tensors]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _traced(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether autograd would record a collective on `tensors`.

    Why: torch.autograd.Function.apply costs ~15 us per call even when nothing needs a
    gradient (metrics, parameters broadcast under no_grad), a third of a small synchronous
    allreduce; without a gradient to record, the differentiable ops run their forward
    directly, with the same result."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---------------------------------------------------------------------- allreduce
def _allreduce_async(tensors: Sequence[torch.Tensor], outputs: Any, name: Optional[str],
                     op: int, prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet, grouped: bool) -> Any:
    handle = _ops.allreduce(tensors, names=name, op=op, prescale=prescale_factor,
                            postscale=postscale_factor, process_set=process_set,
                            group=grouped or None, outputs=outputs)
    return _register(handle, tuple if grouped else _single)


def _check_inplace(tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[int] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Asynchronous average/sum of `tensor` over all ranks; the input is not modified."""
    op = handle_average_backwards_compatibility(op, average)
    out = _ops.output_like(tensor)
    return _allreduce_async([tensor], [out], name, op, prescale_factor, postscale_factor,
                            process_set, grouped=False)


def _allreduce_now(tensor: torch.Tensor, average: Optional[bool], name: Optional[str],
                   op: Optional[int], prescale_factor: float, postscale_factor: float,
                   process_set: ProcessSet) -> Any:
    """A blocking out-of-place allreduce (the op layer's allreduce_now: no handle, and the
    whole call on this thread when the steady state allows)."""
    op = handle_average_backwards_compatibility(op, average)
    out = _ops.output_like(tensor)
    return _ops.allreduce_now(tensor, out, name=name, op=op, prescale=prescale_factor,
                              postscale=postscale_factor, process_set=process_set)


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce with a gradient: the gradient is allreduced the same way."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: Optional[bool], name: Optional[str],
                op: Optional[int], prescale_factor: float, postscale_factor: float,
                process_set: ProcessSet) -> Any:
        ctx.average, ctx.op = average, op
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        ctx.process_set = process_set
        return _allreduce_now(tensor, average, name, op, prescale_factor, postscale_factor,
                              process_set)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        return (allreduce(grad_output, average=ctx.average, op=ctx.op,
                          prescale_factor=ctx.prescale_factor,
                          postscale_factor=ctx.postscale_factor, process_set=ctx.process_set),
                None, None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Average (default) or reduce `tensor` over all ranks; differentiable."""
    compressed, cctx = compression.compress(tensor)
    if _traced((compressed,)):
        reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor,
                                         postscale_factor, process_set)
    else:
        reduced = _allreduce_now(compressed, average, name, op, prescale_factor,
                                 postscale_factor, process_set)
    return compression.decompress(reduced, cctx)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[int] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Asynchronous in-place allreduce."""
    op = handle_average_backwards_compatibility(op, average)
    _check_inplace(tensor)
    # One object as input and output: reduced in place. Detached only where autograd records
    # it or it is a view (the op layer would detach it again, as a different object).
    t = tensor.detach() if tensor.requires_grad or tensor._is_view() else tensor
    return _allreduce_async([t], [t], name, op, prescale_factor,
                            postscale_factor, process_set, grouped=False)


def _allreduce_batch_async(tensors: Sequence[torch.Tensor], names: Any, op: int,
                           prescale_factor: float, postscale_factor: float,
                           process_set: ProcessSet) -> list[int]:
    """In-place allreduces of several contiguous tensors submitted in one call, each its own
    collective under its own name (not a group: nothing ties their release together), as
    that many allreduce_async_ calls would; returns their integer handles, which poll() and
    synchronize() take as any other. (DistributedOptimizer's gradients deferred to the end of
    backpropagation.)"""
    handle = _ops.allreduce(tensors, names=names, op=op, prescale=prescale_factor,
                            postscale=postscale_factor, process_set=process_set,
                            outputs=tensors)
    return [_register(handle, operator.itemgetter(i)) for i in range(len(tensors))]


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns `tensor`."""
    op = handle_average_backwards_compatibility(op, average)
    _check_inplace(tensor)
    # One object as input and output: reduced in place. Detached only where autograd records
    # it (detach() costs ~0.3 us, a noticeable part of a small blocking allreduce).
    t = tensor.detach() if tensor.requires_grad else tensor
    _ops.allreduce_now(t, t, name=name, op=op, prescale=prescale_factor,
                       postscale=postscale_factor, process_set=process_set)
    return tensor


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Asynchronous allreduce of a list of tensors, released (and fused) together."""
    op = handle_average_backwards_compatibility(op, average)
    outs = [_ops.output_like(t) for t in tensors]
    return _allreduce_async(list(tensors), outs, name, op, prescale_factor, postscale_factor,
                            process_set, grouped=True)


def _grouped_now(tensors: list, outputs: Any, average: Optional[bool], name: Optional[str],
                 op: Optional[int], prescale_factor: float, postscale_factor: float,
                 process_set: ProcessSet) -> list:
    """A synchronous grouped allreduce's results (`outputs` None: new tensors), submitted as a
    blocking call (ops.allreduce's `blocking`: small ones may run start to end on this
    thread) and waited for on the op layer's handle: no integer handle to register and pop,
    as the caller never sees one."""
    op = handle_average_backwards_compatibility(op, average)
    if outputs is None:
        outputs = [_ops.output_like(t) for t in tensors]
    return _ops.allreduce(tensors, names=name, op=op, prescale=prescale_factor,
                          postscale=postscale_factor, process_set=process_set, group=True,
                          outputs=outputs, blocking=True).wait()


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, average: Optional[bool], name: Optional[str], op: Optional[int],
                prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                *tensors: torch.Tensor) -> Any:
        ctx.average, ctx.op = average, op
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        ctx.process_set = process_set
        return tuple(_grouped_now(list(tensors), None, average, name, op, prescale_factor,
                                  postscale_factor, process_set))

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> Any:
        grads = grouped_allreduce(list(grad_output), average=ctx.average, op=ctx.op,
                                  prescale_factor=ctx.prescale_factor,
                                  postscale_factor=ctx.postscale_factor,
                                  process_set=ctx.process_set)
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors together; differentiable."""
    compressed, ctxs = _compress_all(tensors, compression)
    with _ops.blocking_name("grouped_allreduce", name, process_set) as name:
        if _traced(compressed):
            reduced = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor,
                                                    postscale_factor, process_set, *compressed)
        else:
            reduced = _grouped_now(list(compressed), None, average, name, op, prescale_factor,
                                   postscale_factor, process_set)
    return [compression.decompress(t, c) for t, c in zip(reduced, ctxs)]


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place `grouped_allreduce_async`: every tensor of `tensors` is overwritten with its
    reduction; returns a handle for `synchronize()`. The group is negotiated and released as
    one unit, so either all of it completes or all of it fails."""
    op = handle_average_backwards_compatibility(op, average)
    for t in tensors:
        _check_inplace(t)
    return _allreduce_async(list(tensors), [t.detach() for t in tensors], name, op,
                            prescale_factor, postscale_factor, process_set, grouped=True)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> tuple[torch.Tensor, ...]:
    """In-place `grouped_allreduce`: reduces every tensor of `tensors` into itself and
    returns them as a tuple."""
    for t in tensors:
        _check_inplace(t)
    with _ops.blocking_name("grouped_allreduce", name, process_set) as name:
        _grouped_now(list(tensors), [t.detach() for t in tensors], average, name, op,
                     prescale_factor, postscale_factor, process_set)
    return tuple(tensors)


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: Optional[int],
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Allreduce a sparse tensor by allgathering its indices and values; returns a callable
    that waits and returns the summed (or averaged) sparse tensor."""
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices_handle = allgather_async(t._indices().transpose(0, 1).contiguous(),
                                     name=f"{name}.indices", process_set=process_set)
    values_handle = allgather_async(t._values().contiguous(), name=f"{name}.values",
                                    process_set=process_set)

    def handle() -> torch.Tensor:
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        if op == Average:
            values = values / (process_set or global_process_set).size()
        if indices.dim() == 0 or values.dim() == 0:
            return t.new().resize_as_(t)
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, t.size())

    return handle


# ---------------------------------------------------------------------- allgather
def _allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str], process_set: ProcessSet,
                     grouped: bool) -> int:
    handle = _ops.allgather(tensors, names=name, process_set=process_set, group=grouped or None)
    return _register(handle, tuple if grouped else _single)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Asynchronous concatenation of every rank's tensor along dimension 0."""
    return _allgather_async([tensor], name, process_set, grouped=False)


class HorovodAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str],
                process_set: ProcessSet) -> Any:
        out = synchronize(allgather_async(tensor, name, process_set))  # (refuses a scalar)
        ctx.dim = tensor.shape[0]
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        ps = ctx.process_set or global_process_set
        grad_reduced = allreduce(grad_output, op=Average, process_set=ps)  # Horovod's definition
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int32), process_set=ps)
        r = ps.rank()
        offset = int(dims[:r].sum().item()) if r > 0 else 0
        return grad_reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0 (first dims may differ); differentiable."""
    with _ops.blocking_name("allgather", name, process_set) as name:
        if _traced((tensor,)):
            return HorovodAllgather.apply(tensor, name, process_set)
        return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Allgather every tensor of `tensors` along dimension 0, as one group; returns a handle
    whose `synchronize()` gives the gathered tensors in the same order."""
    return _allgather_async(list(tensors), name, process_set, grouped=True)


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], process_set: ProcessSet,
                *tensors: torch.Tensor) -> Any:
        out = tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))
        ctx.dims = [t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ps = ctx.process_set or global_process_set
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ps)
        dims = allgather(torch.tensor([ctx.dims], dtype=torch.int32), process_set=ps)
        r = ps.rank()
        out = []
        for i, g in enumerate(reduced):
            offset = int(dims[:r, i].sum().item()) if r > 0 else 0
            out.append(g.narrow(0, offset, ctx.dims[i]))
        return (None, None, *out)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather every tensor of `tensors` along dimension 0 (ranks may differ in that
    dimension only), as one group; differentiable. Returns the gathered tensors in order."""
    with _ops.blocking_name("grouped_allgather", name, process_set) as name:
        if _traced(tensors):
            return HorovodGroupedAllgather.apply(name, process_set, *tensors)
        return synchronize(grouped_allgather_async(list(tensors), name, process_set))


# ---------------------------------------------------------------------- broadcast
def _broadcast_async(tensor: torch.Tensor, output: torch.Tensor, root_rank: int,
                     name: Optional[str], process_set: ProcessSet) -> int:
    handle = _ops.broadcast([tensor], root_rank, names=name, process_set=process_set,
                            outputs=[output])
    return _register(handle, _single)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Asynchronous broadcast from `root_rank` (a global rank); the input is not modified."""
    out = _ops.output_like(tensor)
    return _broadcast_async(tensor, out, root_rank, name, process_set)


class HorovodBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: ProcessSet) -> Any:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        grad_reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if _basics.rank() != ctx.root_rank:
            grad_reduced = grad_reduced * 0
        return grad_reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Broadcast `tensor` from `root_rank`; differentiable."""
    with _ops.blocking_name("broadcast", name, process_set) as name:
        if _traced((tensor,)):
            return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place asynchronous broadcast: `tensor` is overwritten with `root_rank`'s; returns a
    handle for `synchronize()`."""
    _check_inplace(tensor)
    return _broadcast_async(tensor, tensor.detach(), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast; returns `tensor`."""
    with _ops.blocking_name("broadcast", name, process_set) as name:
        synchronize(broadcast_async_(tensor, root_rank, name, process_set))
    return tensor


# ---------------------------------------------------------------------- alltoall
def _split_list(splits: Any) -> Any:
    """Splits as (values, dtype name): Horovod reads splits as int32 (a list becomes
    torch.tensor(splits, dtype=torch.int32)); a tensor of another dtype is refused by the op layer
    before anything is sent, not reinterpreted."""
    if splits is None:
        return None, None
    if isinstance(splits, torch.Tensor):
        return splits.reshape(-1).tolist(), str(splits.dtype).replace("torch.", "")
    return torch.tensor(splits, dtype=torch.int32).reshape(-1).tolist(), "int32"


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Asynchronous alltoall: rows splits[i] of `tensor` go to rank i of the set."""
    split_list, split_dtype = _split_list(splits)
    handle = _ops.alltoall(tensor, split_list, names=name, process_set=process_set,
                           splits_dtype=split_dtype)

    def post(res: Any) -> Any:
        out, recv = res
        if isinstance(splits, torch.Tensor):
            recv = recv.to(dtype=splits.dtype)
        return out, recv

    return _register(handle, post)


class HorovodAlltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str],
                process_set: ProcessSet) -> Any:
        output, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set = process_set
        ctx.recvsplits = received_splits
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *dead_gradients: Any) -> Any:
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.recvsplits,
                           process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatter rows of `tensor` to every rank and gather theirs; returns the output, plus the
    received splits when `splits` is given. Differentiable."""
    if _traced((tensor,)):
        return HorovodAlltoall.apply(tensor, splits, name, process_set)
    output, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received_splits)


# ---------------------------------------------------------------------- reducescatter
def _reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str], op: int,
                         process_set: ProcessSet, prescale_factor: float, postscale_factor: float,
                         grouped: bool) -> int:
    handle = _ops.reducescatter(tensors, names=name, op=op, prescale=prescale_factor,
                                postscale=postscale_factor, process_set=process_set,
                                group=grouped or None)
    return _register(handle, tuple if grouped else _single)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Asynchronous reduce of `tensor` over ranks, each rank keeping its slice of dimension 0
    (the first dim % size ranks get one row more)."""
    return _reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                postscale_factor, grouped=False)


class HorovodReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: int,
                process_set: ProcessSet, prescale_factor: float, postscale_factor: float) -> Any:
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        grad = allgather(grad_output.contiguous(), process_set=ctx.process_set)
        factor = _reducescatter_grad_factor(ctx)
        return (grad * factor if factor != 1.0 else grad), None, None, None, None, None


def _reducescatter_grad_factor(ctx: Any) -> float:
    """What a reducescatter's gradient is multiplied by, as Horovod's backward does: the set's
    size for Sum (Horovod's definition), and both scale factors, which scale the forward
    result linearly. (Before, the scale factors were left out: a reducescatter with
    prescale_factor=2 got half its gradient.)"""
    factor = float((ctx.process_set or global_process_set).size()) if ctx.op == Sum else 1.0
    return factor * ctx.prescale_factor * ctx.postscale_factor


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Any = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce-scatter along dimension 0; differentiable."""
    compressed, cctx = compression.compress(tensor)
    with _ops.blocking_name("reducescatter", name, process_set) as name:
        if _traced((compressed,)):
            out = HorovodReducescatter.apply(compressed, name, op, process_set,
                                             prescale_factor, postscale_factor)
        else:
            out = synchronize(reducescatter_async(compressed, name, op, process_set,
                                                  prescale_factor, postscale_factor))
    return compression.decompress(out, cctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Reduce-scatter every tensor of `tensors` as one group (`op` Average or Sum); returns a
    handle whose `synchronize()` gives each rank its slice of each reduction, in order."""
    return _reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                postscale_factor, grouped=True)


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: int, process_set: ProcessSet,
                prescale_factor: float, postscale_factor: float, *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ps = ctx.process_set or global_process_set
        out = grouped_allgather([g.contiguous() for g in grads], process_set=ps)
        factor = _reducescatter_grad_factor(ctx)
        if factor != 1.0:
            out = [g * factor for g in out]
        return (None, None, None, None, None, *out)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter every tensor of `tensors` as one group: each rank gets its slice of
    dimension 0 of each reduction (`op` Average or Sum); differentiable."""
    compressed, ctxs = _compress_all(tensors, compression)
    with _ops.blocking_name("grouped_reducescatter", name, process_set) as name:
        if _traced(compressed):
            outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                                     postscale_factor, *compressed)
        else:
            outs = synchronize(grouped_reducescatter_async(list(compressed), name, op,
                                                           process_set, prescale_factor,
                                                           postscale_factor))
    return [compression.decompress(t, c) for t, c in zip(outs, ctxs)]


# ---------------------------------------------------------------------- control
def poll(handle: int) -> bool:
    """True when the operation behind `handle` has finished (synchronize will not block)."""
    return get_handle(handle).done()


def synchronize(handle: int) -> Any:
    """Wait for the operation and return its result; raises HorovodInternalError on failure."""
    with _handle_lock:
        entry = _handle_map.pop(handle, None)
    if entry is None:
        return None
    h, post = entry
    return post(h.wait())


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; until every rank has joined, this rank
    contributes zeros to other ranks' allreduces. Returns the rank that joined last."""
    return _ops.join().wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set has reached the barrier."""
    _ops.barrier(process_set).wait()


def _reset() -> None:
    """Forget handles (shutdown/init)."""
    with _handle_lock:
        _handle_map.clear()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initialize hvdlite (Horovod's `hvd.init`)."""
    _reset()
    _basics.init(comm, process_sets)


def shutdown() -> None:
    """Shut hvdlite down; `init()` may be called again afterwards."""
    _basics.shutdown()
    _reset()


__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_async",
    "allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier", "HorovodInternalError",
    "ProcessSet", "global_process_set",
]
