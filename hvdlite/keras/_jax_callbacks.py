"""Horovod's Keras callbacks on Keras 3's JAX backend (collectives through hvdlite.jax).

Same names, arguments and behaviour as on the other backends (hvdlite/_keras_callbacks.py).
What differs on JAX: during an epoch of `model.fit` the model's and the optimizer's values live
in the trainer's state, not in the variables (Keras purges them), so a callback that reads or
sets a variable in the middle of an epoch (a learning rate adjusted every batch, its momentum
correction) first asks the trainer to put its state back (`model.jax_state_sync()`, Keras'
hook for callbacks); the next step reads it from the variables again.
"""
from __future__ import annotations

import keras

from .. import _keras_callbacks as _logic
from ._jax import _average_numbers, broadcast_variables


def sync_state(model) -> None:
    """Put the JAX trainer's state back into `model`'s variables (a no-op outside `fit`)."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


class BroadcastGlobalVariablesCallback(_logic.BroadcastGlobalVariablesLogic,
                                       keras.callbacks.Callback):
    __doc__ = _logic.BroadcastGlobalVariablesLogic.__doc__

    def _broadcast_variables(self, variables: list) -> None:
        sync_state(self.model)
        broadcast_variables(variables, self.root_rank)


class MetricAverageCallback(_logic.MetricAverageLogic, keras.callbacks.Callback):
    __doc__ = _logic.MetricAverageLogic.__doc__

    def _allreduce_average(self, values: list) -> list:
        return _average_numbers(values, self.METRICS_NAME)


def _get_lr(opt) -> float:
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


def _set_lr(opt, value: float) -> None:
    opt.learning_rate = value


class LearningRateScheduleCallback(_logic.LearningRateScheduleLogic, keras.callbacks.Callback):
    __doc__ = _logic.LearningRateScheduleLogic.__doc__

    _get_lr = staticmethod(_get_lr)
    _set_lr = staticmethod(_set_lr)

    def _adjust_learning_rate(self, epoch: float) -> None:
        sync_state(self.model)
        super()._adjust_learning_rate(epoch)


class LearningRateWarmupCallback(_logic.LearningRateWarmupLogic, LearningRateScheduleCallback):
    __doc__ = _logic.LearningRateWarmupLogic.__doc__


class BestModelCheckpoint(_logic.BestModelCheckpointLogic, keras.callbacks.ModelCheckpoint):
    __doc__ = _logic.BestModelCheckpointLogic.__doc__


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]
