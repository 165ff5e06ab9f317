"""What crosses a pipeline stage boundary: tensors or tuples of tensors, split into and
concatenated from micro-batches; the pipeline's errors and constants."""
from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from ...common.exceptions import HorovodInternalError


log = logging.getLogger(__name__)

_ACT = "\x00act"               # the edge item that carries the main activation
_LOOKAHEAD = 8                 # program ops ahead of the current one whose receives are posted
_pipeline_ids = itertools.count()


class PipelineError(RuntimeError):
    """A pipeline was used in a way it cannot run (bad arguments at run time, broken state)."""


class PipelineTimeoutError(HorovodInternalError):
    """A stage waited longer than its timeout for a message; the text names the message."""


# ---------------------------------------------------------------------- helpers
def _split(x, m: int, what: str) -> list:
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] < m:
            raise ValueError(f"{what}: chunks={m} needs at least {m} rows along dimension 0 "
                             f"(one per micro-batch), got shape {list(x.shape)}")
        return list(torch.tensor_split(x, m, dim=0))
    if isinstance(x, (tuple, list)):
        if not x:
            raise ValueError(f"{what} is an empty {type(x).__name__}")
        parts = [_split(v, m, f"{what}[{k}]") for k, v in enumerate(x)]
        rows = {tuple(q.shape[0] for q in part) for part in parts}
        if len(rows) != 1:
            raise ValueError(f"{what}: every tensor must have the same number of rows along "
                             f"dimension 0 to be split into micro-batches")
        return [type(x)(col) for col in zip(*parts)]
    raise TypeError(f"{what} must be a tensor or a tuple/list of tensors, not "
                    f"{type(x).__name__}")


def _rows(x) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.dim() else 1
    return _rows(x[0])


def _to(x, device):
    if device is None:
        return x
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x


def _tensors(value) -> list[tuple[Any, torch.Tensor]]:
    """(slot, tensor) for each tensor of a message value; slot None for a bare tensor."""
    if isinstance(value, torch.Tensor):
        return [(None, value)]
    if isinstance(value, (tuple, list)):
        return [(j, t) for j, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return []


def _check_value(value, where: str) -> None:
    if value is None or isinstance(value, torch.Tensor):
        return
    if isinstance(value, (tuple, list)):
        for j, t in enumerate(value):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}[{j}] is a {type(t).__name__}; stage boundaries carry "
                                f"tensors or tuples of tensors")
        return
    raise TypeError(f"{where} is a {type(value).__name__}; stage boundaries carry tensors or "
                    f"tuples of tensors")


def _cat(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    return type(first)(_cat([p[k] for p in parts]) for k in range(len(first)))


def _detach_value(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, (tuple, list)):
        return type(v)(_detach_value(x) for x in v)
    return v
