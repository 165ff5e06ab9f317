"""Elastic Keras training (Horovod's `horovod.tensorflow.keras.elastic`).

    import hvdlite.tensorflow.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(dataset, epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)

Put `CommitStateCallback` after the two Update callbacks, so a commit records the updated
epoch and batch. After a reset, Keras 2 (tf_keras) shortens the resumed epoch by `state.batch`
steps (`params['steps']`); Keras 3's fit does not read `params`, so skip the done batches in the
dataset itself (e.g. `dataset.skip(state.batch)`) or commit at epoch ends only.
"""
from __future__ import annotations

import tensorflow as tf

from ... import _keras_callbacks as _logic
from ..elastic import (HorovodInternalError, HostsUpdatedInterrupt, HostUpdateResult,
                       ObjectState, State, TensorFlowKerasState, run)

_keras = tf.keras

__all__ = ["KerasState", "TensorFlowKerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run", "State",
           "ObjectState", "HostUpdateResult", "HorovodInternalError", "HostsUpdatedInterrupt"]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer (default: `model.optimizer`) and plain attributes."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(_logic.CommitStateLogic, _keras.callbacks.Callback):
    __doc__ = _logic.CommitStateLogic.__doc__


class UpdateBatchStateCallback(_logic.UpdateBatchStateLogic, _keras.callbacks.Callback):
    __doc__ = _logic.UpdateBatchStateLogic.__doc__


class UpdateEpochStateCallback(_logic.UpdateEpochStateLogic, _keras.callbacks.Callback):
    __doc__ = _logic.UpdateEpochStateLogic.__doc__
