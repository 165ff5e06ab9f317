"""The elastic state of a Keras 3 model, for the backends whose variables hvdlite reads through
Keras (torch, JAX): `KerasState` keeps the model's and the optimizer's variables with plain
attributes (committed in memory, restored on failure, synced from the rank with the most
commits after a reset). A backend supplies how variables are broadcast, and may supply how its
trainer's state is put back into the variables first (JAX)."""
from __future__ import annotations

import keras

from .. import _keras_callbacks as _logic
from ..common.elastic import ObjectState


class KerasStateBase(ObjectState):
    """A Keras model, its optimizer (default: `model.optimizer`) and plain attributes
    (`epoch=0, batch=0`), committed, restored and synced together."""

    def __init__(self, model, optimizer=None, **kwargs):
        _logic.require_built(model)
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self._saved_variables: list = []
        self._save_variables()
        super().__init__(**kwargs)

    def _broadcast_variables(self, variables: list, root_rank: int) -> None:
        raise NotImplementedError

    def _sync_model(self) -> None:
        """Make the variables hold the model's current values (a backend's hook)."""

    def _variables(self) -> list:
        out = list(self.model.variables)
        if self.optimizer is not None and getattr(self.optimizer, "built", False):
            out += list(self.optimizer.variables)
        return out

    def _save_variables(self) -> None:
        self._sync_model()
        self._saved_variables = [keras.ops.convert_to_numpy(v.value).copy()
                                 for v in self._variables()]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        self._sync_model()
        for v, saved in zip(self._variables(), self._saved_variables):
            v.assign(saved)
        super().restore()

    def reset(self) -> None:
        # After every membership change, on every rank: a DistributedOptimizer with
        # backward_passes_per_step > 1 drops its partial sums, so all ranks count the passes to
        # the next reduction alike (_Distributed._hvd_reset_accumulation).
        drop = getattr(self.optimizer, "_hvd_reset_accumulation", None)
        if drop is not None:
            drop()
        super().reset()

    def sync(self) -> None:
        # From sync_root, the rank the reset agreement chose: the one with the most commits.
        # Rank 0 is a survivor whenever one is left, but it may have fewer commits than another
        # rank (a failure that cut a commit short on some ranks); syncing from it rolled every
        # rank back past a commit, and the attributes came from rank 0 as well.
        self._sync_model()
        self._broadcast_variables(self._variables(), self.sync_root)
        self._save_variables()
        super().sync()


class CommitStateCallback(_logic.CommitStateLogic, keras.callbacks.Callback):
    __doc__ = _logic.CommitStateLogic.__doc__


class UpdateBatchStateCallback(_logic.UpdateBatchStateLogic, keras.callbacks.Callback):
    __doc__ = _logic.UpdateBatchStateLogic.__doc__


class UpdateEpochStateCallback(_logic.UpdateEpochStateLogic, keras.callbacks.Callback):
    __doc__ = _logic.UpdateEpochStateLogic.__doc__
