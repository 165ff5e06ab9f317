"""Horovod's torch helpers: broadcast model parameters, optimizer state and arbitrary objects, and
allgather objects (horovod/torch/functions.py)."""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch

from ..common import ops as _ops
from ..common.process_sets import ProcessSet
from .mpi_ops import _check_inplace, allgather, broadcast_, global_process_set  # noqa: F401


def broadcast_parameters(params: Any, root_rank: int, prefix: Optional[str] = None) -> None:
    """Broadcast tensors in place from `root_rank` to every other rank.

    `params` is a dict (e.g. `model.state_dict()`, broadcast in sorted key order), or a list of
    `(name, tensor)` pairs (`model.named_parameters()`) or of tensors (`model.parameters()`).
    Names become the collectives' names (prefixed by `prefix` when given) and must be the same on
    every rank; unnamed tensors get names from the calling line.
    """
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        # Both named_parameters() and plain parameters().
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")

    tensors, names = [], []
    for i, (name, p) in enumerate(params):
        if prefix is not None:
            name = f"{prefix}{name if name is not None else f'noname.{i}'}"
        _check_inplace(p)
        tensors.append(p.detach())
        names.append(name)
    # One grouped broadcast, each tensor under its name: ranks whose models differ (a layer
    # more on one rank, or none at all: an empty list still takes part, ops._empty_group) fail
    # at once, on every rank, with both tensor counts (the group's size is checked across
    # ranks), instead of waiting for names the others never send until the stall shutdown.
    # In place: each tensor is its own output.
    _ops.broadcast(tensors, root_rank, names=names if None not in names else None,
                   group="broadcast_parameters" + (f".{prefix}" if prefix else ""),
                   outputs=tensors).wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None) -> None:
    """Broadcast an optimizer's state (tensors in place, scalars and group options by pickling)
    from `root_rank` to every other rank.

    An optimizer whose state is still empty is first initialised with one step on zero gradients
    (Horovod's algorithm). That step can move weights (weight decay); pass `model` to have its
    parameters put back to their values from before that step.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        # L-BFGS state is deeply nested and holds None values; Horovod does not support it.
        raise ValueError("cannot broadcast torch.optim.LBFGS state")

    state_dict = optimizer.state_dict()

    # A new optimizer has no state yet: create it with a step on zero gradients.
    if len(state_dict["state"]) == 0:
        saved = None
        if model is not None:
            saved = [(p, p.detach().clone()) for p in model.parameters()]
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in state_dict["state"]:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam):
                        p.grad = p.grad.to_sparse()
        # A DistributedOptimizer's own step() would allreduce every gradient, which deadlocks
        # unless all ranks call it; use the wrapped optimizer's step.
        if getattr(optimizer, "_hvd_distributed", False):
            # (_hvd_base: the wrapped class, which DistributedOptimizer sets on its subclass)
            optimizer._hvd_base.step(optimizer)  # type: ignore[attr-defined]
        else:
            optimizer.step()
        if saved is not None:
            with torch.no_grad():
                for p, value in saved:
                    p.copy_(value)
        state_dict = optimizer.state_dict()

    # Still empty: a stateless optimizer, nothing to broadcast.
    if len(state_dict["state"]) == 0:
        return

    params = []
    scalars = {}
    callbacks = {}
    occurrences: collections.defaultdict[Any, int] = collections.defaultdict(int)

    # Scalars go together through broadcast_object (out of place), then callbacks put them back.
    def _create_state_callback(pid: Any, name: Any) -> Callable[[Any], None]:
        def _assign_state(v: Any) -> None:
            state_dict["state"][pid][name] = v
        return _assign_state

    def _create_option_callback(index: int, option_key: str) -> Callable[[Any], None]:
        def _assign_option(v: Any) -> None:
            optimizer.param_groups[index][option_key] = v
        return _assign_option

    for index, group in enumerate(state_dict["param_groups"]):
        # Options such as the learning rate.
        for option_key, option_value in group.items():
            if option_key == "params":
                continue
            key = f"{option_key}.{index}"
            scalars[key] = option_value
            callbacks[key] = _create_option_callback(index, option_key)

        # Per-parameter state, in the model's layer order.
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                # requires_grad is False: no state to broadcast.
                continue
            param_state = state_dict["state"][pid]
            for name, p in param_state.items():
                # The same state name appears once per parameter: number the occurrences.
                occurrences[name] += 1
                key = f"{name}.{occurrences[name]}"
                if torch.is_tensor(p):
                    params.append((key, p))
                else:
                    scalars[key] = p
                    callbacks[key] = _create_state_callback(pid, name)

    # state_dict() returns the optimizer's own state tensors, so this broadcast is in place.
    broadcast_parameters(params, root_rank)

    scalars = broadcast_object(scalars, root_rank)
    for key, p in scalars.items():
        callbacks[key](p)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Pickle `obj` on `root_rank` (a global rank) and return it on every rank of `process_set`.

    Typical use: `state = broadcast_object(optimizer.state_dict(), 0)`. The other ranks may pass
    anything (e.g. None). `name` defaults to "broadcast_object" (Horovod used the object's type
    name, so a non-root rank passing an object of another type hung).
    """
    return _ops.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Pickle `obj` on every rank of `process_set` and return the list of all of them, ordered by
    rank within the set. `name` defaults to "allgather_object" (Horovod used the object's type
    name, which hangs when ranks hold objects of different types)."""
    return _ops.allgather_object(obj, name, process_set)


__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]
