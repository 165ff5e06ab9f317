"""TensorFlow collectives with Horovod's names and signatures (horovod.tensorflow.mpi_ops).

Executing eagerly, a collective hands the tensor's buffer to the op layer (`common/ops.py`;
DLPack, no copy; see bridge.py) and waits. Inside a graph (`tf.function`, Keras `model.fit`, TF1
graphs) the same Python runs as a `tf.py_function` node: TensorFlow calls it each time the graph
runs. Inside `tf.function` such nodes run in program order (automatic control dependencies
chain stateful ops), so every rank submits its collectives in the same order; in TF1 graphs
hvdlite chains them itself.

Names are what the engine matches across ranks. Unnamed eager calls are named by their call site
(`bridge.wire_name`: the line alone, cached, as a named call is); unnamed graph ops get a
per-graph counter at trace time ("HorovodAllreduce", "HorovodAllreduce_1", ...), which is the same
on every rank because every rank traces the same code, and stays the same for every run of the
graph (so the response cache serves them).

XLA cannot call Python: inside `jit_compile=True` every collective raises at trace time, saying so.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from ..common import basics as _basics
from ..common import ops as _cops
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
from .bridge import (_BITCAST, _DTYPE_NAMES, _REDUCIBLE, _XLA_MESSAGE, _check_graph,  # noqa: F401
                     _check_reduce_op, _differentiable, _dtype_name,
                     _in_xla, _movable, _rt_allgather, _rt_allreduce, _rt_alltoall,
                     _rt_broadcast, _rt_reducescatter, _run, _set_id, _set_rank, _set_ranks,
                     _set_size, _to_tf, _to_torch, _unique_in_graph, _wire_name, filled,
                     gather_shape, refusing, wire_name, with_gradient)
from .compression import Compression
from .errors import call_eager as _call_eager
from .errors import eager_errors as _eager_errors

Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initialize hvdlite (Horovod's `hvd.init`). `process_sets` is a list of ProcessSet, or
    "dynamic" to allow add_process_set/remove_process_set later. (Here, as in Horovod's
    horovod.tensorflow.mpi_ops, with the other basics.)"""
    _basics.init(comm, process_sets)


def shutdown() -> None:
    """Shut hvdlite down; `init()` may be called again afterwards."""
    _basics.shutdown()


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """True when `num_rank` is a power of two (Horovod's Adasum precondition)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def _executing_eagerly() -> bool:
    return tf.executing_eagerly()


# ---------------------------------------------------------------------- allreduce
def _allreduce(tensor: tf.Tensor, name: Optional[str] = None, op: int = Sum,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               ignore_name_scope: bool = False,
               process_set: ProcessSet = global_process_set) -> Any:
    """Reduce a dense tensor over the ranks of `process_set` (default op: Sum); differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    set_id = _set_id(process_set)
    _check_graph("hvd.allreduce")
    with wire_name("Allreduce", name, ignore_name_scope, set_id) as (wire, cacheable):
        with refusing("allreduce", [wire], set_id):
            _dtype_name(tensor.dtype, True, "allreduce")
            _check_reduce_op(op, set_id, [tensor.dtype])
        return _allreduce_named(tensor, wire, cacheable, op, float(prescale_factor),
                                float(postscale_factor), set_id)


def _allreduce_named(tensor: tf.Tensor, wire: Any, cacheable: Optional[bool], op: int, pre: float,
                     post: float, set_id: int) -> Any:
    return _grouped_allreduce_named([tensor], wire, cacheable, op, pre, post, set_id,
                                    grouped=False)[0]


def _empty_grouped(kind: str, op_kind: str, name: Optional[str], ignore_name_scope: bool,
                   process_set: ProcessSet) -> list:
    """A grouped call of no tensors (`kind`: its wire-name kind; `op_kind`: the op layer's
    collective): eagerly, this rank's part still goes to the other ranks under the call's
    group (common.ops._empty_group), so ranks that pass tensors fail at once with both
    counts, where they waited for this one until the stall shutdown. In a graph, nothing (a
    node of no tensors would add a collective to every run of it). Result: []."""
    if tf.executing_eagerly():
        set_id = _set_id(process_set)
        with wire_name(kind, name, ignore_name_scope, set_id) as (wire, _):
            # (Errors as the collective's own: Horovod's TF classes, _run.)
            _call_eager(lambda: getattr(_cops, op_kind)([], process_set=set_id,
                                                        group=wire).wait(), [])
    return []


def _grouped_allreduce(tensors: Sequence[tf.Tensor], name: Optional[str] = None, op: int = Sum,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       ignore_name_scope: bool = False,
                       process_set: ProcessSet = global_process_set) -> Any:
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return _empty_grouped("GroupedAllreduce", "allreduce", name, ignore_name_scope,
                              process_set)
    set_id = _set_id(process_set)
    _check_graph("hvd.grouped_allreduce")
    with wire_name("GroupedAllreduce", name, ignore_name_scope, set_id) as (wire, cacheable):
        with refusing("allreduce", _member_names(wire, len(tensors)), set_id, wire):
            for t in tensors:
                _dtype_name(t.dtype, True, "grouped_allreduce")
            _check_reduce_op(op, set_id, [t.dtype for t in tensors])
        return _grouped_allreduce_named(tensors, wire, cacheable, op, float(prescale_factor),
                                        float(postscale_factor), set_id)


def _member_names(wire: str, n: int) -> list:
    """The wire names of a grouped call's members (and of broadcast_group's tensors)."""
    return [f"{wire}.{i}" for i in range(n)]


def _grouped_allreduce_named(tensors: Sequence[tf.Tensor], wire: Any, cacheable: Optional[bool],
                             op: int, pre: float, post: float, set_id: int,
                             grouped: bool = True) -> Any:
    names = _member_names(wire, len(tensors)) if grouped else [wire]
    what = "HorovodGroupedAllreduce" if grouped else "HorovodAllreduce"

    def forward(*xs: Any) -> Any:
        return _run(what, lambda *ys: _rt_allreduce(list(ys), names, op, pre, post, set_id,
                                                    cacheable, group=wire if grouped else None),
                    list(xs), [x.dtype for x in xs], [x.shape for x in xs])

    def grad(xs: Any, outs: Any, dys: Any) -> Any:
        # Horovod's definition: the gradient is reduced the same way.
        return _grouped_allreduce_named(filled(dys, xs), wire + ".grad", cacheable, op, pre,
                                        post, set_id, grouped)

    return with_gradient(forward, grad, list(tensors))


def _sparse_allreduce(slices: Any, op: int, name: Optional[str], process_set: ProcessSet,
                      ignore_name_scope: bool, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> Any:
    """An IndexedSlices 'allreduce': two allgathers (values, indices); Average divides by the
    set size at run time."""
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not currently support sparse "
                                  "tensors. As a workaround please pass sparse_as_dense=True to "
                                  "DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = tf.convert_to_tensor(slices.values)
    indices = tf.convert_to_tensor(slices.indices)
    set_id = _set_id(process_set)
    _check_graph("hvd.allreduce (tf.IndexedSlices)")
    with wire_name("Allreduce", name, ignore_name_scope, set_id) as (wire, cacheable):
        with refusing("allgather", [f"{wire}.values", f"{wire}.indices"], set_id):
            _dtype_name(values.dtype, True, "allreduce of tf.IndexedSlices")
        new_values, new_indices = _sparse_allreduce_named(values, indices, wire, cacheable, op,
                                                          set_id)
        return tf.IndexedSlices(new_values, new_indices, dense_shape=slices.dense_shape)


def _sparse_allreduce_named(values: Any, indices: Any, wire: Any, cacheable: Optional[bool],
                            op: int, set_id: int) -> Any:
    def fn(v: Any, i: Any) -> Any:
        return _rt_allgather([v, i], [f"{wire}.values", f"{wire}.indices"], set_id, cacheable)

    vshape = tf.TensorShape([None]).concatenate(values.shape[1:])
    gv, gi = _run("HorovodSparseAllreduce", fn, [values, indices], [values.dtype, indices.dtype],
                  [vshape, tf.TensorShape([None])])
    if op == Average:
        # Horovod divides with TensorFlow's `/`: integer values become floating (true division).
        gv = gv / tf.cast(size_op(set_id), gv.dtype)
    return gv, gi


# ---------------------------------------------------------------------- allgather
@_eager_errors
def allgather(tensor: tf.Tensor, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dimension 0 (first dimensions may differ);
    differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    set_id = _set_id(process_set)
    _check_graph("hvd.allgather")
    with wire_name("Allgather", name, ignore_name_scope, set_id) as (wire, cacheable):
        with refusing("allgather", [wire], set_id):
            if tensor.shape.rank == 0:
                raise ValueError("allgather needs a tensor with at least one dimension; "
                                 "reshape the scalar to [1]")
            tensor, restore = _movable(tensor, "allgather")
        return restore(_allgather_named(tensor, wire, cacheable, set_id))


def _allgather_named(tensor: tf.Tensor, wire: Any, cacheable: Optional[bool], set_id: int) -> Any:
    return _grouped_allgather_named([tensor], wire, cacheable, set_id, grouped=False)[0]


def _gather_grad(dys: Any, xs: Any, wires: Any, cacheable: Optional[bool], set_id: int) -> list:
    """Horovod's allgather gradient: average the incoming gradient over the set, then keep this
    rank's rows (offsets from an allgather of every rank's first dimension)."""
    def fn(*args: Any) -> Any:
        n = len(dys)
        grads, dims = list(args[:n]), list(args[n:])
        reduced = _rt_allreduce(grads, [f"{w}" for w in wires], Average, 1.0, 1.0, set_id,
                                cacheable)
        all_dims = _rt_allgather([tf.reshape(d, [1]) for d in dims],
                                 [f"{w}.dims" for w in wires], set_id, cacheable)
        me = _set_rank(set_id)
        out = []
        for g, d in zip(reduced, all_dims):
            d = d.numpy().tolist()
            start = int(sum(d[:me]))
            out.append(g[start:start + int(d[me])])
        return out

    dims = [tf.shape(x, out_type=tf.int64)[0] for x in xs]
    return _run("HorovodAllgatherGrad", fn, list(dys) + dims, [dy.dtype for dy in dys],
                [x.shape for x in xs])


@_eager_errors
def grouped_allgather(tensors: Sequence[tf.Tensor], name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather a list of tensors together (released and fused as one group);
    differentiable."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return _empty_grouped("GroupedAllgather", "allgather", name, ignore_name_scope,
                              process_set)
    set_id = _set_id(process_set)
    _check_graph("hvd.grouped_allgather")
    with wire_name("GroupedAllgather", name, ignore_name_scope, set_id) as (wire, cacheable):
        with refusing("allgather", _member_names(wire, len(tensors)), set_id, wire):
            for t in tensors:
                if t.shape.rank == 0:
                    raise ValueError("grouped_allgather needs tensors with at least one "
                                     "dimension")
            moved = [_movable(t, "grouped_allgather") for t in tensors]
        outs = _grouped_allgather_named([m[0] for m in moved], wire, cacheable, set_id)
        return [restore(o) for o, (_, restore) in zip(outs, moved)]


def _grouped_allgather_named(tensors: Sequence[tf.Tensor], wire: Any, cacheable: Optional[bool],
                             set_id: int, grouped: bool = True) -> Any:
    names = _member_names(wire, len(tensors)) if grouped else [wire]
    what = "HorovodGroupedAllgather" if grouped else "HorovodAllgather"

    def forward(*xs: Any) -> Any:
        return _run(what, lambda *ys: _rt_allgather(list(ys), names, set_id, cacheable,
                                                    group=wire if grouped else None),
                    list(xs), [x.dtype for x in xs], [gather_shape(x) for x in xs])

    def grad(xs: Any, outs: Any, dys: Any) -> Any:
        return _gather_grad(filled(dys, outs), xs, [f"{n}.grad" for n in names], cacheable,
                            set_id)

    return with_gradient(forward, grad, list(tensors))


# ---------------------------------------------------------------------- broadcast
@_eager_errors
def broadcast(tensor: tf.Tensor, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Broadcast `tensor` from `root_rank` (a global rank) to every rank of the set;
    differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    set_id = _set_id(process_set)
    _check_graph("hvd.broadcast")
    with wire_name("Broadcast", name, ignore_name_scope, set_id) as (wire, cacheable):
        with refusing("broadcast", [wire], set_id):
            tensor, restore = _movable(tensor, "broadcast")
        return restore(_broadcast_named(tensor, int(root_rank), wire, cacheable, set_id))


def _broadcast_named(tensor: tf.Tensor, root_rank: int, wire: Any, cacheable: Optional[bool],
                     set_id: int) -> Any:
    def forward(x: Any) -> Any:
        return _run("HorovodBroadcast", lambda y: _rt_broadcast([y], [wire], root_rank, set_id,
                                                                cacheable),
                    [x], [x.dtype], [x.shape])

    def grad(xs: Any, outs: Any, dys: Any) -> Any:
        def gfn(g: Any) -> Any:
            (red,) = _rt_allreduce([g], [wire + ".grad"], Average, 1.0, 1.0, set_id, cacheable)
            return [red if _basics.rank() == root_rank else tf.zeros_like(red)]

        (dy,) = filled(dys, outs)
        return _run("HorovodBroadcastGrad", gfn, [dy], [dy.dtype], [dy.shape])

    return with_gradient(forward, grad, [tensor])[0]


def _tf_variable(var: Any) -> Any:
    """The tf.Variable behind a tf.Variable or a Keras 3 variable (None for anything else)."""
    if isinstance(var, tf.Variable):
        return var
    inner = getattr(var, "value", None)
    return inner if isinstance(inner, tf.Variable) else None


def _read(var: Any) -> Any:
    v = _tf_variable(var)
    return v.read_value() if v is not None else tf.convert_to_tensor(var)


def broadcast_(variables: Any, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast `variables` in place from `root_rank`; returns their new values."""
    single = not isinstance(variables, (list, tuple))
    variables = [variables] if single else list(variables)
    if not variables and not tf.executing_eagerly():
        return []
    # (Eagerly an empty list still takes part: broadcast_group.)
    tf_vars = [_tf_variable(v) for v in variables]
    for v, tv in zip(variables, tf_vars):
        if tv is None:
            raise ValueError(f"broadcast_ needs variables (tf.Variable or keras.Variable), got "
                             f"{type(v).__name__}; use hvd.broadcast for tensors")
    values = broadcast_group([tv.read_value() for tv in tf_vars], root_rank, name=name,
                             process_set=process_set, kind="BroadcastInplace")
    assigns = [tv.assign(value, read_value=False) for tv, value in zip(tf_vars, values)]
    if tf.executing_eagerly():
        out = [tv.read_value() for tv in tf_vars]
    else:
        with tf.control_dependencies([a for a in assigns if a is not None]):
            out = [tf.identity(tv.read_value()) for tv in tf_vars]
    return out[0] if single else out


def broadcast_group(tensors: Sequence[tf.Tensor], root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set, kind: str = "BroadcastGroup",
                    ignore_name_scope: bool = False) -> Any:
    """Broadcast many tensors in one node/one submission (they fuse); not differentiable.

    Eagerly, an empty list takes part too (common.ops._empty_group): where other ranks pass
    tensors (a model built on one rank only), every rank fails at once with both counts,
    instead of those ranks waiting for this one until the stall shutdown."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    set_id = _set_id(process_set)
    _check_graph("hvd.broadcast_variables")
    with wire_name(kind, name, ignore_name_scope, set_id) as (wire, cacheable):
        names = _member_names(wire, len(tensors))
        with refusing("broadcast", names, set_id, wire):
            moved = [_movable(t, "broadcast") for t in tensors]
        root = int(root_rank)

        def fn(*xs: Any) -> Any:
            # Grouped: ranks that pass different numbers of variables (models that differ)
            # fail at once with both counts, instead of waiting for names never sent.
            return _rt_broadcast(list(xs), names, root, set_id, cacheable, group=wire)

        xs = [m[0] for m in moved]
        outs = _run("HorovodBroadcastGroup", fn, xs, [x.dtype for x in xs], [x.shape for x in xs])
        return [restore(o) for o, (_, restore) in zip(outs, moved)]


# ---------------------------------------------------------------------- alltoall
def _alltoall_splits_tensor(splits: Any) -> Any:
    """Horovod converts splits with tf.convert_to_tensor(splits, dtype=tf.int32): lists of ints
    and int32 tensors pass; a tensor of another dtype (int64, float) is refused."""
    if isinstance(splits, (tf.Tensor, tf.Variable)) and splits.dtype != tf.int32:
        raise ValueError(f"alltoall: splits must be int32 (Horovod's op takes int32 splits), "
                         f"got {splits.dtype.name}; pass tf.cast(splits, tf.int32)")
    if isinstance(splits, np.ndarray) and splits.dtype.kind not in "iu":
        raise ValueError(f"alltoall: splits must be integers, got a {splits.dtype} array")
    return tf.convert_to_tensor(splits, dtype=tf.int32)


@_eager_errors
def alltoall(tensor: tf.Tensor, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set) -> Any:
    """Send rows `splits[i]` of `tensor` to rank i of the set and gather what every rank sent
    here. Returns the output, plus the received splits when `splits` is given; differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    set_id = _set_id(process_set)
    _check_graph("hvd.alltoall")
    wire, _ = _wire_name("Alltoall", name, ignore_name_scope, set_id)
    with refusing("alltoall", [wire], set_id):
        if tensor.shape.rank == 0:
            raise ValueError("alltoall needs a tensor with at least one dimension")
        tensor, restore = _movable(tensor, "alltoall")
        splits_t = None
        if splits is not None:
            splits_t = _alltoall_splits_tensor(splits)
    out, recv = _alltoall_named(tensor, splits_t, wire, set_id)
    out = restore(out)
    if splits is not None:
        return out, recv
    return out


def _alltoall_named(tensor: tf.Tensor, splits: Any, wire: Any, set_id: int) -> Any:
    def forward(x: Any) -> Any:
        inputs = [x] + ([splits] if splits is not None else [])
        out, recv = _run("HorovodAlltoall",
                         lambda y, *s: list(_rt_alltoall(y, s[0] if s else None, wire, set_id)),
                         inputs, [x.dtype, tf.int32], [gather_shape(x), tf.TensorShape([None])])
        return [out, tf.stop_gradient(recv)]

    def grad(xs: Any, outs: Any, dys: Any) -> Any:
        # Send every row back where it came from.
        g, _ = _alltoall_named(filled(dys[:1], outs)[0], outs[1], wire + ".grad", set_id)
        g.set_shape(xs[0].shape)
        return [g]

    out, recv = with_gradient(forward, grad, [tensor])
    return out, recv


# ---------------------------------------------------------------------- reducescatter
def _check_reducescatter_op(op: int) -> None:
    if op == Adasum:
        raise NotImplementedError("reducescatter does not support op=Adasum")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError("reducescatter supports op Average, Sum, Min, Max or Product")


def _reducescatter(tensor: tf.Tensor, name: Optional[str] = None, op: int = Sum,
                   ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    tensor = tf.convert_to_tensor(tensor)
    set_id = _set_id(process_set)
    _check_graph("hvd.reducescatter")
    with wire_name("Reducescatter", name, ignore_name_scope, set_id) as (wire, cacheable):
        with refusing("reducescatter", [wire], set_id):
            _check_reducescatter_op(op)
            if tensor.shape.rank == 0:
                raise ValueError("reducescatter needs a tensor with at least one dimension")
            _dtype_name(tensor.dtype, True, "reducescatter")
        return _grouped_reducescatter_named([tensor], wire, cacheable, op, float(prescale_factor),
                                            float(postscale_factor), set_id, grouped=False)[0]


def _grouped_reducescatter(tensors: Sequence[tf.Tensor], name: Optional[str] = None, op: int = Sum,
                           ignore_name_scope: bool = False,
                           process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return _empty_grouped("GroupedReducescatter", "reducescatter", name, ignore_name_scope,
                              process_set)
    set_id = _set_id(process_set)
    _check_graph("hvd.grouped_reducescatter")
    with wire_name("GroupedReducescatter", name, ignore_name_scope, set_id) as (wire, cacheable):
        with refusing("reducescatter", _member_names(wire, len(tensors)), set_id, wire):
            _check_reducescatter_op(op)
            for t in tensors:
                if t.shape.rank == 0:
                    raise ValueError("grouped_reducescatter needs tensors with at least one "
                                     "dimension")
                _dtype_name(t.dtype, True, "grouped_reducescatter")
        return _grouped_reducescatter_named(tensors, wire, cacheable, op, float(prescale_factor),
                                            float(postscale_factor), set_id, grouped=True)


def _grouped_reducescatter_named(tensors: Sequence[tf.Tensor], wire: Any, cacheable: Optional[bool],
                                 op: int, pre: float, post: float, set_id: int,
                                 grouped: bool) -> Any:
    names = _member_names(wire, len(tensors)) if grouped else [wire]

    def forward(*xs: Any) -> Any:
        return _run("HorovodReducescatter",
                    lambda *ys: _rt_reducescatter(list(ys), names, op, pre, post, set_id,
                                                  cacheable, group=wire if grouped else None),
                    list(xs), [x.dtype for x in xs], [gather_shape(x) for x in xs])

    def grad(xs: Any, outs: Any, dys: Any) -> Any:
        def gfn(*gs: Any) -> Any:
            gathered = _rt_allgather(list(gs), [f"{n}.grad" for n in names], set_id, cacheable,
                                     group=(wire + ".grad") if grouped else None)
            # Horovod's _reducescatter_grad: Sum's gradient is scaled by the set size, and
            # every gradient by both scale factors (the forward result is linear in them).
            factor = (float(_set_size(set_id)) if op == Sum else 1.0) * pre * post
            if factor != 1.0:
                gathered = [g * tf.cast(factor, g.dtype) for g in gathered]
            return gathered

        dys = filled(dys, outs)
        return _run("HorovodReducescatterGrad", gfn, dys, [d.dtype for d in dys],
                    [x.shape for x in xs])

    return with_gradient(forward, grad, list(tensors))


# ---------------------------------------------------------------------- control
def join() -> Any:
    """This rank has no more data: until every rank has joined, it contributes zeros to the other
    ranks' allreduces. Returns (as an int32 scalar tensor) the rank that joined last."""
    _check_graph("hvd.join")

    def fn() -> Any:
        return [tf.constant(_cops.join().wait(), dtype=tf.int32)]

    return _run("HorovodJoin", fn, [], [tf.int32], [tf.TensorShape([])])[0]


def barrier(process_set: ProcessSet = global_process_set) -> Any:
    """Block until every rank of the set reaches the barrier. Eagerly returns None; in a graph
    returns the barrier node (run in program order inside tf.function)."""
    sid = _set_id(process_set)
    _check_graph("hvd.barrier")

    def fn() -> Any:
        _cops.barrier(sid).wait()
        return [tf.constant(0, dtype=tf.int32)]

    out = _run("HorovodBarrier", fn, [], [tf.int32], [tf.TensorShape([])])[0]
    return None if tf.executing_eagerly() else out.op


# ---------------------------------------------------------------------- topology as graph ops
def _scalar_op(what: str, value_fn: Callable[[], Any], name: Optional[str] = None) -> Any:
    def fn() -> Any:
        return [tf.constant(int(value_fn()), dtype=tf.int32)]
    if tf.executing_eagerly():
        return fn()[0]
    return _run(name or what, fn, [], [tf.int32], [tf.TensorShape([])])[0]


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks of a process set, evaluated when the graph runs (not when it is
    built), so a graph survives an elastic resize."""
    return _scalar_op("HorovodSize", lambda: _set_size(process_set_id), name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this host, evaluated when the graph runs."""
    return _scalar_op("HorovodLocalSize", _basics.local_size, name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, evaluated when the graph runs."""
    return _scalar_op("HorovodRank", _basics.rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its host, evaluated when the graph runs."""
    return _scalar_op("HorovodLocalRank", _basics.local_rank, name)


HOROVOD_PROCESS_SET_ERROR_INIT = -1
HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET = -2


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this process belongs to the set, 0 if not, or a negative error code
    (HOROVOD_PROCESS_SET_ERROR_INIT: not initialized, ..._UNKNOWN_SET: no such set)."""
    def value() -> Any:
        if not _basics.is_initialized():
            return HOROVOD_PROCESS_SET_ERROR_INIT
        try:
            ranks = _set_ranks(process_set_id)
        except ValueError:
            return HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET
        return 1 if _basics.rank() in ranks else 0
    return _scalar_op("HorovodProcessSetIncluded", value, name)


__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "allgather", "grouped_allgather",
    "broadcast", "broadcast_", "alltoall", "join", "barrier", "size_op", "local_size_op",
    "rank_op", "local_rank_op", "process_set_included_op", "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2", "HorovodInternalError", "ProcessSet", "global_process_set",
    "Compression",
]
