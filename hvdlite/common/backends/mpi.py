"""MPI transport: mpi4py over the MPICH (or Open MPI) wheel from PyPI, no system MPI needed.

On one host MPICH moves data through shared memory: ~6 µs for 4 KiB and several GB/s, against
gloo's TCP loopback. Calls are non-blocking (I* collectives); the engine's finisher thread waits
for them, so MPI must run with MPI_THREAD_MULTIPLE (mpi4py asks for it by default).
"""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import torch

from .. import config
from ..threads import local_ranks as _local_ranks, usable_cores
from ..messages import MAX, MIN, PRODUCT, SUM
from . import shm

try:
    from mpi4py import MPI
except ImportError:  # the caller turns this into a clear message
    MPI = None

# Reductions MPI has no type for run in float32 and are cast back.
_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def available() -> bool:
    return MPI is not None


_OPS: dict = {}


def _ops() -> dict:
    """hvdlite's reduce ops -> MPI's (built once: a dict per call cost ~1 us)."""
    if not _OPS:
        _OPS.update({SUM: MPI.SUM, MIN: MPI.MIN, MAX: MPI.MAX, PRODUCT: MPI.PROD})
    return _OPS


def wait_mode(local_ranks: int | None = None) -> str:
    """'spin' or 'yield': how waits for MPI requests use the core.

    MPICH's Wait busy-polls: the lowest latency while every rank owns a core, but when ranks
    outnumber cores the spinning ranks take the core from the ones they wait for (4 ranks on 2
    cores ran the training step 1.4-1.6x slower than DDP). 'yield' polls with Test() and gives
    the core away between polls. HVDLITE_MPI_WAIT (or HOROVOD_MPI_WAIT) = spin | yield | auto;
    auto (the default) yields when this host runs more ranks than this process may use cores.
    """
    choice = (config.env("MPI_WAIT") or "auto").strip().lower()
    if choice in ("spin", "yield"):
        return choice
    if choice != "auto":
        raise ValueError(f"HVDLITE_MPI_WAIT={choice!r}: use spin, yield or auto")
    if local_ranks is None:
        local_ranks = _local_ranks(MPI.COMM_WORLD.Get_size() if MPI is not None else 1)
    return "yield" if local_ranks > usable_cores() else "spin"


INLINE_POLL_S = 250e-6


def _yielding_wait(req) -> None:
    """Poll with Test(), sleeping a little longer each time (up to 200 us) so the core goes to
    the rank being waited for; never spins for long."""
    pause = 0.0
    while not req.Test():
        time.sleep(pause)
        pause = min(pause * 2 or 10e-6, 200e-6)


class _Request:
    """A pending MPI request; optionally copies a widened result back."""

    __slots__ = ("req", "wide", "out", "yielding")

    def __init__(self, req, wide: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 yielding: bool = False):
        self.req, self.wide, self.out, self.yielding = req, wide, out, yielding

    def wait(self) -> None:
        if self.yielding:
            _yielding_wait(self.req)
        else:
            self.req.Wait()
        if self.wide is not None:
            self.out.copy_(self.wide)

    def is_completed(self) -> bool:
        return bool(self.req.Test())


def _array(t: torch.Tensor):
    return t.numpy()


def _free(comm) -> None:
    """Free a communicator (None: nothing); at shutdown MPI may already be finalized."""
    if comm is not None:
        try:
            comm.Free()
        except Exception:
            pass


# A round's last word: all ones while the rank does not ask for the fallback (BAND keeps it
# all ones only if every rank does not).
_NO_FALLBACK = b"\xff" * 8
_FALLBACK = b"\0" * 8


class Agreement:
    """The steady state's rounds (steady.py) as one small MPI allreduce each.

    Why: a round only combines every rank's (ready bits, fallback flag). Over the control
    connections that costs a message each way between Python threads (~100 us on 2 cores, and
    the ranks leave the round up to a one-way latency apart), while MPI does it through shared
    memory in a few us and lets every rank leave at almost the same moment. The rounds run on a
    duplicate of the set's communicator, so they never interleave with its data collectives:
    MPI matches each communicator's collectives in call order, and every rank starts rounds in
    round order and collectives in release order.

    A round is (AND of bits, OR of flags): one BAND over `width` bits packed into 64-bit words,
    plus a word that is all ones while the rank does not ask for the fallback.
    """

    def __init__(self, comm):
        self.comm = comm.Dup()
        # One round at a time per set: the buffer is reused, and written and read through a
        # byte view (numpy's frombuffer and slice assignment cost ~4 us a round).
        self._buf = np.zeros(0, dtype=np.uint64)
        self._bytes = memoryview(self._buf).cast("B")

    def start(self, bits: int, fallback: bool, width: int) -> "AgreementRequest":
        nbytes = (max(width, 1) + 63) // 64 * 8
        if self._buf.nbytes != nbytes + 8:
            self._buf = np.empty(nbytes // 8 + 1, dtype=np.uint64)
            self._bytes = memoryview(self._buf).cast("B")
        view = self._bytes
        view[:nbytes] = bits.to_bytes(nbytes, "little")
        view[nbytes:] = _FALLBACK if fallback else _NO_FALLBACK
        return AgreementRequest(self.comm.Iallreduce(MPI.IN_PLACE, self._buf, MPI.BAND), view)

    def close(self) -> None:
        _free(self.comm)
        self.comm = None


class AgreementRequest:
    """One round in flight: `test()` polls (one thread at a time), `value()` decodes it."""

    __slots__ = ("req", "view")

    def __init__(self, req, view: memoryview):
        self.req, self.view = req, view

    def test(self) -> bool:
        return bool(self.req.Test())

    def value(self) -> tuple[int, bool]:
        view = self.view
        return int.from_bytes(view[:-8], "little"), view[-8:] != _NO_FALLBACK


# A fused allreduce's members of at least this many bytes are reduced in place, one MPI call
# each (collectives.Executor._allreduce_in_place), instead of through the fusion buffer: MPI's
# per-call cost on one host (~15 us with the Python around it) is below what copying 64 KiB
# into the buffer and back costs (~17 us with both ranks copying at once).
INPLACE_MIN_BYTES = 64 << 10


class MPICommunicator(shm.ShmRouted):
    """Non-blocking MPI collectives; when ranks outnumber cores, hvdlite's shared-memory channel
    carries what it can (shm.ShmRouted) and MPI the rest."""

    device = "cpu"
    inplace_min_bytes = INPLACE_MIN_BYTES

    def __init__(self, comm, in_order: bool = False, rounds: bool = True, store=None,
                 timeout_s: float = 60.0):
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "the MPI transport needs MPI_THREAD_MULTIPLE, but this MPI provides thread "
                f"level {MPI.Query_thread()}; unset HOROVOD_MPI_THREADS_DISABLE or use gloo "
                "(HOROVOD_CPU_OPERATIONS=gloo).")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.yielding = wait_mode() == "yield"
        # The engine may poll a small collective for this long before handing it to its
        # finisher thread (Engine._poll_inline): MPI's shared-memory latency is a few us, far
        # below a thread hand-off. Not when ranks outnumber cores: polling would take the core.
        self.inline_poll_s = 0.0 if self.yielding else INLINE_POLL_S
        # `rounds`: the steady state's rounds run on a duplicate of `comm` (Agreement).
        # `in_order`: another duplicate, on which only the engine's finisher thread launches
        # collectives, one after another in the order the ranks released them; so a collective
        # made of several calls (collectives.Executor._allreduce_in_place) never interleaves
        # with the calls the background thread launches on `comm` meanwhile: MPI matches each
        # communicator's collectives in call order, which two threads would not keep. One
        # communicator of a job has it (the global set's for CPU tensors: select.py): the
        # finisher serves every communicator from one queue, in each rank's own release order,
        # so calls that two communicators left to it could wait on each other across ranks (A's
        # first on one rank, B's first on another). Not where waits yield the core: each call
        # would then cost a sleep between polls (4 ranks on 2 cores ran the training step 4-5 %
        # slower so), and one fused call pays it once. The ranks agree on it (wait modes are
        # chosen per host), since every rank must make the same calls.
        self.agreement = Agreement(comm) if rounds else None
        self.in_order = None
        if in_order and comm.allreduce(not self.yielding, op=MPI.LAND):
            self.in_order = MPICommunicator(comm.Dup(), rounds=False)
        # When ranks outnumber cores (any rank yields), MPICH still busy-polls inside its own
        # progress engine, and every rank's spin takes the core from the rank it waits for.
        # hvdlite's shared-memory channel sleeps in select() on a FIFO instead, so the data of
        # allreduce, reducescatter, allgather and broadcast goes through it (4 ranks on 2 cores:
        # the MLP step went from 0.83 to 0.70 x DDP's). The steady state's rounds then go over
        # the control connections, whose waits also sleep (CNN 0.92 -> 0.88 x DDP's against
        # rounds on MPI). `store` (the set's own prefix of the job's store) carries the set-up;
        # the ranks agree over MPI. Spinning ranks keep MPI: there it beats the channel.
        if store is not None and rounds and self.size > 1 and \
                comm.allreduce(self.yielding, op=MPI.LOR):
            self.shm = shm.connect(store, self.rank, self.size, timeout_s, self._all_agree)
            if self.shm is not None and self.agreement is not None:
                self.agreement.close()
                self.agreement = None

    def _all_agree(self, ok: bool) -> bool:
        """True on every rank when `ok` is True on every rank (one MPI allreduce)."""
        return bool(self.comm.allreduce(bool(ok), op=MPI.LAND))

    @classmethod
    def for_ranks(cls, world, ranks: list[int], in_order: bool = False, store=None,
                  timeout_s: float = 60.0) -> "MPICommunicator":
        """A communicator over `ranks` of the job's world; collective over those ranks only."""
        if len(ranks) == world.Get_size():
            return cls(world.Dup(), in_order, store=store, timeout_s=timeout_s)
        group = world.Get_group().Incl(list(ranks))
        return cls(world.Create_group(group), in_order, store=store, timeout_s=timeout_s)

    def _allreduce(self, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(tensor.dtype)
        work = tensor.to(wide) if wide is not None else tensor
        req = self.comm.Iallreduce(MPI.IN_PLACE, _array(work), _ops()[op])
        return _Request(req, work if wide is not None else None, tensor, self.yielding)

    def _reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(output.dtype)
        out = output.to(wide) if wide is not None else output
        src = tensor.to(wide) if wide is not None else tensor
        req = self.comm.Ireduce_scatter_block(_array(src), _array(out), _ops()[op])
        return _Request(req, out if wide is not None else None, output, self.yielding)

    def _allgather(self, output: torch.Tensor, tensor: torch.Tensor):
        return _Request(self.comm.Iallgather(_array(tensor), _array(output)),
                        yielding=self.yielding)

    def _broadcast(self, tensor: torch.Tensor, root: int):
        return _Request(self.comm.Ibcast(_array(tensor), root=root),
                        yielding=self.yielding)

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]):
        in_displs = [sum(in_splits[:i]) for i in range(len(in_splits))]
        out_displs = [sum(out_splits[:i]) for i in range(len(out_splits))]
        req = self.comm.Ialltoallv([_array(tensor), list(in_splits), in_displs, MPI.BYTE],
                                   [_array(output), list(out_splits), out_displs, MPI.BYTE])
        return _Request(req, yielding=self.yielding)

    def close(self) -> None:
        self.close_shm()
        if self.agreement is not None:
            self.agreement.close()
        if self.in_order is not None:
            self.in_order.close()
        _free(self.comm)
        self.comm = None


# ---------------------------------------------------------------------- job set-up over MPI
_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def launched_by_mpi() -> bool:
    """True when mpirun/mpiexec started this process (MPICH hydra, Open MPI, PMIx, MVAPICH)."""
    return any(v in os.environ for v in _LAUNCH_VARS)


def started_by_mpi() -> bool:
    """Launched by mpirun and able to talk MPI: ranks then meet over MPI."""
    return launched_by_mpi() and available()


def threads_supported() -> bool:
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def world(comm=None):
    """The communicator the job runs on: COMM_WORLD, an mpi4py communicator passed to
    init(comm=...), or a list of COMM_WORLD ranks (Horovod's init(comm=[...]))."""
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, (list, tuple)):
        ranks = sorted(int(r) for r in comm)
        w = MPI.COMM_WORLD
        sub = w.Create_group(w.Get_group().Incl(ranks))
        if sub == MPI.COMM_NULL:
            raise ValueError(f"init(comm={ranks}): rank {w.Get_rank()} of COMM_WORLD is not in "
                             f"the list; only listed ranks may call init().")
        return sub
    if hasattr(comm, "Get_rank") and hasattr(comm, "Get_size"):
        return comm
    raise ValueError("init(comm=...) takes an mpi4py communicator or a list of ranks")


def identity(comm):
    from ..rendezvous import Identity
    hostname = (config.raw("HVDLITE_HOSTNAME") or config.raw("HOROVOD_HOSTNAME")
                or socket.gethostname())
    return Identity(comm.Get_rank(), comm.Get_size(), None, None, False, "MPI", hostname)


def job_key(comm) -> bytes:
    """Rank 0 draws the job's control-channel key and hands it to every rank over MPI."""
    return comm.bcast(os.urandom(32) if comm.Get_rank() == 0 else None, root=0)


def share_store(comm, timeout_s: float):
    """A c10d store for gloo/NCCL communicators in an MPI-launched job: rank 0 serves it,
    every rank learns where over MPI."""
    import datetime

    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    if comm.Get_size() == 1:
        return dist.HashStore()
    if comm.Get_rank() == 0:
        store = dist.TCPStore("0.0.0.0", 0, None, True, timeout=timeout, wait_for_workers=False)
        share_address(comm, store.port)
        return store
    host, port = share_address(comm, None)
    return dist.TCPStore(host, port, None, False, timeout=timeout)


def share_address(comm, port: int | None) -> tuple[str, int]:
    """Rank 0's coordinator address, given to every rank over MPI."""
    hosts = comm.allgather(socket.gethostname())
    if comm.Get_rank() == 0:
        explicit = config.raw("HVDLITE_COORDINATOR_ADDR")
        if explicit:
            host = explicit
        elif len(set(hosts)) == 1:
            host = "127.0.0.1"
        else:
            host = socket.gethostbyname(socket.gethostname())
        address = (host, port)
    else:
        address = None
    return comm.bcast(address, root=0)
