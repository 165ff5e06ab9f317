"""`TorchState`: a model, an optimizer, samplers and plain attributes, committed together."""
from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch

from ...common.elastic import ObjectState, takes_root
from .. import functions as _functions
from ..zero import ZeroOptimizer
from .sampler import ElasticSampler

log = logging.getLogger(__name__)


class StateHandler:
    """Saves, restores and syncs one kind of value held by a `TorchState`."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self, root_rank: int = 0) -> None:
        """Make every rank's value rank `root_rank`'s. (A subclass written for Horovod, whose
        `sync(self)` takes no root, works too: TorchState.sync calls it without one.)"""
        raise NotImplementedError()

    def reset(self) -> None:
        """Called after the job re-formed (the world size may have changed)."""

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """`torch.nn.Module`: a deep copy of its state_dict; synced by broadcasting parameters and
    buffers."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_model_state)

    def sync(self, root_rank: int) -> None:
        _functions.broadcast_parameters(self.value.state_dict(), root_rank=root_rank,
                                        prefix="hvdlite.elastic.model.")


class OptimizerStateHandler(StateHandler):
    """`torch.optim.Optimizer` (and `hvd.DistributedOptimizer`): a deep copy of its state_dict.
    Restoring through `load_state_dict` also drops a DistributedOptimizer's gradient handles
    left over from the failed step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_optimizer_state)

    def sync(self, root_rank: int) -> None:
        _functions.broadcast_optimizer_state(self.value, root_rank=root_rank)

    def reset(self) -> None:
        # A DistributedOptimizer drops a partly counted step (see _drop_partial_step).
        drop = getattr(self.value, "_drop_partial_step", None)
        if drop is not None:
            drop()


class ShardedOptimizerStateHandler(OptimizerStateHandler):
    """A `DistributedOptimizer(..., zero_stage=1|2)`: commit keeps the full (consolidated) state,
    so that after the world size changes every rank re-shards and takes its new shard from it.

    No collective at construction (a worker joining later builds its `TorchState` alone);
    `save()` is collective, which is fine because every rank commits at the same step. A commit
    is followed by the host-update check, and a failure restores the commit, so at every reset
    the live state equals the saved one: re-sharding from it loses no step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        StateHandler.__init__(self, optimizer)
        self._saved_full: Optional[dict] = None
        self._initial_local = copy.deepcopy(optimizer.local_state_dict())

    def save(self) -> None:
        self._saved_full = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        if self._saved_full is not None:
            self.value.load_state_dict(copy.deepcopy(self._saved_full))
        else:
            self.value.load_local_state_dict(copy.deepcopy(self._initial_local))

    def reset(self) -> None:
        self.value.reshard()
        if self._saved_full is not None:
            self.value.load_state_dict(copy.deepcopy(self._saved_full))

    def sync(self, root_rank: int) -> None:
        saved = _functions.broadcast_object(self._saved_full, root_rank,
                                            name="hvdlite.elastic.zero_optimizer")
        if saved is not None:
            self._saved_full = saved
            self.value.load_state_dict(copy.deepcopy(saved))


class SamplerStateHandler(StateHandler):
    """`ElasticSampler`: which samples of the epoch are done; re-partitioned on reset."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_sampler_state)

    def sync(self, root_rank: int) -> None:
        state_dict = _functions.broadcast_object(self.value.state_dict(), root_rank,
                                                 name="hvdlite.elastic.sampler")
        self.value.load_state_dict(state_dict)

    def reset(self) -> None:
        self.value.reset()


_handler_registry: list[tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (ZeroOptimizer, ShardedOptimizerStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type]]:
    """The (value type, handler class) pairs `TorchState` consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type]]) -> None:
    global _handler_registry
    _handler_registry = list(registry)


def _handler_for(value: Any) -> Optional[StateHandler]:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training job: `TorchState(model, optimizer, epoch=0, batch=0)`.

    Modules, optimizers and `ElasticSampler`s (as `model`, `optimizer` or any keyword) are saved
    by deep-copying their state_dict and synced by broadcasting tensors; every other keyword is a
    plain attribute (`state.epoch`), deep-copied on commit.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value) if value is not None else None
            if handler is not None:
                handlers[name] = handler
            elif name in ("model", "optimizer") and value is None:
                object.__setattr__(self, name, None)
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        # Optimizers first: a worker whose optimizer has no state yet creates it with one step
        # on zero gradients, which moves weights under weight decay; the model sync that
        # follows puts them right.
        handlers = sorted(self._handlers.values(),
                          key=lambda h: not isinstance(h, OptimizerStateHandler))
        for handler in handlers:
            if takes_root(handler.sync):
                handler.sync(self.sync_root)
            else:
                # Horovod's StateHandler.sync(self): the handler broadcasts from where it
                # chooses (rank 0, in Horovod's own handlers).
                if self.sync_root != 0:
                    log.warning("%s.sync() takes no root rank, but rank %d holds the latest "
                                "commit: give it a root_rank argument (sync(self, root_rank)) "
                                "to sync from there", type(handler).__name__, self.sync_root)
                handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
