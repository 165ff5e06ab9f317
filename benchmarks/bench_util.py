"""Small pieces the benchmark scripts share (run as `python benchmarks/<name>.py`, so this
directory is on sys.path)."""
from __future__ import annotations

import socket
from typing import Callable

import torch
import torch.nn.functional as F


def free_port() -> int:
    """A TCP port free on this host now, for the peer's torch.distributed store (rank 0 picks
    it and broadcasts it with hvd.broadcast_object)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
             y: torch.Tensor) -> Callable[[], None]:
    """One classification training step, the same work for every contender."""
    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step
