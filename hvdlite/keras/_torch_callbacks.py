"""Horovod's Keras callbacks on Keras 3's torch backend (collectives through hvdlite.torch).

Same names, arguments and behaviour as hvdlite.tensorflow.keras.callbacks: both subclass the
shared behaviour (hvdlite/_keras_callbacks.py); what is here is the torch backend's part, the
broadcast, the average and the learning rate of a Keras 3 optimizer.
"""
from __future__ import annotations

import keras
import torch

from .. import _keras_callbacks as _logic
from .. import torch as _hvd
from ._torch import broadcast_variables


class BroadcastGlobalVariablesCallback(_logic.BroadcastGlobalVariablesLogic,
                                       keras.callbacks.Callback):
    __doc__ = _logic.BroadcastGlobalVariablesLogic.__doc__

    def _broadcast_variables(self, variables: list) -> None:
        broadcast_variables(variables, self.root_rank)


class MetricAverageCallback(_logic.MetricAverageLogic, keras.callbacks.Callback):
    __doc__ = _logic.MetricAverageLogic.__doc__

    def _allreduce_average(self, values: list) -> list:
        return _hvd.allreduce(torch.tensor(values, dtype=torch.float64), name=self.METRICS_NAME,
                              op=_hvd.Average).tolist()


def _get_lr(opt) -> float:
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


def _set_lr(opt, value: float) -> None:
    opt.learning_rate = value


class LearningRateScheduleCallback(_logic.LearningRateScheduleLogic, keras.callbacks.Callback):
    __doc__ = _logic.LearningRateScheduleLogic.__doc__

    _get_lr = staticmethod(_get_lr)
    _set_lr = staticmethod(_set_lr)


class LearningRateWarmupCallback(_logic.LearningRateWarmupLogic, LearningRateScheduleCallback):
    __doc__ = _logic.LearningRateWarmupLogic.__doc__


class BestModelCheckpoint(_logic.BestModelCheckpointLogic, keras.callbacks.ModelCheckpoint):
    __doc__ = _logic.BestModelCheckpointLogic.__doc__


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]
