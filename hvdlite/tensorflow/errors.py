"""hvdlite's errors as the TensorFlow error classes Horovod's op kernels return.

Horovod's TensorFlow collectives are op kernels, so user code catches `tf.errors.*`:
cross-rank mismatches (shape, dtype, op, root, ...) are `FailedPreconditionError`, invalid
arguments `InvalidArgumentError`, and a broken job (a peer that left, a shut-down engine:
Horovod's "Horovod has been shut down") `UnknownError`. hvdlite runs its collectives in Python
(eagerly, or as a `tf.py_function` node in a graph), so this module is the one place that maps
its errors:

- eagerly, an error is re-raised as a class deriving from BOTH the TF class and hvdlite's own
  (`FailedPreconditionError` + `HorovodMismatchError`, `UnknownError` +
  `HorovodInternalError`, `InvalidArgumentError` + `ValueError`), so
  `except tf.errors.FailedPreconditionError` and `except hvd.HorovodInternalError` both work;
- in a graph, `tf.py_function` already turns ValueError/TypeError into InvalidArgumentError,
  but turns every other exception into UnknownError. A mismatch is therefore not raised inside
  the node: the node returns one more output, a resource handle, and the collective's outputs
  are made to depend on reading it. After a mismatch the handle names a variable that does not
  exist, called after the message, so the read raises FailedPreconditionError carrying it. The
  message is also logged on every rank and kept for `last_error()`.
"""
from __future__ import annotations

import functools
import logging
import threading

import tensorflow as tf

from ..common.exceptions import HorovodInternalError, HorovodMismatchError

log = logging.getLogger(__name__)

_CLASSES: dict = {}
_last = threading.local()
_last_any: list = [None]


def _dual(tf_cls, py_cls):
    key = (tf_cls, py_cls)
    cls = _CLASSES.get(key)
    if cls is None:
        def __init__(self, message):
            tf_cls.__init__(self, None, None, message)

        def __str__(self):
            return self.message

        cls = _CLASSES[key] = type(tf_cls.__name__, (tf_cls, py_cls),
                                   {"__init__": __init__, "__str__": __str__,
                                    "__module__": __name__,
                                    "__doc__": f"{tf_cls.__name__} that is also a "
                                               f"{py_cls.__name__}."})
    return cls


def as_tf_error(exc: BaseException) -> BaseException:
    """The exception Horovod's kernel would raise for `exc` (eager mode), still an instance of
    `exc`'s class (elastic recovery catches HorovodInternalError); `exc` itself when there is
    no better class (HostsUpdatedInterrupt, KeyboardInterrupt, ...)."""
    if isinstance(exc, tf.errors.OpError):
        return exc
    if isinstance(exc, HorovodMismatchError):
        return _dual(tf.errors.FailedPreconditionError, HorovodMismatchError)(str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return _dual(tf.errors.InvalidArgumentError, type(exc))(str(exc))
    if isinstance(exc, NotImplementedError):
        return _dual(tf.errors.UnimplementedError, NotImplementedError)(str(exc))
    if isinstance(exc, HorovodInternalError):
        return _dual(tf.errors.UnknownError, type(exc))(str(exc))
    return exc


def eager_errors(fn):
    """A public collective whose argument errors (raised before anything runs: an unsupported
    dtype, a scalar where a dimension is needed, int64 alltoall splits) come out eagerly as
    Horovod's kernels return them, `InvalidArgumentError` (or `UnimplementedError`), deriving
    from the Python class too, so `except ValueError` keeps working. In a graph they stay as
    raised (TensorFlow's own wrappers raise at trace time, as Horovod's do).

    Why: Horovod's arguments reach a kernel, whose status becomes a tf.errors class; hvdlite
    checked them in Python and raised the bare ValueError, which `except tf.errors.OpError`
    did not catch."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, NotImplementedError) as exc:
            if isinstance(exc, tf.errors.OpError) or not tf.executing_eagerly():
                raise
            mapped = as_tf_error(exc)
            if mapped is exc:
                raise
            raise mapped from exc
    return wrapper


def call_eager(fn, inputs: list) -> list:
    """Run a collective now; errors come out as Horovod's TF error classes."""
    try:
        return list(fn(*inputs))
    except Exception as exc:
        mapped = as_tf_error(exc)
        if mapped is exc:
            raise
        raise mapped from exc


def last_error() -> str | None:
    """The message of the last collective that failed with a cross-rank mismatch inside a graph
    (the TF error itself can only name the collective)."""
    return getattr(_last, "message", None) or _last_any[0]


def _placeholder(dtype, shape):
    shape = tf.TensorShape(shape)
    dims = [0 if d is None else d for d in shape.as_list()] if shape.rank is not None else [0]
    return tf.zeros(dims, dtype=dtype)


_ok_variable: list = []


def _status_handle(message: str | None):
    """A resource handle whose read fails with FailedPreconditionError naming `message`
    (a variable that does not exist), or, for None, the handle of a real variable."""
    if message is None:
        if not _ok_variable:
            with tf.init_scope():
                _ok_variable.append(tf.Variable(0, dtype=tf.int32, trainable=False,
                                                name="hvdlite_ok"))
        return _ok_variable[0].handle
    text = " ".join(message.split())
    return tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], container="hvdlite",
                                  shared_name=f"hvdlite: {text}")


def guard_graph_fn(fn, tout: list, shapes: list):
    """`fn` for a graph node, with one more output: a status handle (see check_graph_outputs).
    On a cross-rank mismatch it returns placeholders and a failing status instead of raising
    (py_function would turn any raise but ValueError/TypeError into UnknownError);
    ValueError/TypeError propagate (InvalidArgumentError)."""
    def guarded(*xs):
        try:
            outs = list(fn(*xs))
        except HorovodMismatchError as exc:
            _last.message = _last_any[0] = str(exc)
            log.error("hvdlite collective failed (tf.errors.FailedPreconditionError): %s", exc)
            return [_placeholder(d, s) for d, s in zip(tout, shapes)] + \
                [_status_handle(str(exc))]
        return outs + [_status_handle(None)]
    return guarded


def status_dtype():
    return tf.resource


def check_graph_outputs(what: str, outs: list) -> list:
    """Graph outputs of a guarded node (the last one: its status handle) -> its real outputs,
    made data-dependent on reading the status, which raises FailedPreconditionError with the
    collective's message after a mismatch. (No TensorFlow op raises FailedPrecondition with a
    runtime message; reading a variable that does not exist does, naming the variable.)"""
    status, outs = outs[-1], outs[:-1]
    zero = tf.raw_ops.ReadVariableOp(resource=status, dtype=tf.int32)
    # Data, not control, dependencies: grappler drops control edges to side-effect-free reads.
    return [tf.reshape(o, tf.shape(o, out_type=tf.int32) + zero) for o in outs]


__all__ = ["as_tf_error", "call_eager", "guard_graph_fn", "check_graph_outputs", "last_error",
           "status_dtype", "HorovodInternalError"]
