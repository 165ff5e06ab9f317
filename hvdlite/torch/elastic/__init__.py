"""Elastic training for PyTorch (Horovod's `horovod.torch.elastic`).

    import hvdlite.torch as hvd

    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

Launch with `hvdlite-run --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py`.
"""
from __future__ import annotations

from typing import Any, Callable

from ...common.elastic import HostUpdateResult, ObjectState, State, run_fn
from ...common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..mpi_ops import init, shutdown  # noqa: F401  (in Horovod's horovod.torch.elastic too)
from .sampler import ElasticSampler
from .state import (ModelStateHandler, OptimizerStateHandler, SamplerStateHandler,
                    StateHandler, TorchState, get_handler_registry, set_handler_registry)

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "StateHandler",
           "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "get_handler_registry", "set_handler_registry", "HostUpdateResult",
           "HorovodInternalError", "HostsUpdatedInterrupt"]


def _reset() -> None:
    shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run `func(state, ...)` so that it survives failures and host changes.

    On a peer failure every survivor rolls `state` back to its last commit, the job re-forms with
    the workers that are left (and any new ones), and `func` is called again. When hosts are
    added or removed, `state.commit()` / `state.check_host_updates()` raise
    `HostsUpdatedInterrupt` on every rank at the same step and the job re-forms without a
    rollback. Do not run collectives between `hvd.init()` and the first call of `func`: new
    workers start there while the survivors are already inside.
    """
    return run_fn(func, _reset)
