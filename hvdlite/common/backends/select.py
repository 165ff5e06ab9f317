"""Which transport a job uses, and the factory that builds a process set's communicator on it.

Kept here, beside the transports, so `basics` (lifecycle and topology) never names one.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from torch.distributed import PrefixStore

from ..config import choice as config_choice
from . import mpi as mpi_backend
from . import nccl as nccl_backend
from .base import Communicator
from .gloo import GlooCommunicator
from .local import SelfCommunicator

CommFactory = Callable[..., Communicator]
log = logging.getLogger(__name__)


def choose_transport(comm) -> str:
    """gloo or mpi, as Horovod's HOROVOD_CPU_OPERATIONS says; under mpirun, MPI by default."""
    choice = config_choice("CPU_OPERATIONS")
    if comm is not None and choice == "gloo":
        raise ValueError("init(comm=...) takes an MPI communicator or a list of MPI ranks, but "
                         "HOROVOD_CPU_OPERATIONS is 'gloo'; unset it or set it to 'mpi' (or "
                         "call init() without comm).")
    if comm is not None or choice == "mpi":
        if not mpi_backend.available():
            raise ValueError("the MPI transport needs mpi4py and an MPI library: "
                             "pip install mpi4py mpich (or use HOROVOD_CPU_OPERATIONS=gloo)")
        return "mpi"
    if not choice and mpi_backend.launched_by_mpi() and mpi_backend.available():
        return "mpi"
    return "gloo"


def mpi_world(transport: str, comm) -> Any:
    """The MPI communicator ranks meet over, or None: under mpirun (or with init(comm=...))
    ranks meet over MPI whatever the transport."""
    if transport == "mpi" or mpi_backend.started_by_mpi():
        return mpi_backend.world(comm)
    return None


def comm_factory(transport: str, *, store, prefix: str, world, rank: int,
                 timeout_s: float) -> CommFactory:
    """A function (set_id, ranks, kind, device) -> Communicator for this job: a local copy for a
    one-rank set, NCCL for CUDA buffers when available and every rank has its own GPU, else MPI
    or gloo as chosen (CUDA tensors are then staged through host memory)."""

    def build(set_id: int, ranks: list, kind: str = "cpu", device: int = -1) -> Communicator:
        if len(ranks) == 1:
            return SelfCommunicator()
        if kind == "cuda" and nccl_backend.available():
            where = f"{prefix}nccl/{set_id}/"
            me, n = ranks.index(rank), len(ranks)
            shared = nccl_backend.shared_gpus(store, where, me, n, device)
            if not shared:
                return nccl_backend.NCCLCommunicator(store, where, me, n, timeout_s, device)
            if me == 0:
                groups = "; ".join(f"ranks {[ranks[i] for i in g]}" for g in shared)
                log.warning(
                    "%s share a GPU: NCCL needs one GPU per rank, so hvdlite moves this process "
                    "set's CUDA tensors through host memory over %s (slower). To use NCCL, give "
                    "each rank its own GPU: torch.cuda.set_device(hvd.local_rank()). (To test "
                    "NCCL with ranks on one GPU, give each rank its own NCCL_HOSTID.)",
                    groups, transport)
        if transport == "mpi":
            # (Only one communicator may have an in-order duplicate: backends/mpi.py.)
            return mpi_backend.MPICommunicator.for_ranks(
                world, ranks, in_order=set_id == 0 and kind == "cpu",
                store=PrefixStore(f"{prefix}mpi-{kind}/{set_id}/shm/", store),
                timeout_s=timeout_s)
        # CUDA tensors staged through host memory get their own gloo group: the set's CPU one
        # may already hold the `pg/{set_id}/` keys in the store.
        where = f"{prefix}pg/{set_id}/" if kind == "cpu" else f"{prefix}pg-{kind}/{set_id}/"
        return GlooCommunicator(store, where, ranks.index(rank), len(ranks), timeout_s)

    return build
