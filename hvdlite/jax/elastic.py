"""Elastic JAX training (Horovod's elastic API): `run`, and the states of common/elastic.py.

A collective that fails inside `jax.jit` reaches Python as jax.errors.JaxRuntimeError; `run`
turns it back into the HorovodInternalError the host callback raised, so the state rolls back
and the job re-forms as it does for the other frontends. Keep a pytree of parameters in an
`ObjectState` attribute (`state.params = params`): committed, restored and synced (from the
rank with the most commits) with the other attributes.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from ..common.elastic import HostUpdateResult, ObjectState, State, run_fn  # noqa: F401
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from . import bridge as _bridge


def _reset() -> None:
    from .mpi_ops import init, shutdown

    shutdown()
    init()


def reraising(func: Callable[..., Any]) -> Callable[..., Any]:
    """`func`, raising the hvdlite exception behind a JaxRuntimeError (a collective that failed
    inside a compiled function) instead of it."""

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except jax.errors.JaxRuntimeError as exc:
            original = _bridge.translated(exc)
            if original is None:
                raise
            raise original from exc

    return wrapped


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run `func(state, ...)` so that it survives failures and host changes (for
    failures inside jax.jit too). Do not run collectives between `hvd.init()` and the first
    call of `func` (new workers start there)."""
    return run_fn(reraising(func), _reset)


__all__ = ["run", "State", "ObjectState", "HostUpdateResult", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
