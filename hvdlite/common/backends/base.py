"""The data-plane interface every transport implements (gloo, mpi, nccl, shm, one rank).

Every call is collective over the process set and returns a pending work object with `.wait()`:
the engine launches calls only in the order the coordinator decided, from its one background
thread, and a finisher thread waits for them in that order. Byte-oriented ops (allgather,
broadcast, alltoall) receive uint8 views so a transport needs no dtype knowledge for them.

This module is the whole contract: `Communicator` lists the calls every transport makes and the
optional capabilities the engine may use, each with the default a transport that lacks it gets,
and the work classes say what the engine may do with a pending call. The engine uses nothing a
transport does not declare here.
"""
from __future__ import annotations

import abc
import math
from typing import Any, Callable, Optional

import torch


class Work(abc.ABC):
    """A pending collective. Transports return these, or works of their libraries registered
    as one (torch's c10d works: backends/gloo.py)."""

    __slots__ = ()

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the collective finished; raise if it failed."""


class PollableWork(Work):
    """Work that can be tested without blocking: the engine may poll a small one on its own
    thread for the communicator's `inline_poll_s` instead of handing it to its finisher."""

    __slots__ = ()

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once `wait()` would return at once."""


class ThreadedWork(PollableWork):
    """Work finished by a thread of the transport (shared memory's worker): the engine finishes
    the collective on that thread (`then`) and never polls it, which would only take the GIL
    from the thread doing the work."""

    __slots__ = ()

    @abc.abstractmethod
    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the thread that completes this work (at once if it is complete)."""


class Done(Work):
    """Work that is already finished (a one-rank set, or a transport that ran synchronously).
    The engine finishes a collective that yields DONE on its own thread, without a hand-off."""

    __slots__ = ()

    @staticmethod
    def wait() -> None:
        pass


DONE = Done()


class Agreement:
    """The steady state's rounds run as one small collective of the transport (steady.py,
    TransportRound): backends/mpi.Agreement and backends/shm.ShmAgreement."""

    # The widest round (in cache bits) it carries; a set with more live bits keeps its rounds
    # on the control connections.
    max_width: float = math.inf

    def close(self) -> None:
        """Free what the rounds hold (called when the communicator closes)."""


class Communicator:
    """One process set's transport. The five collectives and `close` are required; everything
    below them is an optional capability with the default shown, which a transport overrides
    where it offers more."""

    rank: int
    size: int
    device: str = "cpu"            # "cpu" or "cuda": where buffers must live

    def allreduce(self, tensor: torch.Tensor, op: int) -> Work:
        """In place. op is messages.SUM/MIN/MAX/PRODUCT (Average is SUM + postscale)."""
        raise NotImplementedError

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int) -> Work:
        """tensor holds size equal chunks; chunk i is this rank's contribution to rank i."""
        raise NotImplementedError

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        """uint8: output is size * len(tensor) bytes, rank-major."""
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        """uint8, in place."""
        raise NotImplementedError

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]) -> Work:
        """uint8; splits in bytes."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the transport's resources; the communicator is not used again."""

    # -- optional capabilities -------------------------------------------------------------
    # A small collective's work is polled on the engine's thread for this long before it goes
    # to the finisher (0: never polled). Worth it only where a peer answers within
    # microseconds: MPI, and shared memory while every rank has a core.
    inline_poll_s: float = 0.0
    # The steady state's rounds on the transport instead of the control connections (None:
    # rounds stay on the control connections).
    agreement: Optional[Agreement] = None
    # A duplicate communicator on which only the engine's finisher thread launches, for fused
    # responses whose large members are reduced in place, one call each, from
    # `inplace_min_bytes` on (collectives.Executor._allreduce_in_place; MPI on one host).
    in_order: Optional["Communicator"] = None
    inplace_min_bytes: int = 0
    # hvdlite's shared-memory channel, where the transport routes through one (shm.ShmRouted);
    # the engine only reads its counters.
    shm: Any = None

    @property
    def fuses_in_place(self) -> bool:
        """Whether a fused allreduce needs no fusion buffer here (`allreduce_tensors` takes any
        size): frontends then skip building one flat gradient buffer (ops.fuses_in_place)."""
        return False

    # A fused allreduce that copies the members in and the results out itself:
    #   allreduce_tensors(inputs, outputs, op, prescale, postscale) -> Work | None
    # None (the attribute): the transport has no such path; a call that returns None: this
    # response is not one it takes. Either way the engine packs a fusion buffer.
    allreduce_tensors: Optional[Callable[..., Optional[Work]]] = None
    # Several in-place allreduces chained inside the transport, one work for all of them:
    #   allreduce_sequence(tensors, op) -> Work | None   (on the `in_order` communicator)
    # None, or a call that returns None: the engine makes the calls one by one.
    allreduce_sequence: Optional[Callable[..., Optional[Work]]] = None

    def abandon(self) -> None:
        """The job failed: end the transfers still waited for now, not at the transport's
        timeout, so the engine's threads can be joined (MPI: MPICommunicator.abandon)."""
