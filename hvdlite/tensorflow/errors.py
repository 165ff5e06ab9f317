"""hvdlite's errors as the TensorFlow error classes Horovod's op kernels return.

Horovod's TensorFlow collectives are op kernels, so user code catches `tf.errors.*`:
cross-rank mismatches (shape, dtype, op, root, ...) are `FailedPreconditionError`, invalid
arguments `InvalidArgumentError`. hvdlite runs its collectives in Python (eagerly, or as a
`tf.py_function` node in a graph), so this module is the one place that maps its errors:

- eagerly, an error is re-raised as a class deriving from BOTH the TF class and hvdlite's own
  (`FailedPreconditionError` + `HorovodInternalError`, `InvalidArgumentError` + `ValueError`),
  so `except tf.errors.FailedPreconditionError` and `except hvd.HorovodInternalError` both work;
- in a graph, `tf.py_function` already turns ValueError/TypeError into InvalidArgumentError,
  but turns every other exception into UnknownError. A mismatch is therefore not raised inside
  the node: the node returns a failure flag, and an op that fails with FailedPreconditionError
  runs when the flag is set. The full message is logged on every rank (the TF error names the
  collective and points to it) and is kept for `last_error()`.
"""
from __future__ import annotations

import logging
import threading

import tensorflow as tf

from ..common.exceptions import HorovodInternalError, HorovodMismatchError

log = logging.getLogger("hvdlite")

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
    """The exception Horovod's kernel would raise for `exc` (eager mode); `exc` itself when
    there is no better class (it is then kept unchanged, e.g. for elastic recovery)."""
    if isinstance(exc, tf.errors.OpError):
        return exc
    if isinstance(exc, HorovodMismatchError):
        return _dual(tf.errors.FailedPreconditionError, HorovodMismatchError)(str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return _dual(tf.errors.InvalidArgumentError, type(exc))(str(exc))
    if isinstance(exc, NotImplementedError):
        return _dual(tf.errors.UnimplementedError, NotImplementedError)(str(exc))
    return exc


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
    dims = [0 if d is None else d for d in tf.TensorShape(shape).as_list()] \
        if tf.TensorShape(shape).rank is not None else [0]
    return tf.zeros(dims, dtype=dtype)


def guard_graph_fn(fn, tout: list, shapes: list):
    """`fn` for a graph node: on a mismatch it returns placeholders and a set flag (its last
    output, int32) instead of raising; ValueError/TypeError propagate (InvalidArgumentError)."""
    def guarded(*xs):
        try:
            outs = list(fn(*xs))
        except HorovodMismatchError as exc:
            _last.message = _last_any[0] = str(exc)
            log.error("hvdlite collective failed (tf.errors.FailedPreconditionError): %s", exc)
            return [_placeholder(d, s) for d, s in zip(tout, shapes)] + \
                [tf.constant(1, dtype=tf.int32)]
        return outs + [tf.constant(0, dtype=tf.int32)]
    return guarded


def _failed_precondition(what: str):
    # No TensorFlow op raises FailedPrecondition with a runtime message; reading a variable
    # that does not exist raises it with a message naming the variable, so the name carries
    # the explanation.
    handle = tf.raw_ops.VarHandleOp(
        dtype=tf.int32, shape=[], container="hvdlite",
        shared_name=f"{what}: the ranks disagreed about this collective (the error message "
                    f"is logged above on every rank; hvdlite.tensorflow.errors.last_error())")
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)


def check_graph_outputs(what: str, outs: list) -> list:
    """Graph outputs of a guarded node (last one: the flag) -> its real outputs, which depend
    on a check that raises FailedPreconditionError when the flag is set."""
    flag, outs = outs[-1], outs[:-1]
    with tf.device("/cpu:0"):
        check = tf.cond(flag > 0, lambda: _failed_precondition(what),
                        lambda: tf.constant(0, dtype=tf.int32))
    with tf.control_dependencies([check]):
        return [tf.identity(o) for o in outs] if outs else [check]


__all__ = ["as_tf_error", "call_eager", "guard_graph_fn", "check_graph_outputs", "last_error",
           "HorovodInternalError"]
