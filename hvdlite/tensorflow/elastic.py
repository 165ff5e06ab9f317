"""Elastic training for TensorFlow and Keras (Horovod's `horovod.tensorflow.elastic`).

    import hvdlite.tensorflow as hvd

    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

    train(state)

The states and `run` sit on hvdlite's common elastic runtime (`hvdlite.common.elastic`): commits
are in memory, a failure rolls every survivor back to the last commit, and after a reset all
ranks agree by one collective whether to sync and from which rank.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

from .._keras_callbacks import optimizer_variables, require_built
from ..common import basics as _basics
from ..common.elastic import HostUpdateResult, ObjectState, State, run_fn
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from . import mpi_ops as _ops

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState",
           "HostUpdateResult", "HorovodInternalError", "HostsUpdatedInterrupt"]

_MARKER = "HorovodInternalError"


def _reset() -> None:
    from . import init, shutdown

    shutdown()
    init()


def _as_horovod_error(exc: BaseException):
    """A collective that failed inside a graph (tf.function, model.fit) reaches Python as a
    tf.errors.OpError that carries the HorovodInternalError's text: turn it back."""
    if isinstance(exc, tf.errors.OpError) and _MARKER in (exc.message or str(exc)):
        text = exc.message or str(exc)
        start = text.find(_MARKER + ":")
        detail = text[start + len(_MARKER) + 1:].strip().splitlines()[0] if start >= 0 else text
        return HorovodInternalError(detail)
    return None


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run `func(state, ...)` so that it survives failures and host changes.

    On a peer failure every survivor rolls `state` back to its last commit, the job re-forms with
    the workers that are left (and any new ones) and `func` is called again; this works for
    failures inside `tf.function` and Keras `model.fit` too. Do not run collectives between
    `hvd.init()` and the first call of `func` (new workers start there).
    """

    @functools.wraps(func)
    def wrapped(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            converted = _as_horovod_error(exc)
            if converted is None:
                raise
            raise converted from exc

    return run_fn(wrapped, _reset)


def _variables_of(obj) -> list:
    """A model's or an optimizer's variables (a property on Keras 3, a method on tf_keras'
    legacy optimizers); none for a state without one."""
    return [] if obj is None else optimizer_variables(obj)


def _build_keras_optimizer(model, optimizer) -> None:
    """Keras 3 builds optimizers lazily (in the first step); build now so the optimizer's
    variables exist before the first commit (as Keras itself does under a distribution
    strategy)."""
    if optimizer is None or getattr(optimizer, "built", True) or \
            not getattr(model, "built", False):
        return
    try:
        import keras
        scope = keras.name_scope(optimizer.name, caller=optimizer)
    except Exception:
        scope = tf.name_scope(getattr(optimizer, "name", "optimizer"))
    with scope:
        optimizer.build(model.trainable_variables)


def _broadcast_in_place(variables: list, root_rank: int, name: str) -> None:
    """Fixed names: survivors and newly started workers must submit the same ones."""
    tf_vars = [_ops._tf_variable(v) for v in variables]
    pairs = [(v, tv) for v, tv in zip(variables, tf_vars) if tv is not None]
    if not pairs:
        return
    values = _ops.broadcast_group([tv.read_value() for _, tv in pairs], root_rank, name=name,
                                  kind="ElasticSync")
    for (_, tv), value in zip(pairs, values):
        tv.assign(value)


class TensorFlowKerasState(ObjectState):
    """A Keras model, its optimizer and plain attributes (`epoch=0, batch=0, ...`), committed,
    restored and synced together. Works eagerly (TensorFlow 2); `backend` is accepted for
    Horovod compatibility."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not tf.executing_eagerly():
            raise ValueError("TensorFlowKerasState needs eager execution (TensorFlow 2); for TF1 "
                             "graphs use TensorFlowState with a session")
        require_built(model)
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self.backend = backend
        _build_keras_optimizer(self.model, self.optimizer)
        self._saved_model_state: list = []
        self._saved_optimizer_state: list = []
        self._save_model()
        super().__init__(bcast_object=None, get_rank=_basics.rank, **kwargs)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def reset(self) -> None:
        # A DistributedOptimizer with backward_passes_per_step > 1: every rank drops its partial
        # sums, so all count the passes to the next reduction alike
        # (LocalGradientAggregationHelper.reset).
        agg = getattr(getattr(self.optimizer, "_hvd", None), "agg", None)
        if agg is not None:
            agg.reset()
        super().reset()

    def sync(self) -> None:
        _build_keras_optimizer(self.model, self.optimizer)
        _broadcast_in_place(_variables_of(self.model), self.sync_root,
                            "hvdlite.elastic.tf.model")
        _broadcast_in_place(_variables_of(self.optimizer), self.sync_root,
                            "hvdlite.elastic.tf.optimizer")
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        self._saved_model_state = [(v, tf.identity(_ops._read(v)))
                                   for v in _variables_of(self.model)]
        self._saved_optimizer_state = [(v, tf.identity(_ops._read(v)))
                                       for v in _variables_of(self.optimizer)]

    def _load_model(self) -> None:
        for var, value in self._saved_model_state + self._saved_optimizer_state:
            var.assign(value)


class TensorFlowState(ObjectState):
    """Plain TensorFlow variables (default: all TF1 global variables) and attributes.

    Eagerly the variables are assigned directly; with a TF1 `session` the values are read and
    assigned through it."""

    def __init__(self, variables=None, session=None, **kwargs):
        self.variables = list(variables) if variables is not None else \
            list(tf.compat.v1.global_variables())
        self.session = session
        self._values: list = []
        self._save_values()
        super().__init__(bcast_object=None, get_rank=_basics.rank, **kwargs)

    def save(self) -> None:
        self._save_values()
        super().save()

    def restore(self) -> None:
        self._load_values(self._values)
        super().restore()

    def sync(self) -> None:
        if self.session is None:
            _broadcast_in_place(self.variables, self.sync_root, "hvdlite.elastic.tf.variables")
        else:
            from .functions import broadcast_object
            values = broadcast_object(self._read_values(), self.sync_root,
                                      name="hvdlite.elastic.tf.variables")
            self._load_values(values)
        self._save_values()
        super().sync()

    def _read_values(self) -> list:
        if self.session is not None:
            return self.session.run(self.variables)
        return [v.numpy() for v in self.variables]

    def _save_values(self) -> None:
        self._values = self._read_values()

    def _load_values(self, values) -> None:
        if self.session is not None:
            for var, value in zip(self.variables, values):
                var.load(value, self.session)
        else:
            for var, value in zip(self.variables, values):
                var.assign(value)
