"""Hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1, `hvdlite-run --hierarchical-allreduce`).

Across hosts, a flat allreduce sends every rank's buffer over the slow links. The hierarchical form
sends one buffer per host: reduce within the host, allreduce across hosts among each host's first
rank (its local rank 0), broadcast the result within the host. It is built from the transport's
own collectives on two extra communicators (this host's ranks, and the hosts' leaders), so it
works on gloo and MPI alike.

It is hooked in at one place: `wrap_factory` wraps the engine's communicator factory, and only the
global set's CPU communicator is replaced. Its allreduce runs the three steps in order on one
helper thread per communicator, so every rank issues the sub-collectives in the same order while
the engine thread goes on launching other work; every other collective goes straight to the flat
communicator.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Mapping, Optional

import torch

from .backends.base import Communicator, Work

log = logging.getLogger(__name__)

CommFactory = Callable[..., Any]


class _Pending(Work):
    """The transport-style pending work of one hierarchical allreduce (`.wait()` raises its
    error). The helper thread always finishes a job: every step waits on the transport, whose
    own timeout (HOROVOD_GLOO_TIMEOUT_SECONDS) turns a lost peer into an error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


def host_groups(hosts: Mapping[Any, str], size: int) -> list[list[int]]:
    """Ranks grouped by host, hosts in order of their lowest rank (the engine's topology)."""
    groups: dict[str, list[int]] = {}
    for r in range(size):
        name = hosts.get(r, hosts.get(str(r)))  # type: ignore[call-overload]
        groups.setdefault(str(name), []).append(r)
    return list(groups.values())


class HierarchicalCommunicator(Communicator):
    """The global set's communicator with a three-step allreduce; everything else is `flat`'s."""

    def __init__(self, flat: Any, rank: int, groups: list[list[int]], make: CommFactory) -> None:
        self.flat = flat
        self.rank, self.size, self.device = flat.rank, flat.size, flat.device
        self.groups = groups
        self.local_ranks = next(g for g in groups if rank in g)
        self.leaders = [g[0] for g in groups]
        self._host = groups.index(self.local_ranks)
        self._global_rank = rank
        self._make = make
        self.local: Any = None
        self.cross: Any = None
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="hvdlite-hierarchical",
                                        daemon=True)
        self._thread.start()

    # Everything but allreduce is `flat`'s, its optional capabilities too (backends/base.py).
    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int) -> Work:
        return self.flat.reducescatter(output, tensor, op)

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        return self.flat.allgather(output, tensor)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self.flat.broadcast(tensor, root)

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]) -> Work:
        return self.flat.alltoall(output, tensor, out_splits, in_splits)

    def abandon(self) -> None:
        self.flat.abandon()

    inline_poll_s = property(lambda self: self.flat.inline_poll_s)
    agreement = property(lambda self: self.flat.agreement)
    in_order = property(lambda self: self.flat.in_order)
    inplace_min_bytes = property(lambda self: self.flat.inplace_min_bytes)
    shm = property(lambda self: self.flat.shm)
    fuses_in_place = property(lambda self: self.flat.fuses_in_place)
    allreduce_tensors = property(lambda self: self.flat.allreduce_tensors)
    allreduce_sequence = property(lambda self: self.flat.allreduce_sequence)

    def allreduce(self, tensor: torch.Tensor, op: int) -> _Pending:
        pending = _Pending()
        self._jobs.put((tensor, op, pending))
        return pending

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            tensor, op, pending = job
            try:
                self._allreduce(tensor, op)
            except BaseException as exc:  # handed to the waiting finisher thread
                pending.finish(exc)
            else:
                pending.finish()

    def _allreduce(self, tensor: torch.Tensor, op: int) -> None:
        if self.local is None:
            # Built on first use, on this thread, in the same order on every rank: this host's
            # communicator first, then the leaders' (whose members built their own first).
            self.local = self._make(f"hier-local-{self._host}", self.local_ranks)
            if self._global_rank in self.leaders:
                self.cross = self._make("hier-cross", self.leaders)
        if len(self.local_ranks) > 1:
            self.local.allreduce(tensor, op).wait()            # 1. reduce within the host
        if self.cross is not None and len(self.leaders) > 1:
            self.cross.allreduce(tensor, op).wait()            # 2. across hosts, leaders only
        if len(self.local_ranks) > 1:                           # 3. broadcast within the host
            self.local.broadcast(tensor.reshape(-1).view(torch.uint8), 0).wait()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5.0)
        for comm in (self.local, self.cross, self.flat):
            if comm is not None:
                try:
                    comm.close()
                except Exception:
                    pass


def wrap_factory(factory: CommFactory, rank: int, hosts: Mapping[Any, str],
                 size: int) -> CommFactory:
    """The engine's communicator factory, with the global set's CPU communicator made
    hierarchical. With one host, or one rank per host, the flat allreduce is already optimal and
    the factory is returned unchanged."""
    groups = host_groups(hosts, size)
    if len(groups) < 2 or all(len(g) == 1 for g in groups):
        log.info("hierarchical allreduce: %d host(s), %d rank(s): the flat allreduce is used",
                 len(groups), size)
        return factory

    def make(set_id: Any, ranks: list, kind: str = "cpu", device: int = -1) -> Any:
        comm = factory(set_id, ranks, kind, device)
        if set_id != 0 or kind != "cpu":
            return comm
        return HierarchicalCommunicator(comm, rank, groups,
                                        lambda name, members: factory(name, members, "cpu"))

    log.info("hierarchical allreduce over %d hosts: %s", len(groups), groups)
    return make
