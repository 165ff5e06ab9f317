"""The TensorFlow side of the op layer: tensors to engine buffers and back, graph nodes, and one
factory for "a collective with a gradient".

Eagerly a collective converts its tensors to buffers (DLPack, no copy), calls `common.ops` and
waits. Inside a graph the same Python runs as a `tf.py_function` node (see `run_node`). Every
differentiable collective is built by `with_gradient(forward, grad)`.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import tensorflow as tf
import torch

from ..common import basics as _basics
from ..common import naming as _naming
from ..common import ops as _cops
from ..common.messages import ADASUM, AVERAGE, MAX, MIN, PRODUCT, SUM
from ..common.process_sets import global_process_set
from . import errors as _errors

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


# ---------------------------------------------------------------------- AutoGraph
def _leave_hvdlite_unconverted() -> None:
    """Tell AutoGraph not to rewrite hvdlite's own Python, as it already leaves TensorFlow,
    Keras and NumPy alone.

    Why: a `tf.function` converts every function it calls that comes from a module it does not
    know, and then every function those call. A custom training step with
    `DistributedGradientTape` had AutoGraph parse and rewrite ~190 of hvdlite's functions (the
    gradient reducer, the bridge, the engine's config and naming helpers) on its first trace:
    7.2 s of an 8 s first step on a 2-core machine, against 0.8 s without. None of that code
    needs rewriting: it branches on Python values, never on tensors, and its graph work goes
    through `tf.py_function` nodes, which AutoGraph does not enter. The rule list is
    TensorFlow's own (`tensorflow.python.autograph.core.config.CONVERSION_RULES`, unchanged
    since TensorFlow 2.0); where a TensorFlow moves it, hvdlite's code is converted as before,
    only slower to trace."""
    try:
        from tensorflow.python.autograph.core import config as ag_config
        from tensorflow.python.autograph.core import config_lib as ag_rules
    except ImportError:
        return
    rules = getattr(ag_config, "CONVERSION_RULES", None)
    if not isinstance(rules, tuple) or not hasattr(ag_rules, "DoNotConvert"):
        return
    if not any(isinstance(r, ag_rules.DoNotConvert) and r.matches("hvdlite") for r in rules):
        ag_config.CONVERSION_RULES = rules + (ag_rules.DoNotConvert("hvdlite"),)


_leave_hvdlite_unconverted()


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
    return _cops.set_id(process_set if process_set is not None else global_process_set)


def _set_ranks(set_id: int) -> list:
    return _cops.set_ranks(set_id)


def _set_size(set_id: int) -> int:
    return len(_set_ranks(set_id))


def _set_rank(set_id: int) -> int:
    ranks = _set_ranks(set_id)
    me = _basics.rank()
    return ranks.index(me) if me in ranks else -1


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
            return _naming.auto_name(kind.lower(), set_id), False
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


class wire_name:
    """`with wire_name(kind, name, ignore_name_scope, set_id) as (wire, cacheable):` around a
    new collective: its name on the wire and whether the engine may cache it (_wire_name),
    held while the call runs.

    Why: an unnamed eager call runs now, so it is named by its line alone and cached
    (common.naming.blocking_name), as the torch frontend's blocking calls are, and an unnamed
    `hvd.allgather(x)` or `hvd.grouped_allreduce(metrics)` per step no longer sends the step's
    cached collectives back to the coordinator. Where that name is taken (another thread on the
    same line) or inside a graph, _wire_name names it as before."""

    __slots__ = ("_claim", "_value")

    def __init__(self, kind: str, name, ignore_name_scope: bool, set_id: int):
        self._claim = None
        if name is None and tf.executing_eagerly():
            op = "".join("_" + c.lower() if c.isupper() else c for c in kind).lstrip("_")
            self._claim = _naming.claimed_site(op, set_id)
        claimed = self._claim.__enter__() if self._claim is not None else None
        self._value = (claimed, True) if claimed is not None else \
            _wire_name(kind, name, ignore_name_scope, set_id)

    def __enter__(self) -> tuple[str, bool]:
        return self._value

    def __exit__(self, *exc) -> None:
        if self._claim is not None:
            self._claim.__exit__(*exc)


class refusing:
    """`with refusing(kind, names, set_id, group):` around a collective's argument checks
    (dtype, rank, op), inside its `wire_name` block: executing eagerly, an error they raise is
    first sent to the other ranks under the collective's wire names (common.ops.refuse), then
    raised here.

    Why: a check that fails on one rank only (a string or complex tensor where the others pass
    float32, a scalar to allgather) used to raise there alone, and its peers waited for the
    collective until the stall shutdown (600 s by default), whose report named this rank as
    hung; now every rank fails at once, the peers with a message that names the tensor, this
    rank and the error. In a graph the checks run at trace time, not when the peers' nodes run,
    so they raise as they are."""

    __slots__ = ("kind", "names", "set_id", "group")

    def __init__(self, kind: str, names: list, set_id: int, group=None):
        self.kind, self.names, self.set_id, self.group = kind, names, set_id, group

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not issubclass(exc_type, (ValueError, TypeError, NotImplementedError)) \
                or not tf.executing_eagerly():
            return False
        _cops.refuse(self.kind, self.names, exc, process_set=self.set_id, group=self.group)
        return False


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


def _check_reduce_op(op, set_id: int = 0, dtypes=()) -> None:
    """Horovod's op checks. For Adasum its conditions (the global set, a power-of-two world,
    floating-point tensors) are checked here, where the op is built (at trace time in a graph),
    as Horovod's allreduce does; the engine reduces on the host (common/adasum.py)."""
    if op == ADASUM:
        _cops.check_reduce_op(op, set_id, (), "allreduce")
        for d in dtypes:
            if not tf.as_dtype(d).is_floating:
                raise ValueError(f"op=Adasum needs floating-point tensors (float16, bfloat16, "
                                 f"float32 or float64); got {tf.as_dtype(d).name}.")
        return
    if op not in (AVERAGE, SUM, MIN, MAX, PRODUCT):
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or Product")


try:
    from tensorflow.python.eager.record import could_possibly_record as _could_possibly_record
except ImportError:     # a TensorFlow without it: every call keeps its gradient
    def _could_possibly_record() -> bool:
        return True


def _nothing_records() -> bool:
    """Whether, executing eagerly, no gradient tape or forward accumulator is active, so no
    gradient of what runs now can ever be asked for.

    Why: `tf.custom_gradient` costs ~0.4 ms per eager call (it decorates the function and
    inspects its signature every time): a 4 KiB eager `hvd.allreduce` on 2 ranks took 617-646
    us with it and 208-258 without, against 107-113 us through the torch frontend
    (benchmarks/tf_eager_ops.py, two alternating runs). TensorFlow's own check
    (`tensorflow.python.eager.record.could_possibly_record`, private; where a TensorFlow moves
    it, every call keeps its gradient as before) costs ~0.2 us."""
    if not tf.executing_eagerly():
        return False
    try:
        return not _could_possibly_record()
    except Exception:   # TF internals changed: keep the gradient
        return False


def with_gradient(forward, grad, tensors: list) -> list:
    """`forward(*xs)` (a list of outputs), differentiable when any input is: `grad(xs, outs,
    dys)` returns the inputs' gradients (missing upstream gradients arrive as None; when all
    are None, so are the inputs' gradients). Eagerly with no tape recording, `forward` runs
    as it is (_nothing_records), as the torch frontend skips autograd where nothing records."""
    if not _differentiable(*[t.dtype for t in tensors]) or _nothing_records():
        return list(forward(*tensors))

    @tf.custom_gradient
    def op_with_grad(*xs):
        outs = list(forward(*xs))

        def backward(*dys):
            if all(dy is None for dy in dys):
                return [None] * len(xs)
            return list(grad(xs, outs, list(dys)))

        return outs, backward

    return list(op_with_grad(*tensors))


def filled(dys: list, like: list) -> list:
    """Upstream gradients with None replaced by zeros shaped like `like`."""
    return [tf.zeros_like(x) if dy is None else tf.convert_to_tensor(dy)
            for x, dy in zip(like, dys)]


def gather_shape(x) -> tf.TensorShape:
    """Static shape of a dimension-0 concatenation of `x` over ranks."""
    if x.shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(x.shape[1:])


# ---------------------------------------------------------------------- runtime (eager) pieces
def _wait_tf(handle) -> list:
    return [_to_tf(r) for r in handle.wait()]


def _rt_allreduce(xs, names, op, pre, post, set_id, cacheable, group=None) -> list:
    if len(xs) == 1 and group is None and cacheable and len(names) == 1:
        # One named tensor: the op layer's blocking call, which runs the whole collective on
        # this thread when the steady state allows (ops.allreduce_now).
        t = _to_torch(xs[0])
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        return [_to_tf(_cops.allreduce_now(t, out, name=names[0], op=op, prescale=pre,
                                           postscale=post, process_set=set_id))]
    return _wait_tf(_cops.allreduce([_to_torch(x) for x in xs], names=names, op=op,
                                    prescale=pre, postscale=post, process_set=set_id,
                                    group=group, cacheable=cacheable, blocking=True))


def _rt_allgather(xs, names, set_id, cacheable, group=None) -> list:
    return _wait_tf(_cops.allgather([_to_torch(x) for x in xs], names=names, process_set=set_id,
                                    group=group, cacheable=cacheable))


def _rt_broadcast(xs, names, root_rank, set_id, cacheable, group=None) -> list:
    return _wait_tf(_cops.broadcast([_to_torch(x) for x in xs], root_rank, names=names,
                                    process_set=set_id, group=group, cacheable=cacheable))


def _rt_reducescatter(xs, names, op, pre, post, set_id, cacheable, group=None) -> list:
    return _wait_tf(_cops.reducescatter([_to_torch(x) for x in xs], names=names, op=op,
                                        prescale=pre, postscale=post, process_set=set_id,
                                        group=group, cacheable=cacheable))


def _rt_alltoall(x, splits, name, set_id):
    split_list = None
    if splits is not None:
        split_list = [int(s) for s in np.asarray(splits.numpy()).reshape(-1).tolist()]
    out, recv = _cops.alltoall(_to_torch(x), split_list, names=[name],
                               process_set=set_id).wait()
    return _to_tf(out), tf.constant(np.asarray(recv.numpy(), dtype=np.int32))
