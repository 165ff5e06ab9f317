"""Elastic Keras training on the torch backend (`horovod.keras.elastic`'s API).

`KerasState` keeps the model's and the optimizer's variables with plain attributes (committed
in memory, restored on failure, synced from the rank with the most commits after a reset;
_state.py), and the callbacks are those of hvdlite.tensorflow.keras.elastic
(hvdlite/_keras_callbacks.py):

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)
"""
from __future__ import annotations

from ..common.elastic import HostUpdateResult, ObjectState, State  # noqa: F401
from ..torch.elastic import HorovodInternalError, HostsUpdatedInterrupt, run  # noqa: F401
from ._state import (CommitStateCallback, KerasStateBase, UpdateBatchStateCallback,  # noqa: F401
                     UpdateEpochStateCallback)
from ._torch import broadcast_variables


class KerasState(KerasStateBase):
    __doc__ = KerasStateBase.__doc__

    def _broadcast_variables(self, variables: list, root_rank: int) -> None:
        broadcast_variables(variables, root_rank)


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "State", "ObjectState", "HostUpdateResult",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
