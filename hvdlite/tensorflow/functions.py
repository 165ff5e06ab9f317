"""Horovod's TensorFlow helpers: broadcast variables, broadcast and allgather Python objects
(horovod/tensorflow/functions.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import tensorflow as tf

from ..common import ops as _cops
from ..common.process_sets import ProcessSet
from . import mpi_ops as _ops
from .mpi_ops import broadcast_, broadcast_group, global_process_set


def broadcast_variables(variables: Any, root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Any:
    """Broadcast `variables` (tf.Variable or keras.Variable) from `root_rank` to every rank of
    the set, all in one fused submission.

    Eagerly the variables hold the root's values when this returns; in a graph it returns the op
    that assigns them. `inplace` is accepted for compatibility (both paths assign in place).
    """
    variables = list(variables)
    if not variables and not tf.executing_eagerly():
        return tf.no_op()
    # (Eagerly an empty list still takes part, so that ranks whose models differ fail at once:
    # mpi_ops.broadcast_group.)
    tf_vars = [_ops._tf_variable(v) for v in variables]
    for v, tv in zip(variables, tf_vars):
        if tv is None:
            raise ValueError(f"broadcast_variables needs variables (tf.Variable or "
                             f"keras.Variable), got {type(v).__name__}")
    if inplace:
        broadcast_(tf_vars, root_rank, process_set=process_set)
        return None if tf.executing_eagerly() else tf.no_op()
    values = broadcast_group([tv.read_value() for tv in tf_vars], root_rank,
                             process_set=process_set, kind="BroadcastVariables")
    assigns = [tv.assign(value, read_value=False) for tv, value in zip(tf_vars, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def _python_only(what: str) -> None:
    if not tf.executing_eagerly() and \
            getattr(tf.compat.v1.get_default_graph(), "building_function", False):
        raise ValueError(f"hvd.{what} moves Python objects and runs when called: call it "
                         f"outside tf.function (it would run once, while tracing)")


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Pickle `obj` on `root_rank` (a global rank) and return it on every rank of the set.

    Other ranks may pass anything (e.g. None). `session` is accepted for TF1 code and not needed:
    the transfer runs when this is called. `name` defaults to "broadcast_object" (Horovod used
    the object's type name, which hangs when non-root ranks pass an object of another type).
    """
    _python_only("broadcast_object")
    return _cops.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function `fn(obj)` that broadcasts `obj` from `root_rank` (Horovod's TF1 helper)."""
    def _bcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank=root_rank, session=session, name=name,
                                process_set=process_set)
    return _bcast


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Pickle `obj` on every rank of the set and return the list of all of them, in set-rank
    order. `name` defaults to "allgather_object"."""
    _python_only("allgather_object")
    return _cops.allgather_object(obj, name, process_set)


__all__ = ["broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object"]
