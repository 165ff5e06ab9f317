"""TensorFlow collectives with Horovod's names and signatures (horovod.tensorflow.mpi_ops).

Executing eagerly, a collective hands the tensor's buffer to the common engine (DLPack, no copy) and
waits. Inside a graph (`tf.function`, Keras `model.fit`, TF1 graphs) the same Python runs as a
`tf.py_function` node: TensorFlow calls it each time the graph runs. Inside `tf.function` such nodes
run in program order (automatic control dependencies chain stateful ops), so every rank submits
its collectives in the same order; in TF1 graphs hvdlite chains them itself.

Names are what the engine matches across ranks. Unnamed eager calls are named by their call site
(`basics.auto_name`); unnamed graph ops get a per-graph counter at trace time ("HorovodAllreduce",
"HorovodAllreduce_1", ...), which is the same on every rank because every rank traces the same
code, and stays the same for every run of the graph (so the response cache serves them).

XLA cannot call Python: inside `jit_compile=True` every collective raises at trace time, saying so.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import tensorflow as tf
import torch

from ..common import basics as _basics
from ..common import validation as _validation
from ..common.engine import Entry
from ..common.exceptions import HorovodInternalError
from ..common.messages import (ADASUM, ALLGATHER, ALLREDUCE, ALLTOALL, AVERAGE, BARRIER,
                               BROADCAST, JOIN, MAX, MIN, PRODUCT, REDUCESCATTER, SUM, Request,
                               handle_average_backwards_compatibility)
from ..common.process_sets import ProcessSet, global_process_set
from . import errors as _errors
from .compression import Compression

Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT

# TensorFlow dtypes the engine carries as they are.
_DTYPE_NAMES = {tf.uint8: "uint8", tf.int8: "int8", tf.int16: "int16", tf.int32: "int32",
                tf.int64: "int64", tf.float16: "float16", tf.bfloat16: "bfloat16",
                tf.float32: "float32", tf.float64: "float64", tf.bool: "bool"}
_REDUCIBLE = {n for n in _DTYPE_NAMES.values() if n != "bool"}
# Dtypes that only move data (gather, broadcast, alltoall): sent bit for bit as another type.
_BITCAST = {tf.uint16: tf.int16, tf.uint32: tf.int32, tf.uint64: tf.int64,
            tf.complex64: tf.float32, tf.complex128: tf.float64}

_XLA_MESSAGE = (
    "hvdlite.tensorflow: {what} cannot run inside an XLA-compiled function. hvdlite's "
    "collectives run in Python on its engine, which XLA cannot call. Compile this function "
    "without XLA: tf.function(..., jit_compile=False), or for Keras "
    "model.compile(..., jit_compile=False) (Keras 3 turns XLA on by default when a GPU is "
    "present, jit_compile='auto').")


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """True when `num_rank` is a power of two (Horovod's Adasum precondition)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def _executing_eagerly() -> bool:
    return tf.executing_eagerly()


# ---------------------------------------------------------------------- tensors <-> engine
def _to_torch(t) -> torch.Tensor:
    """A torch tensor over an eager tensor's buffer (DLPack: no copy)."""
    if t.device and "CPU" not in t.device.upper():
        with tf.device("/cpu:0"):
            t = tf.identity(t)
    try:
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(t))
    except Exception:  # a dtype or layout DLPack refuses: copy through numpy
        arr = np.ascontiguousarray(t.numpy())
        if t.dtype == tf.bfloat16:
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)


def _to_tf(t: torch.Tensor):
    """An eager tensor over a torch tensor's buffer (DLPack: no copy)."""
    t = t.contiguous()
    try:
        return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    except Exception:
        if t.dtype == torch.bfloat16:
            return tf.constant(t.view(torch.int16).numpy().view(tf.bfloat16.as_numpy_dtype))
        return tf.constant(t.numpy())


def _dtype_name(dtype, reduce: bool, what: str) -> str:
    dtype = tf.as_dtype(dtype)
    name = _DTYPE_NAMES.get(dtype)
    if name is None or (reduce and name not in _REDUCIBLE):
        supported = sorted(_REDUCIBLE if reduce else
                           set(_DTYPE_NAMES.values()) | {d.name for d in _BITCAST})
        raise ValueError(f"{what}: tensor type {dtype.name} is not supported"
                         + (" for reductions" if reduce and name is not None else "")
                         + f"; supported types: {', '.join(supported)}")
    return name


def _movable(tensor, what: str):
    """(tensor the engine can carry, function restoring the original dtype) for ops that only
    move data: uint16/32/64 and complex travel bit for bit as int16/32/64 and float pairs."""
    target = _BITCAST.get(tensor.dtype)
    if target is None:
        _dtype_name(tensor.dtype, False, what)
        return tensor, (lambda t: t)
    original = tensor.dtype
    return tf.bitcast(tensor, target), (lambda t: tf.bitcast(t, original))


def _set_id(process_set) -> int:
    return _basics._resolve_set(process_set if process_set is not None else global_process_set)


def _set_ranks(set_id: int) -> list:
    return _basics._set_ranks(set_id)


def _set_size(set_id: int) -> int:
    return len(_set_ranks(set_id))


def _set_rank(set_id: int) -> int:
    ranks = _set_ranks(set_id)
    me = _basics.rank()
    return ranks.index(me) if me in ranks else -1


def _request(t: torch.Tensor, name: str, rtype: int, set_id: int, dtype: str,
             **kw) -> Request:
    return Request(rank=_basics.rank(), name=name, type=rtype, dtype=dtype,
                   shape=tuple(t.shape), device=-1, process_set_id=set_id, **kw)


def _wait(handle) -> list:
    return _basics.wait(handle)


# ---------------------------------------------------------------------- graph plumbing
_graph_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_graph_last_op: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_graph_lock = threading.Lock()


def _unique_in_graph(graph, base: str) -> str:
    with _graph_lock:
        used = _graph_names.setdefault(graph, {})
        n = used.get(base, 0)
        used[base] = n + 1
    return base if n == 0 else f"{base}_{n}"


def _wire_name(kind: str, name, ignore_name_scope: bool, set_id: int) -> tuple[str, bool]:
    """(name on the wire, whether the engine may cache it) for a new collective."""
    if tf.executing_eagerly():
        if name is None:
            return _basics.auto_name(kind.lower(), set_id), False
        return str(name), True
    graph = tf.compat.v1.get_default_graph()
    if name is None:
        # Not the name scope: Keras puts layer names there, which come from per-process
        # counters that need not agree across ranks.
        base = f"Horovod{kind}"
    else:
        base = str(name)
        scope = "" if ignore_name_scope else graph.get_name_scope()
        if scope:
            base = f"{scope}/{base}"
    return _unique_in_graph(graph, base), True


def _in_xla(graph) -> bool:
    try:
        from tensorflow.python.ops import control_flow_util
        return bool(control_flow_util.GraphOrParentsInXlaContext(graph))
    except Exception:  # layout of TF internals changed: assume no XLA
        return False


def _check_graph(what: str) -> None:
    """Fail at trace time, with the remedy, where a graph cannot host a Python collective."""
    if tf.executing_eagerly():
        return
    if _in_xla(tf.compat.v1.get_default_graph()):
        raise ValueError(_XLA_MESSAGE.format(what=what))


def _run(what: str, fn, inputs: list, tout: list, shapes: list) -> list:
    """Run `fn` (eager tensors in, list of eager tensors out) now, or add it to the graph that is
    being built as a node that runs it every time the graph runs."""
    if tf.executing_eagerly():
        return _errors.call_eager(fn, inputs)
    graph = tf.compat.v1.get_default_graph()
    if _in_xla(graph):
        raise ValueError(_XLA_MESSAGE.format(what=what))
    # tf.function orders stateful nodes itself; a TF1 graph runs independent nodes in any
    # order, so chain hvdlite's nodes in creation order there.
    chain = not getattr(graph, "building_function", False) and \
        graph._get_control_flow_context() is None
    deps = []
    if chain:
        last = _graph_last_op.get(graph)
        if last is not None:
            deps = [last]
    with tf.control_dependencies(deps):
        outs = tf.py_function(_errors.guard_graph_fn(fn, list(tout), list(shapes)),
                              list(inputs), list(tout) + [_errors.status_dtype()], name=what)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    outs = _errors.check_graph_outputs(what, outs)
    for o, s in zip(outs, shapes):
        o.set_shape(s)
    if chain and outs:
        _graph_last_op[graph] = outs[0].op
    return outs


def _differentiable(*dtypes) -> bool:
    return any(tf.as_dtype(d).is_floating or tf.as_dtype(d).is_complex for d in dtypes)


def _check_reduce_op(op) -> None:
    if op == Adasum:
        raise NotImplementedError("op=Adasum is not available yet in hvdlite; use Average or Sum.")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or Product")


# ---------------------------------------------------------------------- runtime (eager) pieces
def _rt_allreduce(xs, names, op, pre, post, set_id, cacheable, group=None) -> list:
    n = len(xs)
    entries = []
    for x, name in zip(xs, names):
        t = _to_torch(x)
        req = _request(t, name, ALLREDUCE, set_id, _DTYPE_NAMES[x.dtype], reduce_op=op,
                       prescale=pre, postscale=post, cacheable=cacheable,
                       group=group if group is not None and n > 1 else None,
                       group_size=n if group is not None and n > 1 else 0)
        entries.append(Entry(req, t, torch.empty_like(t)))
    return [_to_tf(r) for r in _wait(_basics.submit(entries))]


def _rt_allgather(xs, names, set_id, cacheable, group=None) -> list:
    n = len(xs)
    entries = []
    for x, name in zip(xs, names):
        t = _to_torch(x)
        req = _request(t, name, ALLGATHER, set_id, _DTYPE_NAMES[x.dtype], cacheable=cacheable,
                       group=group if group is not None and n > 1 else None,
                       group_size=n if group is not None and n > 1 else 0)
        entries.append(Entry(req, t))
    return [_to_tf(r) for r in _wait(_basics.submit(entries))]


def _rt_broadcast(xs, names, root_rank, set_id, cacheable) -> list:
    entries = []
    for x, name in zip(xs, names):
        t = _to_torch(x)
        req = _request(t, name, BROADCAST, set_id, _DTYPE_NAMES[x.dtype],
                       root_rank=int(root_rank), cacheable=cacheable)
        entries.append(Entry(req, t, torch.empty_like(t)))
    return [_to_tf(r) for r in _wait(_basics.submit(entries))]


def _rt_reducescatter(xs, names, op, pre, post, set_id, cacheable, group=None) -> list:
    n = len(xs)
    entries = []
    for x, name in zip(xs, names):
        t = _to_torch(x)
        req = _request(t, name, REDUCESCATTER, set_id, _DTYPE_NAMES[x.dtype], reduce_op=op,
                       prescale=pre, postscale=post, cacheable=cacheable,
                       group=group if group is not None and n > 1 else None,
                       group_size=n if group is not None and n > 1 else 0)
        entries.append(Entry(req, t))
    return [_to_tf(r) for r in _wait(_basics.submit(entries))]


def _rt_alltoall(x, splits, name, set_id):
    t = _to_torch(x)
    split_list = None
    if splits is not None:
        split_list = np.asarray(splits.numpy()).reshape(-1).tolist()
    split_list = _validation.alltoall_splits(split_list, int(t.shape[0]), _set_size(set_id))
    req = _request(t, name, ALLTOALL, set_id, _DTYPE_NAMES[x.dtype], splits=split_list,
                   cacheable=False)
    entry = Entry(req, t)
    (out,) = _wait(_basics.submit([entry]))
    recv = entry.extra
    return _to_tf(out), tf.constant(np.asarray(recv.numpy(), dtype=np.int32))


# ---------------------------------------------------------------------- allreduce
def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
               ignore_name_scope=False, process_set=global_process_set):
    """Reduce a dense tensor over the ranks of `process_set` (default op: Sum); differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    _check_reduce_op(op)
    _dtype_name(tensor.dtype, True, "allreduce")
    set_id = _set_id(process_set)
    _check_graph("hvd.allreduce")
    wire, cacheable = _wire_name("Allreduce", name, ignore_name_scope, set_id)
    return _allreduce_named(tensor, wire, cacheable, op, float(prescale_factor),
                            float(postscale_factor), set_id)


def _allreduce_named(tensor, wire, cacheable, op, pre, post, set_id):
    def fn(x):
        return _rt_allreduce([x], [wire], op, pre, post, set_id, cacheable)

    def forward(x):
        return _run("HorovodAllreduce", fn, [x], [x.dtype], [x.shape])[0]

    if not _differentiable(tensor.dtype):
        return forward(tensor)

    @tf.custom_gradient
    def op_with_grad(x):
        def grad(dy):
            if dy is None:
                return None
            # Horovod's definition: the gradient is reduced the same way.
            return _allreduce_named(tf.convert_to_tensor(dy), wire + ".grad", cacheable, op,
                                    pre, post, set_id)
        return forward(x), grad

    return op_with_grad(tensor)


def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    _check_reduce_op(op)
    for t in tensors:
        _dtype_name(t.dtype, True, "grouped_allreduce")
    set_id = _set_id(process_set)
    _check_graph("hvd.grouped_allreduce")
    wire, cacheable = _wire_name("GroupedAllreduce", name, ignore_name_scope, set_id)
    return _grouped_allreduce_named(tensors, wire, cacheable, op, float(prescale_factor),
                                    float(postscale_factor), set_id)


def _grouped_allreduce_named(tensors, wire, cacheable, op, pre, post, set_id):
    names = [f"{wire}.{i}" for i in range(len(tensors))]

    def fn(*xs):
        return _rt_allreduce(list(xs), names, op, pre, post, set_id, cacheable, group=wire)

    def forward(*xs):
        return _run("HorovodGroupedAllreduce", fn, list(xs), [x.dtype for x in xs],
                    [x.shape for x in xs])

    if not _differentiable(*[t.dtype for t in tensors]):
        return forward(*tensors)

    @tf.custom_gradient
    def op_with_grad(*xs):
        def grad(*dys):
            dys = [tf.zeros_like(x) if dy is None else tf.convert_to_tensor(dy)
                   for x, dy in zip(xs, dys)]
            return _grouped_allreduce_named(dys, wire + ".grad", cacheable, op, pre, post,
                                            set_id)
        return forward(*xs), grad

    return list(op_with_grad(*tensors))


def _sparse_allreduce(slices, op, name, process_set, ignore_name_scope, prescale_factor=1.0,
                      postscale_factor=1.0):
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
    _dtype_name(values.dtype, True, "allreduce of tf.IndexedSlices")
    set_id = _set_id(process_set)
    _check_graph("hvd.allreduce (tf.IndexedSlices)")
    wire, cacheable = _wire_name("Allreduce", name, ignore_name_scope, set_id)
    new_values, new_indices = _sparse_allreduce_named(values, indices, wire, cacheable, op,
                                                      set_id)
    return tf.IndexedSlices(new_values, new_indices, dense_shape=slices.dense_shape)


def _sparse_allreduce_named(values, indices, wire, cacheable, op, set_id):
    def fn(v, i):
        return _rt_allgather([v, i], [f"{wire}.values", f"{wire}.indices"], set_id, cacheable)

    vshape = tf.TensorShape([None]).concatenate(values.shape[1:])
    gv, gi = _run("HorovodSparseAllreduce", fn, [values, indices], [values.dtype, indices.dtype],
                  [vshape, tf.TensorShape([None])])
    if op == Average:
        # Horovod divides with TensorFlow's `/`: integer values become floating (true division).
        gv = gv / tf.cast(size_op(set_id), gv.dtype)
    return gv, gi


# ---------------------------------------------------------------------- allgather
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's tensor along dimension 0 (first dimensions may differ);
    differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; reshape the "
                         "scalar to [1]")
    tensor, restore = _movable(tensor, "allgather")
    set_id = _set_id(process_set)
    _check_graph("hvd.allgather")
    wire, cacheable = _wire_name("Allgather", name, ignore_name_scope, set_id)
    return restore(_allgather_named(tensor, wire, cacheable, set_id))


def _allgather_named(tensor, wire, cacheable, set_id):
    def fn(x):
        return _rt_allgather([x], [wire], set_id, cacheable)

    def forward(x):
        shape = tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank is not None \
            else tf.TensorShape(None)
        return _run("HorovodAllgather", fn, [x], [x.dtype], [shape])[0]

    if not _differentiable(tensor.dtype):
        return forward(tensor)

    @tf.custom_gradient
    def op_with_grad(x):
        def grad(dy):
            if dy is None:
                return None
            return _gather_grad([tf.convert_to_tensor(dy)], [x], [wire + ".grad"], cacheable,
                                set_id)[0]
        return forward(x), grad

    return op_with_grad(tensor)


def _gather_grad(dys, xs, wires, cacheable, set_id) -> list:
    """Horovod's allgather gradient: average the incoming gradient over the set, then keep this
    rank's rows (offsets from an allgather of every rank's first dimension)."""
    def fn(*args):
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


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """Allgather a list of tensors together (released and fused as one group);
    differentiable."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError("grouped_allgather needs tensors with at least one dimension")
    moved = [_movable(t, "grouped_allgather") for t in tensors]
    set_id = _set_id(process_set)
    _check_graph("hvd.grouped_allgather")
    wire, cacheable = _wire_name("GroupedAllgather", name, ignore_name_scope, set_id)
    outs = _grouped_allgather_named([m[0] for m in moved], wire, cacheable, set_id)
    return [restore(o) for o, (_, restore) in zip(outs, moved)]


def _grouped_allgather_named(tensors, wire, cacheable, set_id):
    names = [f"{wire}.{i}" for i in range(len(tensors))]

    def fn(*xs):
        return _rt_allgather(list(xs), names, set_id, cacheable, group=wire)

    def forward(*xs):
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs]
        return _run("HorovodGroupedAllgather", fn, list(xs), [x.dtype for x in xs], shapes)

    if not _differentiable(*[t.dtype for t in tensors]):
        return forward(*tensors)

    @tf.custom_gradient
    def op_with_grad(*xs):
        def grad(*dys):
            dys = [tf.zeros_like(f) if dy is None else tf.convert_to_tensor(dy)
                   for f, dy in zip(outs, dys)]
            return _gather_grad(dys, xs, [f"{n}.grad" for n in names], cacheable, set_id)
        outs = forward(*xs)
        return outs, grad

    return list(op_with_grad(*tensors))


# ---------------------------------------------------------------------- broadcast
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Broadcast `tensor` from `root_rank` (a global rank) to every rank of the set;
    differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    tensor, restore = _movable(tensor, "broadcast")
    set_id = _set_id(process_set)
    _check_graph("hvd.broadcast")
    wire, cacheable = _wire_name("Broadcast", name, ignore_name_scope, set_id)
    return restore(_broadcast_named(tensor, int(root_rank), wire, cacheable, set_id))


def _broadcast_named(tensor, root_rank, wire, cacheable, set_id):
    def fn(x):
        return _rt_broadcast([x], [wire], root_rank, set_id, cacheable)

    def forward(x):
        return _run("HorovodBroadcast", fn, [x], [x.dtype], [x.shape])[0]

    if not _differentiable(tensor.dtype):
        return forward(tensor)

    @tf.custom_gradient
    def op_with_grad(x):
        def grad(dy):
            if dy is None:
                return None

            def gfn(g):
                (red,) = _rt_allreduce([g], [wire + ".grad"], Average, 1.0, 1.0, set_id,
                                       cacheable)
                return [red if _basics.rank() == root_rank else tf.zeros_like(red)]

            dy = tf.convert_to_tensor(dy)
            return _run("HorovodBroadcastGrad", gfn, [dy], [dy.dtype], [dy.shape])[0]
        return forward(x), grad

    return op_with_grad(tensor)


def _tf_variable(var):
    """The tf.Variable behind a tf.Variable or a Keras 3 variable (None for anything else)."""
    if isinstance(var, tf.Variable):
        return var
    inner = getattr(var, "value", None)
    return inner if isinstance(inner, tf.Variable) else None


def _read(var):
    v = _tf_variable(var)
    return v.read_value() if v is not None else tf.convert_to_tensor(var)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Broadcast `variables` in place from `root_rank`; returns their new values."""
    single = not isinstance(variables, (list, tuple))
    variables = [variables] if single else list(variables)
    if not variables:
        return []
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


def broadcast_group(tensors, root_rank, name=None, process_set=global_process_set,
                    kind="BroadcastGroup", ignore_name_scope=False):
    """Broadcast many tensors in one node/one submission (they fuse); not differentiable."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    moved = [_movable(t, "broadcast") for t in tensors]
    set_id = _set_id(process_set)
    _check_graph("hvd.broadcast_variables")
    wire, cacheable = _wire_name(kind, name, ignore_name_scope, set_id)
    names = [f"{wire}.{i}" for i in range(len(tensors))]
    root = int(root_rank)

    def fn(*xs):
        return _rt_broadcast(list(xs), names, root, set_id, cacheable)

    xs = [m[0] for m in moved]
    outs = _run("HorovodBroadcastGroup", fn, xs, [x.dtype for x in xs], [x.shape for x in xs])
    return [restore(o) for o, (_, restore) in zip(outs, moved)]


# ---------------------------------------------------------------------- alltoall
def _alltoall_splits_tensor(splits):
    """Horovod converts splits with tf.convert_to_tensor(splits, dtype=tf.int32): lists of ints
    and int32 tensors pass; a tensor of another dtype (int64, float) raises there."""
    if isinstance(splits, (tf.Tensor, tf.Variable)) and splits.dtype != tf.int32:
        raise ValueError(f"alltoall: splits must be int32 (Horovod's op takes int32 splits), "
                         f"got {splits.dtype.name}; pass tf.cast(splits, tf.int32)")
    if isinstance(splits, np.ndarray) and splits.dtype.kind not in "iu":
        raise ValueError(f"alltoall: splits must be integers, got a {splits.dtype} array")
    return tf.convert_to_tensor(splits, dtype=tf.int32)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Send rows `splits[i]` of `tensor` to rank i of the set and gather what every rank sent
    here. Returns the output, plus the received splits when `splits` is given; differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    tensor, restore = _movable(tensor, "alltoall")
    splits_t = None
    if splits is not None:
        splits_t = _alltoall_splits_tensor(splits)
    set_id = _set_id(process_set)
    _check_graph("hvd.alltoall")
    wire, _ = _wire_name("Alltoall", name, ignore_name_scope, set_id)
    out, recv = _alltoall_named(tensor, splits_t, wire, set_id)
    out = restore(out)
    if splits is not None:
        return out, recv
    return out


def _alltoall_named(tensor, splits, wire, set_id):
    def fn(x, *s):
        return list(_rt_alltoall(x, s[0] if s else None, wire, set_id))

    def forward(x):
        inputs = [x] + ([splits] if splits is not None else [])
        shape = tf.TensorShape([None]).concatenate(x.shape[1:])
        return _run("HorovodAlltoall", fn, inputs, [x.dtype, tf.int32],
                    [shape, tf.TensorShape([None])])

    if not _differentiable(tensor.dtype):
        out, recv = forward(tensor)
        return out, recv

    @tf.custom_gradient
    def op_with_grad(x):
        out, recv = forward(x)

        def grad(dy, drecv=None):
            if dy is None:
                return None
            dy = tf.convert_to_tensor(dy)
            # Send every row back where it came from.
            g, _ = _alltoall_named(dy, recv, wire + ".grad", set_id)
            g.set_shape(x.shape)
            return g

        return (out, tf.stop_gradient(recv)), grad

    out, recv = op_with_grad(tensor)
    return out, recv


# ---------------------------------------------------------------------- reducescatter
def _check_reducescatter_op(op) -> None:
    if op == Adasum:
        raise NotImplementedError("reducescatter does not support op=Adasum")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError("reducescatter supports op Average, Sum, Min, Max or Product")


def _reducescatter(tensor, name=None, op=Sum, ignore_name_scope=False,
                   process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    tensor = tf.convert_to_tensor(tensor)
    _check_reducescatter_op(op)
    if tensor.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    _dtype_name(tensor.dtype, True, "reducescatter")
    set_id = _set_id(process_set)
    _check_graph("hvd.reducescatter")
    wire, cacheable = _wire_name("Reducescatter", name, ignore_name_scope, set_id)
    return _grouped_reducescatter_named([tensor], wire, cacheable, op, float(prescale_factor),
                                        float(postscale_factor), set_id, grouped=False)[0]


def _grouped_reducescatter(tensors, name=None, op=Sum, ignore_name_scope=False,
                           process_set=global_process_set, prescale_factor=1.0,
                           postscale_factor=1.0):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    _check_reducescatter_op(op)
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError("grouped_reducescatter needs tensors with at least one dimension")
        _dtype_name(t.dtype, True, "grouped_reducescatter")
    set_id = _set_id(process_set)
    _check_graph("hvd.grouped_reducescatter")
    wire, cacheable = _wire_name("GroupedReducescatter", name, ignore_name_scope, set_id)
    return _grouped_reducescatter_named(tensors, wire, cacheable, op, float(prescale_factor),
                                        float(postscale_factor), set_id, grouped=True)


def _grouped_reducescatter_named(tensors, wire, cacheable, op, pre, post, set_id, grouped):
    names = [f"{wire}.{i}" for i in range(len(tensors))] if grouped else [wire]

    def fn(*xs):
        return _rt_reducescatter(list(xs), names, op, pre, post, set_id, cacheable,
                                 group=wire if grouped else None)

    def forward(*xs):
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs]
        return _run("HorovodReducescatter", fn, list(xs), [x.dtype for x in xs], shapes)

    if not _differentiable(*[t.dtype for t in tensors]):
        return forward(*tensors)

    @tf.custom_gradient
    def op_with_grad(*xs):
        outs = forward(*xs)

        def grad(*dys):
            dys = [tf.zeros_like(o) if dy is None else tf.convert_to_tensor(dy)
                   for o, dy in zip(outs, dys)]

            def gfn(*gs):
                gathered = _rt_allgather(list(gs), [f"{n}.grad" for n in names], set_id,
                                         cacheable, group=(wire + ".grad") if grouped else None)
                if op == Sum:  # Horovod's definition: Sum's gradient is scaled by the set size
                    size = _set_size(set_id)
                    gathered = [g * tf.cast(size, g.dtype) for g in gathered]
                return gathered

            return _run("HorovodReducescatterGrad", gfn, dys, [d.dtype for d in dys],
                        [x.shape for x in xs])

        return outs, grad

    return list(op_with_grad(*tensors))


# ---------------------------------------------------------------------- control
def join():
    """This rank has no more data: until every rank has joined, it contributes zeros to the other
    ranks' allreduces. Returns (as an int32 scalar tensor) the rank that joined last."""
    _check_graph("hvd.join")

    def fn():
        req = Request(rank=_basics.rank(), name="join.noname", type=JOIN, cacheable=False)
        (last,) = _wait(_basics.submit([Entry(req)]))
        return [tf.constant(int(last), dtype=tf.int32)]

    return _run("HorovodJoin", fn, [], [tf.int32], [tf.TensorShape([])])[0]


_barrier_counts: dict[int, int] = {}
_barrier_lock = threading.Lock()


def barrier(process_set=global_process_set):
    """Block until every rank of the set reaches the barrier. Eagerly returns None; in a graph
    returns the barrier node (run in program order inside tf.function)."""
    sid = _set_id(process_set)
    _check_graph("hvd.barrier")

    def fn():
        with _barrier_lock:
            n = _barrier_counts.get(sid, 0)
            _barrier_counts[sid] = n + 1
        req = Request(rank=_basics.rank(), name=f"barrier.{n}", type=BARRIER,
                      process_set_id=sid, cacheable=False)
        _wait(_basics.submit([Entry(req)]))
        return [tf.constant(0, dtype=tf.int32)]

    out = _run("HorovodBarrier", fn, [], [tf.int32], [tf.TensorShape([])])[0]
    return None if tf.executing_eagerly() else out.op


# ---------------------------------------------------------------------- topology as graph ops
def _scalar_op(what: str, value_fn, name=None):
    def fn():
        return [tf.constant(int(value_fn()), dtype=tf.int32)]
    if tf.executing_eagerly():
        return fn()[0]
    return _run(name or what, fn, [], [tf.int32], [tf.TensorShape([])])[0]


def size_op(process_set_id=0, name=None):
    """The number of ranks of a process set, evaluated when the graph runs (not when it is
    built), so a graph survives an elastic resize."""
    return _scalar_op("HorovodSize", lambda: _set_size(process_set_id), name)


def local_size_op(name=None):
    """The number of ranks on this host, evaluated when the graph runs."""
    return _scalar_op("HorovodLocalSize", _basics.local_size, name)


def rank_op(name=None):
    """This process's rank, evaluated when the graph runs."""
    return _scalar_op("HorovodRank", _basics.rank, name)


def local_rank_op(name=None):
    """This process's rank on its host, evaluated when the graph runs."""
    return _scalar_op("HorovodLocalRank", _basics.local_rank, name)


HOROVOD_PROCESS_SET_ERROR_INIT = -1
HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET = -2


def process_set_included_op(process_set_id=0, name=None):
    """1 if this process belongs to the set, 0 if not, or a negative error code
    (HOROVOD_PROCESS_SET_ERROR_INIT: not initialized, ..._UNKNOWN_SET: no such set)."""
    def value():
        if not _basics.is_initialized():
            return HOROVOD_PROCESS_SET_ERROR_INIT
        try:
            ranks = _set_ranks(process_set_id)
        except ValueError:
            return HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET
        return 1 if _basics.rank() in ranks else 0
    return _scalar_op("HorovodProcessSetIncluded", value, name)


def _reset() -> None:
    """Forget per-job counters (shutdown/init)."""
    with _barrier_lock:
        _barrier_counts.clear()


__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "allgather", "grouped_allgather",
    "broadcast", "broadcast_", "alltoall", "join", "barrier", "size_op", "local_size_op",
    "rank_op", "local_rank_op", "process_set_included_op", "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2", "HorovodInternalError", "ProcessSet", "global_process_set",
    "Compression",
]
