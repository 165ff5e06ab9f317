"""Collective helpers for the add-ons.

Every byte the add-ons move goes through `hvdlite.torch` (and so through the engine: negotiation
by name, validation, stall inspector, timeline, error propagation); nothing here talks to a
transport. Helpers are synchronous unless named `*_async`, and skip the engine entirely on a
process set of one rank (the collective would be the identity).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from .. import mpi_ops
from ...common import basics as _basics
from ...common import naming
from ...common.process_sets import ProcessSet


def set_size(ps: ProcessSet) -> int:
    n = ps.size()
    if n is None:
        raise ValueError(f"{ps} is not registered (it was removed, or hvd.shutdown() ran since it "
                         f"was created); build the mesh/layers again after hvd.init().")
    return n


def set_rank(ps: ProcessSet) -> int:
    try:
        r = ps.rank()
    except ValueError:
        r = -1
    if r is None:
        set_size(ps)
    if r < 0:
        raise ValueError(f"rank {_basics.rank()} is not a member of {ps}; use the process set "
                         f"that contains this rank (for example mesh.tp / mesh.pp of hvdlite's "
                         f"mesh()).")
    return r


def site_name(prefix: str) -> str:
    """A stable collective name for an unnamed call: the calling line outside hvdlite. Stable
    (no per-call counter) so the engine caches it every step; calls are synchronous, so repeated
    calls from one line never overlap."""
    return naming.site_name(prefix)


def shape_tag(t: torch.Tensor) -> str:
    """A short shape suffix for collective names: tensors of different shapes get their own
    names, so the engine's response cache keeps one entry per shape instead of thrashing."""
    return "x".join(str(d) for d in t.shape) or "scalar"


def _name(base: Optional[str], t: torch.Tensor) -> Optional[str]:
    return None if base is None else f"{base}.{shape_tag(t)}"


def allreduce(t: torch.Tensor, ps: ProcessSet, name: Optional[str], op=mpi_ops.Sum
              ) -> torch.Tensor:
    """Reduce `t` over `ps` (no autograd: the add-ons define their own gradients)."""
    if set_size(ps) == 1:
        return t
    return mpi_ops.synchronize(mpi_ops.allreduce_async(t.detach().contiguous(),
                                                       name=_name(name, t), op=op,
                                                       process_set=ps))


def allgather_last_dim(t: torch.Tensor, ps: ProcessSet, name: Optional[str]) -> torch.Tensor:
    """Concatenate every set rank's `t` along the last dimension, in set-rank order."""
    n = set_size(ps)
    if n == 1:
        return t
    stacked = mpi_ops.synchronize(mpi_ops.allgather_async(t.detach().unsqueeze(0).contiguous(),
                                                          name=_name(name, t), process_set=ps))
    return torch.cat(list(stacked.unbind(0)), dim=-1)


def allgather_dim(t: torch.Tensor, dim: int, ps: ProcessSet, name: Optional[str]
                  ) -> torch.Tensor:
    """Concatenate every set rank's `t` along `dim` (shapes must match), in set-rank order."""
    n = set_size(ps)
    if n == 1:
        return t.detach()
    stacked = mpi_ops.synchronize(mpi_ops.allgather_async(t.detach().unsqueeze(0).contiguous(),
                                                          name=_name(name, t), process_set=ps))
    return torch.cat(list(stacked.unbind(0)), dim=dim)


def split_last_dim(t: torch.Tensor, ps: ProcessSet, what: str = "tensor") -> torch.Tensor:
    """This set rank's contiguous slice of the last dimension."""
    n = set_size(ps)
    if n == 1:
        return t
    last = t.shape[-1]
    if last % n:
        raise ValueError(f"cannot split the last dimension ({last}) of {what} {list(t.shape)} "
                         f"into {n} tensor-parallel parts: it is not divisible by {n}.")
    k = last // n
    return t.narrow(-1, set_rank(ps) * k, k).contiguous()


def wait_handle(handle: int, *, timeout: Optional[float] = None,
                warn_after: Optional[float] = None,
                on_warn: Optional[Callable[[float], None]] = None,
                on_timeout: Optional[Callable[[float], Exception]] = None):
    """`synchronize(handle)`, but warn (once per `warn_after` seconds) and raise
    `on_timeout(waited)` after `timeout` seconds instead of waiting forever.

    None or 0 for either limit disables it."""
    start = time.monotonic()
    try:
        pending = mpi_ops.get_handle(handle)
    except ValueError:       # already synchronized: synchronize() says so its own way
        return mpi_ops.synchronize(handle)
    next_warn = start + warn_after if warn_after else None
    deadline = start + timeout if timeout else None
    while True:
        now = time.monotonic()
        slice_s = 1.0
        if next_warn is not None:
            slice_s = min(slice_s, max(0.0, next_warn - now))
        if deadline is not None:
            slice_s = min(slice_s, max(0.0, deadline - now))
        try:
            pending.wait(timeout=slice_s)
            break
        except TimeoutError:
            pass
        except Exception:    # failed: synchronize re-raises the error and frees the handle
            return mpi_ops.synchronize(handle)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            if on_timeout is not None:
                raise on_timeout(now - start)
            raise TimeoutError(f"collective did not finish within {timeout:.0f} s")
        if next_warn is not None and now >= next_warn:
            if on_warn is not None:
                on_warn(now - start)
            next_warn = now + warn_after
    return mpi_ops.synchronize(handle)
