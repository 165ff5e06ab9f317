"""Elastic Keras training on the torch backend: `KerasState` keeps the model's and the
optimizer's variables (committed in memory, restored on failure, synced from rank 0)."""
from __future__ import annotations

import keras

from ..torch.elastic import (HorovodInternalError, HostsUpdatedInterrupt,  # noqa: F401
                             ObjectState, run)
from ..common.elastic import State
from ._torch import broadcast_variables


class KerasState(State):
    """Model (and optimizer) variables plus extra attributes (`epoch=0, batch=0`)."""

    def __init__(self, model, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self._extra = ObjectState(**kwargs)
        for k in kwargs:
            setattr(self, k, getattr(self._extra, k))
        self._saved = None
        super().__init__()
        self.save()

    def _variables(self):
        out = list(self.model.variables)
        if self.optimizer is not None and getattr(self.optimizer, "built", False):
            out += list(self.optimizer.variables)
        return out

    def save(self):
        self._saved = [keras.ops.convert_to_numpy(v.value).copy() for v in self._variables()]
        for k in self._extra._saved_state:
            setattr(self._extra, k, getattr(self, k))
        self._extra.save()

    def restore(self):
        for v, s in zip(self._variables(), self._saved or []):
            v.assign(s)
        self._extra.restore()
        for k in self._extra._saved_state:
            setattr(self, k, getattr(self._extra, k))

    def sync(self):
        broadcast_variables(self._variables(), 0)
        for k in self._extra._saved_state:
            setattr(self._extra, k, getattr(self, k))
        self._extra.sync()
        for k in self._extra._saved_state:
            setattr(self, k, getattr(self._extra, k))
        self.save()


__all__ = ["KerasState", "ObjectState", "run", "HorovodInternalError", "HostsUpdatedInterrupt"]
