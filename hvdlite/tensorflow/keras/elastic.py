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


class CommitStateCallback(_keras.callbacks.Callback):
    """Commit `state` every `batches_per_commit` batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if batches_per_commit <= 0:
            raise ValueError("batches_per_commit must be > 0")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        # Every rank starts counting afresh after a reset, so they commit at the same steps.
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self):
        self.state.commit()


class UpdateBatchStateCallback(_keras.callbacks.Callback):
    """Track the batch of the current epoch in `state.batch` (0 at epoch ends); when training
    resumes mid-epoch, shorten that epoch by the batches already done (tf_keras)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_keras.callbacks.Callback):
    """Track the global epoch in `state.epoch` across resets (Keras counts from 0 at every
    `fit`): use `model.fit(..., epochs=total - state.epoch)`."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
