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

    Durable state: with `checkpoint_dir`, every `checkpoint_every`-th commit also saves a
    checkpoint there (`hvdlite.torch.checkpoint`, asynchronous, the newest `checkpoint_keep`
    kept), `hvd.elastic.run` resumes from the newest complete one when the job starts, and a
    SIGTERM or SIGUSR1 makes every rank commit, save and exit (status 128 + the signal) at the
    next commit.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, *,
                 checkpoint_dir: Optional[str] = None, checkpoint_every: Optional[int] = None,
                 checkpoint_keep: int = 2, **kwargs: Any) -> None:
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int)
                                             or checkpoint_every < 1):
            raise ValueError(f"TorchState: checkpoint_every must be a positive number of "
                             f"commits, got {checkpoint_every!r}")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("TorchState: checkpoint_every needs a checkpoint_dir to save to")
        object.__setattr__(self, "_checkpoint_dir", checkpoint_dir)
        object.__setattr__(self, "_checkpoint_every", checkpoint_every)
        object.__setattr__(self, "_checkpoint_keep", checkpoint_keep)
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
        self._stop_watch = checkpoint_dir is not None

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

    # -- durable state ----------------------------------------------------------------------
    def _checkpoint_path(self) -> str:
        import os

        return os.path.join(self._checkpoint_dir, f"commit-{self._commit_count:08d}")

    def save_checkpoint(self, async_: bool = True) -> Optional[str]:
        """Save the committed state to `checkpoint_dir` now (a collective). Returns the path,
        or None when it failed (logged on every rank; training goes on)."""
        from .. import checkpoint
        from ...common import rendezvous

        path = self._checkpoint_path()
        link = rendezvous.driver_link()
        count = self._commit_count
        on_complete = None if link is None else (lambda p: link.report_checkpoint(count, p))
        try:
            checkpoint.save(self, path, async_=async_, keep=self._checkpoint_keep,
                            extra={"commit_count": count}, on_complete=on_complete)
        except checkpoint.CheckpointError as exc:
            log.error("elastic: %s", exc)
            return None
        return path

    def _after_commit(self) -> None:
        if self._checkpoint_every is not None \
                and self._commit_count % self._checkpoint_every == 0:
            self.save_checkpoint()

    def _resume(self) -> None:
        if self._checkpoint_dir is None:
            return
        from .. import checkpoint

        found = checkpoint.latest(self._checkpoint_dir)
        if found is None:
            log.info("elastic: no checkpoint in %s yet; starting from the initial state",
                     self._checkpoint_dir)
            return
        checkpoint.load(found, self)
        log.warning("elastic: resumed from checkpoint %s (commit %d)", found, self._commit_count)

    def _save_for_stop(self, signum: int) -> None:
        import signal as _signal

        from .. import checkpoint
        from ..mpi_ops import rank

        checkpoint.wait()
        path = self.save_checkpoint(async_=False)
        name = _signal.Signals(signum).name
        if rank() == 0:
            if path is None:
                print(f"hvdlite: stopped by {name} at commit {self._commit_count}; the "
                      f"checkpoint could not be saved (see the error above); the newest "
                      f"complete one in {self._checkpoint_dir} is kept", flush=True)
            else:
                print(f"hvdlite: stopped by {name} at commit {self._commit_count}; saved "
                      f"{path}; to resume, run the same command again: hvd.elastic.run "
                      f"resumes from the newest complete checkpoint in {self._checkpoint_dir}",
                      flush=True)
