"""Horovod's TensorFlow helpers: broadcast variables, broadcast and allgather Python objects
(horovod/tensorflow/functions.py)."""
from __future__ import annotations

import io

import cloudpickle
import numpy as np
import tensorflow as tf
import torch

from ..common import basics as _basics
from ..common.engine import Entry
from ..common.messages import ALLGATHER, BROADCAST, Request
from . import mpi_ops as _ops
from .mpi_ops import broadcast_, broadcast_group, global_process_set


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Broadcast `variables` (tf.Variable or keras.Variable) from `root_rank` to every rank of
    the set, all in one fused submission.

    Eagerly the variables hold the root's values when this returns; in a graph it returns the op
    that assigns them. `inplace` is accepted for compatibility (both paths assign in place).
    """
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
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


def _submit_wait(entries):
    return _basics.wait(_basics.submit(entries))


def _bytes_of(obj) -> torch.Tensor:
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Pickle `obj` on `root_rank` (a global rank) and return it on every rank of the set.

    Other ranks may pass anything (e.g. None). `session` is accepted for TF1 code and not needed:
    the transfer runs when this is called. `name` defaults to "broadcast_object" (Horovod used
    the object's type name, which hangs when non-root ranks pass an object of another type).
    """
    _python_only("broadcast_object")
    name = name or "broadcast_object"
    set_id = _ops._set_id(process_set)
    me = _basics.rank()
    if me == root_rank:
        payload = _bytes_of(obj)
        sz = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        payload = None
        sz = torch.zeros(1, dtype=torch.int64)
    req = Request(rank=me, name=name + ".sz", type=BROADCAST, dtype="int64", shape=(1,),
                  root_rank=int(root_rank), process_set_id=set_id)
    (sz,) = _submit_wait([Entry(req, sz, sz)])
    n = int(sz[0])
    if payload is None:
        payload = torch.empty(n, dtype=torch.uint8)
    req = Request(rank=me, name=name + ".t", type=BROADCAST, dtype="uint8", shape=(n,),
                  root_rank=int(root_rank), process_set_id=set_id, cacheable=False)
    (payload,) = _submit_wait([Entry(req, payload, payload)])
    if me == root_rank:
        return obj
    return cloudpickle.loads(payload.numpy().tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function `fn(obj)` that broadcasts `obj` from `root_rank` (Horovod's TF1 helper)."""
    def _bcast(obj):
        return broadcast_object(obj, root_rank=root_rank, session=session, name=name,
                                process_set=process_set)
    return _bcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Pickle `obj` on every rank of the set and return the list of all of them, in set-rank
    order. `name` defaults to "allgather_object"."""
    _python_only("allgather_object")
    name = name or "allgather_object"
    set_id = _ops._set_id(process_set)
    me = _basics.rank()
    payload = _bytes_of(obj)
    sz = torch.tensor([payload.numel()], dtype=torch.int64)
    req = Request(rank=me, name=name + ".sz", type=ALLGATHER, dtype="int64", shape=(1,),
                  process_set_id=set_id)
    (sizes,) = _submit_wait([Entry(req, sz)])
    req = Request(rank=me, name=name + ".t", type=ALLGATHER, dtype="uint8",
                  shape=(payload.numel(),), process_set_id=set_id, cacheable=False)
    (gathered,) = _submit_wait([Entry(req, payload)])
    sizes = sizes.numpy().astype(np.int64)
    data = gathered.numpy().tobytes()
    out, start = [], 0
    for n in sizes:
        out.append(cloudpickle.loads(data[start:start + int(n)]))
        start += int(n)
    return out


__all__ = ["broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object"]
