"""Horovod's collectives on jax.Arrays, with horovod.torch's names and signatures.

Each call goes through the op layer (`common/ops.py`), so naming, the cross-rank checks (dtype,
shape, op, root), fusion, the response cache and the errors are those of every frontend. Eagerly
an array crosses over DLPack without a copy; inside `jax.jit` a call is an ordered host callback
(bridge.py). Inside a trace, `allreduce` and `grouped_allreduce` are differentiable (their
gradient is reduced the same way, as Horovod's); shapes must be static there, so `allgather`
assumes every rank's first dimension is this rank's, and `alltoall` takes equal splits only.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..common import basics as _basics
from ..common import ops as _cops
from ..common.basics import (ccl_built, cross_rank, cross_size, cuda_built,  # noqa: F401
                             ddl_built, gloo_built, gloo_enabled, is_homogeneous,
                             is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rank, rocm_built, size,
                             start_timeline, stop_timeline)
from ..common.ops import add_process_set, remove_process_set  # noqa: F401
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from ..common.messages import (ADASUM, AVERAGE, MAX, MIN, PRODUCT, SUM,
                               handle_average_backwards_compatibility)
from ..common.process_sets import ProcessSet, global_process_set  # noqa: F401
from . import bridge as _bridge
from .bridge import (check_dtypes, host_call, member_names, set_id, shape_dtype, traced,
                     wire_name)
from .compression import Compression

Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT


def init(comm=None, process_sets=None) -> None:
    """Initialize hvdlite (Horovod's `hvd.init`)."""
    _basics.init(comm, process_sets)


def shutdown() -> None:
    """Shut hvdlite down; `init()` may be called again afterwards."""
    _basics.shutdown()


def _set_ranks(sid: int) -> list:
    return _cops.set_ranks(sid)


def _set_rank(sid: int) -> int:
    ranks = _set_ranks(sid)
    me = _basics.rank()
    return ranks.index(me) if me in ranks else -1


def _arrays(xs) -> list:
    return [x if isinstance(x, (jax.Array, jax.core.Tracer)) else jnp.asarray(x) for x in xs]


# ---------------------------------------------------------------------- allreduce
def _allreduce_fn(names: list, op: int, pre: float, post: float, sid: int, cacheable: bool,
                  group: Optional[str]):
    def run(*bufs):
        if len(bufs) == 1 and group is None and cacheable:
            # One named array: the op layer's blocking call (ops.allreduce_now), which runs the
            # whole collective on this thread when the steady state allows.
            out = _cops.output_like(bufs[0])
            return [_cops.allreduce_now(bufs[0], out, name=names[0], op=op, prescale=pre,
                                        postscale=post, process_set=sid)]
        return _cops.allreduce(list(bufs), names=names, op=op, prescale=pre, postscale=post,
                               process_set=sid, group=group, cacheable=cacheable,
                               blocking=True).wait()
    return run


def _reduce(xs: list, wire: str, cacheable: bool, op: int, pre: float, post: float, sid: int,
            grouped: bool) -> list:
    names = member_names(wire, len(xs)) if grouped else [wire]
    group = wire if grouped else None
    fn = _allreduce_fn(names, op, pre, post, sid, cacheable, group)
    return host_call(fn, xs, [shape_dtype(x) for x in xs],
                     check_dtypes("allreduce", names, sid, True, group))


def _reduce_differentiable(xs: list, wire: str, cacheable: bool, op: int, pre: float,
                           post: float, sid: int, grouped: bool) -> list:
    """`_reduce`, differentiable while tracing: the gradient is reduced the same way (Horovod's
    definition), under the name `<wire>.grad`."""
    if not traced(xs) or not any(jnp.issubdtype(x.dtype, jnp.inexact) for x in xs):
        return _reduce(xs, wire, cacheable, op, pre, post, sid, grouped)

    @jax.custom_vjp
    def reduced(*ys):
        return tuple(_reduce(list(ys), wire, cacheable, op, pre, post, sid, grouped))

    def forward(*ys):
        return reduced(*ys), None

    def backward(_, grads):
        return tuple(_reduce(list(grads), wire + ".grad", cacheable, op, pre, post, sid,
                             grouped))

    reduced.defvjp(forward, backward)
    return list(reduced(*xs))


def allreduce(tensor, average=None, name: Optional[str] = None, compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set=global_process_set):
    """Average (default) or reduce `tensor` over the ranks of `process_set`."""
    op = handle_average_backwards_compatibility(op, average)
    (tensor,) = _arrays([tensor])
    compressed, ctx = compression.compress(tensor)
    sid = set_id(process_set)
    with wire_name("allreduce", name, sid, traced([compressed])) as (wire, cacheable):
        (out,) = _reduce_differentiable([compressed], wire, cacheable, op,
                                        float(prescale_factor), float(postscale_factor), sid,
                                        grouped=False)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name: Optional[str] = None,
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=global_process_set) -> list:
    """Reduce a list of arrays together (released and fused as one group)."""
    op = handle_average_backwards_compatibility(op, average)
    tensors = _arrays(tensors)
    sid = set_id(process_set)
    if not tensors:
        if not traced(tensors):
            with wire_name("grouped_allreduce", name, sid, False) as (wire, _):
                _cops.allreduce([], process_set=sid, group=wire).wait()
        return []
    moved = [compression.compress(t) for t in tensors]
    with wire_name("grouped_allreduce", name, sid, traced(tensors)) as (wire, cacheable):
        outs = _reduce_differentiable([m[0] for m in moved], wire, cacheable, op,
                                      float(prescale_factor), float(postscale_factor), sid,
                                      grouped=True)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, moved)]


# ---------------------------------------------------------------------- allgather
def _gathered(xs: list, sid: int) -> list:
    n = len(_set_ranks(sid))
    return [shape_dtype(x, (x.shape[0] * n,) + tuple(x.shape[1:])) for x in xs]


def _allgather_fn(names: list, sid: int, cacheable: bool, group, expected: Optional[list]):
    def run(*bufs):
        outs = _cops.allgather(list(bufs), names=names, process_set=sid, group=group,
                               cacheable=cacheable).wait()
        if expected is not None:
            for nm, o, e in zip(names, outs, expected):
                if tuple(o.shape) != tuple(e.shape):
                    raise ValueError(
                        f"allgather of {nm} inside jax.jit: the ranks' first dimensions differ "
                        f"(gathered {tuple(o.shape)}, this rank's shape times the set size is "
                        f"{tuple(e.shape)}); a compiled function needs static shapes: gather "
                        f"arrays of unequal first dimensions outside jit")
        return outs
    return run


def _allgather(xs: list, wire: str, cacheable: bool, sid: int, grouped: bool) -> list:
    for x in xs:
        if np.ndim(x) == 0:
            if not traced(xs):
                _cops.refuse("allgather", member_names(wire, len(xs)) if grouped else [wire],
                             ValueError("allgather needs a tensor with at least one "
                                        "dimension; reshape the scalar to [1]"),
                             process_set=sid, group=wire if grouped else None)
            raise ValueError("allgather needs a tensor with at least one dimension; reshape "
                             "the scalar to [1]")
    names = member_names(wire, len(xs)) if grouped else [wire]
    expected = _gathered(xs, sid)
    fn = _allgather_fn(names, sid, cacheable, wire if grouped else None,
                       expected if traced(xs) else None)
    return host_call(fn, xs, expected,
                     check_dtypes("allgather", names, sid, False, wire if grouped else None))


def allgather(tensor, name: Optional[str] = None, process_set=global_process_set):
    """Concatenate every rank's array along dimension 0 (eagerly first dimensions may
    differ; inside jit they must be equal)."""
    (tensor,) = _arrays([tensor])
    sid = set_id(process_set)
    with wire_name("allgather", name, sid, traced([tensor])) as (wire, cacheable):
        return _allgather([tensor], wire, cacheable, sid, grouped=False)[0]


def grouped_allgather(tensors, name: Optional[str] = None,
                      process_set=global_process_set) -> list:
    """Allgather a list of arrays together (released and fused as one group)."""
    tensors = _arrays(tensors)
    sid = set_id(process_set)
    if not tensors:
        if not traced(tensors):
            with wire_name("grouped_allgather", name, sid, False) as (wire, _):
                _cops.allgather([], process_set=sid, group=wire).wait()
        return []
    with wire_name("grouped_allgather", name, sid, traced(tensors)) as (wire, cacheable):
        return _allgather(tensors, wire, cacheable, sid, grouped=True)


# ---------------------------------------------------------------------- broadcast
def _broadcast(xs: list, root_rank: int, wire: str, cacheable: bool, sid: int,
               grouped: bool) -> list:
    names = member_names(wire, len(xs)) if grouped else [wire]

    def run(*bufs):
        return _cops.broadcast(list(bufs), root_rank, names=names, process_set=sid,
                               group=wire if grouped else None, cacheable=cacheable).wait()

    return host_call(run, xs, [shape_dtype(x) for x in xs],
                     check_dtypes("broadcast", names, sid, False, wire if grouped else None))


def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              process_set=global_process_set):
    """`root_rank`'s array (a global rank), on every rank of the set."""
    (tensor,) = _arrays([tensor])
    sid = set_id(process_set)
    with wire_name("broadcast", name, sid, traced([tensor])) as (wire, cacheable):
        return _broadcast([tensor], int(root_rank), wire, cacheable, sid, grouped=False)[0]


def broadcast_parameters(params: Any, root_rank: int = 0, name: Optional[str] = None,
                         process_set=global_process_set) -> Any:
    """`root_rank`'s values of a pytree of arrays (model parameters, an optimizer state), on
    every rank: one grouped broadcast, its members named by their paths in the tree, so ranks
    whose trees differ fail at once naming one path from each side. Returns a new pytree (JAX
    arrays are immutable)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [jax.tree_util.keystr(p) for p, _ in leaves]
    values = _arrays([v for _, v in leaves])
    sid = set_id(process_set)
    base = name or "jax.broadcast_parameters"
    if not values:
        if not traced(values):
            _cops.broadcast([], int(root_rank), names=base, process_set=sid, group=base).wait()
        return params
    names = [f"{base}{p}" for p in paths]

    def run(*bufs):
        return _cops.broadcast(list(bufs), int(root_rank), names=names, process_set=sid,
                               group=base).wait()

    outs = host_call(run, values, [shape_dtype(x) for x in values],
                     check_dtypes("broadcast", names, sid, False, base))
    return jax.tree_util.tree_unflatten(treedef, outs)


# ---------------------------------------------------------------------- alltoall
def alltoall(tensor, splits=None, name: Optional[str] = None, process_set=global_process_set):
    """Rows `splits[i]` go to set rank i (default: equal parts). Returns (output, received
    splits); inside jit only equal parts (the output's shape must be static)."""
    (tensor,) = _arrays([tensor])
    sid = set_id(process_set)
    n = len(_set_ranks(sid))
    tracing = traced([tensor])
    if tracing and splits is not None:
        raise ValueError("alltoall inside jax.jit takes equal splits only (splits=None): the "
                         "rows a rank receives decide its output's shape, which a compiled "
                         "function must know; call alltoall with splits outside jit")
    split_list = None
    if splits is not None:
        split_list = [int(s) for s in np.asarray(splits).reshape(-1).tolist()]
    if tracing and (np.ndim(tensor) == 0 or tensor.shape[0] % n != 0):
        # (Eagerly the op layer checks the same and tells the other ranks.)
        raise ValueError("alltoall needs a tensor with at least one dimension" if
                         np.ndim(tensor) == 0 else
                         f"alltoall: the first dimension of the tensor ({tensor.shape[0]}) "
                         f"does not divide evenly among the {n} ranks of the process set")
    with wire_name("alltoall", name, sid, tracing) as (wire, _):
        def run(buf):
            out, recv = _cops.alltoall(buf, split_list, names=[wire], process_set=sid).wait()
            return [out, recv]

        results = [shape_dtype(tensor), jax.ShapeDtypeStruct((n,), jnp.int32)]
        out, recv = host_call(run, [tensor], results,
                              check_dtypes("alltoall", [wire], sid, False))
        return out, recv


# ---------------------------------------------------------------------- reducescatter
def _scattered(x, sid: int) -> jax.ShapeDtypeStruct:
    n, me = len(_set_ranks(sid)), _set_rank(sid)
    rows = x.shape[0] // n + (1 if me < x.shape[0] % n else 0)
    return shape_dtype(x, (rows,) + tuple(x.shape[1:]))


def _reducescatter(xs: list, wire: str, cacheable: bool, op: int, pre: float, post: float,
                   sid: int, grouped: bool) -> list:
    names = member_names(wire, len(xs)) if grouped else [wire]
    if any(np.ndim(x) == 0 for x in xs):
        exc = ValueError("reducescatter needs a tensor with at least one dimension")
        if not traced(xs):
            _cops.refuse("reducescatter", names, exc, process_set=sid,
                         group=wire if grouped else None)
        raise exc

    def run(*bufs):
        return _cops.reducescatter(list(bufs), names=names, op=op, prescale=pre, postscale=post,
                                   process_set=sid, group=wire if grouped else None,
                                   cacheable=cacheable).wait()

    return host_call(run, xs, [_scattered(x, sid) for x in xs],
                     check_dtypes("reducescatter", names, sid, True, wire if grouped else None))


def reducescatter(tensor, name: Optional[str] = None, compression=Compression.none,
                  op=Average, process_set=global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0):
    """Reduce over the set; each rank keeps its slice of dimension 0."""
    (tensor,) = _arrays([tensor])
    compressed, ctx = compression.compress(tensor)
    sid = set_id(process_set)
    with wire_name("reducescatter", name, sid, traced([compressed])) as (wire, cacheable):
        (out,) = _reducescatter([compressed], wire, cacheable, op, float(prescale_factor),
                                float(postscale_factor), sid, grouped=False)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name: Optional[str] = None, compression=Compression.none,
                          op=Average, process_set=global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """Reducescatter a list of arrays together."""
    tensors = _arrays(tensors)
    sid = set_id(process_set)
    if not tensors:
        if not traced(tensors):
            with wire_name("grouped_reducescatter", name, sid, False) as (wire, _):
                _cops.reducescatter([], process_set=sid, group=wire).wait()
        return []
    moved = [compression.compress(t) for t in tensors]
    with wire_name("grouped_reducescatter", name, sid, traced(tensors)) as (wire, cacheable):
        outs = _reducescatter([m[0] for m in moved], wire, cacheable, op,
                              float(prescale_factor), float(postscale_factor), sid, grouped=True)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, moved)]


# ---------------------------------------------------------------------- control and objects
def join() -> int:
    """This rank has no more data: it contributes zeros to the other ranks' allreduces until
    every rank has joined. Returns the rank that joined last. (Eagerly only.)"""
    return _cops.join().wait()


def barrier(process_set=global_process_set) -> None:
    """Return once every rank of the set has reached it. (Eagerly only.)"""
    _cops.barrier(set_id(process_set)).wait()


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Pickle `obj` on `root_rank` and return it on every rank of the set."""
    return _cops.broadcast_object(obj, root_rank, name=name, process_set=set_id(process_set))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set=global_process_set) -> list:
    """Every rank's `obj`, in set-rank order."""
    return _cops.allgather_object(obj, name=name, process_set=set_id(process_set))


def callback_error() -> Optional[BaseException]:
    """The hvdlite exception behind the last failed collective inside jit (it reached the
    caller as jax.errors.JaxRuntimeError carrying its message)."""
    return _bridge.callback_error()


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max",
    "Product", "Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather",
    "broadcast", "broadcast_parameters", "alltoall", "reducescatter", "grouped_reducescatter",
    "join", "barrier", "broadcast_object", "allgather_object", "callback_error",
    "HorovodInternalError", "HostsUpdatedInterrupt",
]
