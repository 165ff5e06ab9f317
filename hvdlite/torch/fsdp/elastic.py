"""Elastic state of a fully sharded model and of an optimizer over its shards.

A commit keeps the whole model and optimizer state (gathered: a collective, made by every rank
at the same step, as the ZeRO optimizer's commit is). A rollback loads this rank's rows of it
again. After the job re-forms with another number of ranks, every parameter is cut again over
the new membership, and each rank takes its new rows from the commit, so no committed step is
lost. The handlers enter `TorchState`'s handler registry ahead of the plain ones.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from ...common.process_sets import global_process_set
from .. import functions as _functions
from ..elastic.state import StateHandler, get_handler_registry, set_handler_registry
from .api import FSDPModule
from .params import ShardGroup
from .state_dict import (_sharded_of, full_optimizer_state_dict, full_state_dict,
                         load_full_optimizer_state_dict, load_full_state_dict)


def _units_of_params(sps) -> list:
    seen, out = set(), []
    for sp in sps:
        if sp is not None and id(sp.unit) not in seen:
            seen.add(id(sp.unit))
            out.append(sp.unit)
    return out


def _recut(units) -> None:
    """Cut every unit again over the whole job if its size changed (idempotent: the model's
    handler and the optimizer's both call it, whichever resets first)."""
    for u in units:
        if u.group.replicate is not None or u.group.shard is not global_process_set:
            raise ValueError(f"elastic TorchState: {u.label} is sharded over a process set "
                             f"other than the whole job; an elastic job can only re-shard "
                             f"fully_shard(..., process_set=None / hvd.global_process_set)")
        if u.group.size != global_process_set.size() or u.group.rank != global_process_set.rank():
            u.recover(ShardGroup(global_process_set, None))
        else:
            u.recover()


class _ShardedOptimizerKind(type):
    def __instancecheck__(cls, value: Any) -> bool:
        return isinstance(value, torch.optim.Optimizer) and any(
            sp is not None for sp in _sharded_of(value))


class ShardedOptimizer(metaclass=_ShardedOptimizerKind):
    """Matches (isinstance) any optimizer over fully_shard's shards: the registry's key."""


class FullyShardedModelStateHandler(StateHandler):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._saved: dict | None = None        # None until the first commit

    def _units(self):
        return [m._hvd_fsdp_unit for m in self.value.modules() if hasattr(m, "_hvd_fsdp_unit")]

    def save(self) -> None:
        self._saved = copy.deepcopy(full_state_dict(self.value))

    def restore(self) -> None:
        _recut(self._units())
        if self._saved is not None:
            load_full_state_dict(self.value, self._saved)

    def reset(self) -> None:
        self.restore()

    def sync(self, root_rank: int) -> None:
        saved = _functions.broadcast_object(self._saved, root_rank,
                                            name="hvdlite.elastic.fsdp_model")
        if saved is not None:
            self._saved = saved
            load_full_state_dict(self.value, saved)


class FullyShardedOptimizerStateHandler(StateHandler):
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._saved: dict | None = None

    def save(self) -> None:
        self._saved = copy.deepcopy(full_optimizer_state_dict(None, self.value))

    def restore(self) -> None:
        _recut(_units_of_params(_sharded_of(self.value)))
        if self._saved is not None:
            load_full_optimizer_state_dict(self.value, self._saved)
        else:
            self.value.state.clear()

    def reset(self) -> None:
        self.restore()

    def sync(self, root_rank: int) -> None:
        saved = _functions.broadcast_object(self._saved, root_rank,
                                            name="hvdlite.elastic.fsdp_optimizer")
        if saved is not None:
            self._saved = saved
            load_full_optimizer_state_dict(self.value, saved)


def register() -> None:
    registry = [e for e in get_handler_registry()
                if e[1] not in (FullyShardedModelStateHandler, FullyShardedOptimizerStateHandler)]
    set_handler_registry([(FSDPModule, FullyShardedModelStateHandler),
                          (ShardedOptimizer, FullyShardedOptimizerStateHandler), *registry])
