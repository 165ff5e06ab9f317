"""Horovod's Keras callbacks (horovod.tensorflow.keras.callbacks), for Keras 3 and tf_keras.

They subclass the callbacks of the Keras that `tf.keras` resolves to, and the behaviour shared
with the torch backend's (hvdlite/_keras_callbacks.py); what is here is TensorFlow's part:
the broadcast and the average, the learning rate of tf_keras' legacy optimizers, and turning
XLA off. Callbacks run eagerly (between steps), so their collectives are plain eager ones.
"""
from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from ... import _keras_callbacks as _logic
from .. import mpi_ops as _ops
from ..functions import broadcast_variables
from .optimizer import is_distributed, is_keras3

_keras = tf.keras


def _avoid_xla(model) -> None:
    """hvdlite's gradient allreduce cannot run under XLA; Keras 3 turns XLA on by itself on GPUs
    (jit_compile="auto"). Turn it off for a model that trains with a DistributedOptimizer."""
    opt = getattr(model, "optimizer", None)
    if opt is None or not is_distributed(opt) or not is_keras3():
        return
    try:
        jit = model.jit_compile
    except Exception:
        return
    if jit:
        warnings.warn("hvdlite: compiling this model's train step without XLA "
                      "(jit_compile=False): hvdlite's gradient allreduce cannot run inside XLA.",
                      stacklevel=2)
        model.jit_compile = False
        model.train_function = None


class _HvdCallback(_keras.callbacks.Callback):
    def set_model(self, model):
        super().set_model(model)
        _avoid_xla(model)


class BroadcastGlobalVariablesCallback(_logic.BroadcastGlobalVariablesLogic, _HvdCallback):
    __doc__ = _logic.BroadcastGlobalVariablesLogic.__doc__

    @staticmethod
    def _var_key(v):
        from ..gradients import var_ref
        return var_ref(v)

    def _broadcast_variables(self, variables: list) -> None:
        broadcast_variables(variables, root_rank=self.root_rank)

    def _build_optimizer(self) -> None:
        # Keras 3 only (tf_keras' optimizers create their slots in the first step), under the
        # optimizer's name scope, as Keras builds it under a distribution strategy.
        opt = getattr(self.model, "optimizer", None)
        if opt is None or not is_keras3() or getattr(opt, "built", True) or \
                not getattr(self.model, "built", False):
            return
        import keras
        with keras.name_scope(opt.name, caller=opt):
            opt.build(self.model.trainable_variables)


class MetricAverageCallback(_logic.MetricAverageLogic, _HvdCallback):
    __doc__ = _logic.MetricAverageLogic.__doc__

    def _allreduce_average(self, values: list) -> list:
        reduced = _ops._allreduce(tf.constant(values, dtype=tf.float64), name=self.METRICS_NAME,
                                  op=_ops.Average)
        return reduced.numpy().tolist()


def _get_lr(opt) -> float:
    _logic.check_settable_lr(opt)
    lr = getattr(opt, "learning_rate", None)
    if lr is None:
        lr = getattr(opt, "lr")
    return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))


def _set_lr(opt, value: float) -> None:
    if hasattr(opt, "learning_rate"):
        lr = opt.learning_rate
        if hasattr(lr, "assign"):
            lr.assign(value)
        else:
            opt.learning_rate = value
    else:
        tf.keras.backend.set_value(opt.lr, value)


class LearningRateScheduleCallback(_logic.LearningRateScheduleLogic, _HvdCallback):
    __doc__ = _logic.LearningRateScheduleLogic.__doc__ + """
    On tf_keras' legacy optimizers, whose momentum is a variable, the coefficient is scaled
    for one batch instead, as Horovod does."""

    _get_lr = staticmethod(_get_lr)
    _set_lr = staticmethod(_set_lr)

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__(initial_lr, multiplier, start_epoch=start_epoch, end_epoch=end_epoch,
                         staircase=staircase, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.restore_momentum = None

    def _correct_momentum(self, opt, old_lr: float, new_lr: float) -> None:
        momentum = getattr(opt, "momentum", None)
        if momentum is None:
            return
        if hasattr(momentum, "assign") or isinstance(momentum, tf.Variable):
            # Variable coefficient (tf_keras legacy optimizers): scale it for this batch.
            self.restore_momentum = tf.keras.backend.get_value(momentum)
            tf.keras.backend.set_value(momentum, self.restore_momentum * new_lr / old_lr)
        elif float(momentum) != 0.0:
            ratio = new_lr / old_lr
            for buf in _logic.momentum_buffers(opt):
                buf.assign(buf * tf.cast(ratio, tf.as_dtype(buf.dtype)))

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            tf.keras.backend.set_value(self.model.optimizer.momentum, self.restore_momentum)
            self.restore_momentum = None


class LearningRateWarmupCallback(_logic.LearningRateWarmupLogic, LearningRateScheduleCallback):
    __doc__ = _logic.LearningRateWarmupLogic.__doc__


class BestModelCheckpoint(_logic.BestModelCheckpointLogic, _keras.callbacks.ModelCheckpoint):
    __doc__ = _logic.BestModelCheckpointLogic.__doc__

    @staticmethod
    def _placeholder(save_weights_only: bool) -> str:
        if not is_keras3():
            return "best.h5"
        return _logic.BestModelCheckpointLogic._placeholder(save_weights_only)


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]
