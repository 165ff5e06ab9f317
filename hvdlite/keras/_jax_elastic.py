"""Elastic Keras training on the JAX backend (`horovod.keras.elastic`'s API; see
_torch_elastic.py for the pattern). `run` is hvdlite.jax.elastic's: a collective that fails
inside the compiled train step reaches `fit` as a JaxRuntimeError and is raised as the
HorovodInternalError behind it, so the state rolls back. `KerasState` puts the trainer's state
back into the variables before it reads them (in the middle of an epoch Keras keeps them out)."""
from __future__ import annotations

from ..common.elastic import HostUpdateResult, ObjectState, State  # noqa: F401
from ..jax.elastic import HorovodInternalError, HostsUpdatedInterrupt, run  # noqa: F401
from ._jax import broadcast_variables
from ._jax_callbacks import sync_state
from ._state import (CommitStateCallback, KerasStateBase, UpdateBatchStateCallback,  # noqa: F401
                     UpdateEpochStateCallback)


class KerasState(KerasStateBase):
    __doc__ = KerasStateBase.__doc__

    def _sync_model(self) -> None:
        sync_state(self.model)

    def _broadcast_variables(self, variables: list, root_rank: int) -> None:
        broadcast_variables(variables, root_rank)


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "State", "ObjectState", "HostUpdateResult",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
