"""Lifecycle and topology shared by every frontend: init, shutdown, rank, size, process sets.

Frontends re-export these names and submit collectives through `submit`.
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from typing import Optional

from . import hierarchical, logs, rendezvous
from .backends import mpi as mpi_backend
from .backends import nccl as nccl_backend
from .backends.gloo import GlooCommunicator
from .backends.local import SelfCommunicator
from . import config
from .config import Settings, env
from .controller import Coordinator
from .engine import Engine, Entry, Handle
from .exceptions import HorovodInternalError
from .messages import ADD_PROCESS_SET, REMOVE_PROCESS_SET, Request
from .process_sets import ProcessSet, global_process_set
from .timeline import Timeline
from .wire import Channel

log = logging.getLogger(__name__)

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class _State:
    def __init__(self):
        self.engine: Engine | None = None
        self.coordinator: Coordinator | None = None
        self.timeline: Timeline | None = None
        self.rank = 0
        self.size = 1
        self.topology: dict = {}
        self.settings: Settings | None = None
        self.sets: dict[int, ProcessSet] = {}
        self.dynamic = False
        self.add_counter = 0
        self.transport = "gloo"


_state: _State | None = None
_lock = threading.RLock()
_generation = 0
_atexit_registered = False


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    last = None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((host, port), timeout=max(1.0, deadline -
                                                                       time.monotonic()))
        except OSError as exc:
            last = exc
            time.sleep(0.05)
    raise HorovodInternalError(f"could not connect to the coordinator at {host}:{port}: {last}")


def init(comm=None, process_sets=None) -> None:
    """Start hvdlite in this process: join the job, start the background thread.

    `process_sets` is a list of ProcessSet to register on every rank, or "dynamic" to allow
    add_process_set/remove_process_set later. Calling init() twice is harmless.
    """
    global _state, _generation, _atexit_registered
    with _lock:
        if _state is not None:
            return
        settings = Settings.from_env()
        logs.setup()  # HOROVOD_LOG_LEVEL / _HIDE_TIME, HVDLITE_LOG_FORMAT; propagates
        if not config.raw("HVDLITE_ENV_CHECKED"):  # hvdlite-run checked the names already
            config.warn_misspelled(log.warning)
        dynamic = settings.dynamic_process_sets
        static: list[ProcessSet] = []
        if process_sets == "dynamic":
            dynamic = True
        elif process_sets:
            static = list(process_sets)
            for ps in static:
                if not isinstance(ps, ProcessSet) or ps.ranks is None:
                    raise ValueError("init(process_sets=...) takes a list of ProcessSet built "
                                     "from rank lists, or 'dynamic'")
        transport = _choose_transport(comm)
        # Under mpirun (or with init(comm=...)) ranks meet over MPI, whatever the transport.
        world = mpi_backend.world(comm) if (transport == "mpi" or mpi_backend.started_by_mpi()) \
            else None
        ident = mpi_backend.identity(world) if world is not None else rendezvous.identify()
        logs.set_rank(ident.rank)
        if ident.size > 1 or ident.store_host is not None:
            for ps in static:
                bad = [r for r in ps.ranks if not 0 <= r < ident.size]
                if bad:
                    raise ValueError(f"ProcessSet {ps.ranks} names ranks {bad} outside "
                                     f"0..{ident.size - 1}")
        _generation += 1
        prefix = rendezvous.store_prefix(ident, _generation)
        if ident.round is not None:
            # Elastic round: a worker that joins now must name unnamed collectives as the
            # survivors do, so call-site counters restart with the round on every rank.
            with _site_lock:
                _site_counters.clear()
        if world is None:
            store = rendezvous.connect_store(ident, settings.start_timeout_s)
        else:
            store = mpi_backend.share_store(world, settings.start_timeout_s)
        key = _job_key(ident, store, prefix) if world is None else mpi_backend.job_key(world)
        state = _State()
        state.settings = settings
        state.rank, state.size = ident.rank, ident.size
        state.dynamic = dynamic
        timeline = None
        if ident.rank == 0:
            path = settings.timeline
            timeline = Timeline(None if path in (None, "DYNAMIC") else path,
                                settings.timeline_mark_cycles)
            state.coordinator = Coordinator(ident.size, key, settings, timeline)
            state.coordinator.start()
        state.timeline = timeline
        deadline = time.monotonic() + settings.start_timeout_s
        port = state.coordinator.port if state.coordinator is not None else None
        if world is not None:
            host, port = mpi_backend.share_address(world, port)
        else:
            host, port = _share_address(ident, store, prefix, port, settings)
        sock = _connect(host, int(port), deadline)
        channel = Channel(sock, key)
        channel.send(("H", {"rank": ident.rank, "size": ident.size, "hostname": ident.hostname,
                            "pid": os.getpid(), "dynamic": dynamic,
                            "process_sets": [ps.ranks for ps in static]}))
        try:
            reply = channel.recv_blocking(max(1.0, deadline - time.monotonic()) + 5.0)
        except (OSError, ConnectionError) as exc:
            channel.close()
            if state.coordinator is not None:
                state.coordinator.stop()
            raise HorovodInternalError(f"rank {ident.rank} could not join the job: {exc}") from exc
        if reply[0] == "F":
            channel.close()
            if state.coordinator is not None:
                state.coordinator.stop()
            raise HorovodInternalError(reply[1])
        topo = reply[1]
        state.topology = topo
        set_ranks = {0: list(range(ident.size))}
        for ps, sid in zip(static, topo["process_set_ids"]):
            ps.process_set_id = sid
            set_ranks[sid] = list(ps.ranks)
            state.sets[sid] = ps
        global_process_set.ranks = list(range(ident.size))
        state.sets[0] = global_process_set

        def comm_factory(set_id: int, ranks: list, kind: str = "cpu"):
            if len(ranks) == 1:
                return SelfCommunicator()
            if kind == "cuda" and nccl_backend.available():
                return nccl_backend.NCCLCommunicator(store, f"{prefix}nccl/{set_id}/",
                                                     ranks.index(ident.rank), len(ranks),
                                                     settings.gloo_timeout_s)
            if transport == "mpi":
                return mpi_backend.MPICommunicator.for_ranks(world, ranks)
            return GlooCommunicator(store, f"{prefix}pg/{set_id}/", ranks.index(ident.rank),
                                    len(ranks), settings.gloo_timeout_s)

        if settings.hierarchical_allreduce:  # the one hook: the global set's CPU communicator
            comm_factory = hierarchical.wrap_factory(comm_factory, ident.rank, topo["hosts"],
                                                     ident.size)
        state.engine = Engine(rank=ident.rank, size=ident.size, settings=settings,
                              channel=channel, comm_factory=comm_factory, set_ranks=set_ranks,
                              timeline=timeline)
        state.transport = transport
        _state = state
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def _choose_transport(comm) -> str:
    """gloo or mpi, as Horovod's HOROVOD_CPU_OPERATIONS says; under mpirun, MPI by default."""
    choice = (env("CPU_OPERATIONS") or "").strip().lower()
    if choice not in ("", "gloo", "mpi"):
        raise ValueError(f"HOROVOD_CPU_OPERATIONS={choice!r}: hvdlite supports 'gloo' and 'mpi'")
    if comm is not None and choice == "gloo":
        raise ValueError("init(comm=...) takes an MPI communicator, but HOROVOD_CPU_OPERATIONS "
                         "is 'gloo'; unset it or set it to 'mpi'.")
    if comm is not None or choice == "mpi":
        if not mpi_backend.available():
            raise ValueError("the MPI transport needs mpi4py and an MPI library: "
                             "pip install mpi4py mpich (or use HOROVOD_CPU_OPERATIONS=gloo)")
        return "mpi"
    if not choice and mpi_backend.launched_by_mpi() and mpi_backend.available():
        return "mpi"
    return "gloo"


def _share_address(ident, store, prefix: str, port, settings) -> tuple[str, int]:
    """Rank 0 publishes its coordinator's address in the store; every rank reads it."""
    if port is not None:
        store.set(prefix + "coordinator", f"{rendezvous.advertised_host(ident)}:{port}")
    try:
        host, port = store.get(prefix + "coordinator").decode().rsplit(":", 1)
    except Exception as exc:
        raise HorovodInternalError(
            f"rank {ident.rank} did not hear from rank 0 within "
            f"{settings.start_timeout_s:.0f} s (HVDLITE_START_TIMEOUT): {exc}. Is rank 0 "
            f"running?") from exc
    return host, int(port)


def _job_key(ident, store, prefix: str) -> bytes:
    """The per-job secret that signs every control message."""
    secret = config.raw("HVDLITE_SECRET")
    if secret:
        return bytes.fromhex(secret) if all(c in "0123456789abcdefABCDEF" for c in secret) \
            else secret.encode()
    if ident.size == 1:
        return os.urandom(32)
    if ident.rank == 0:
        key = os.urandom(32)
        store.set(prefix + "key", key.hex())
        return key
    return bytes.fromhex(store.get(prefix + "key").decode())


def shutdown() -> None:
    """Stop the background thread; pending collectives fail. init() may be called again."""
    global _state
    with _lock:
        state = _state
        if state is None:
            return
        _state = None
        if state.engine is not None:
            state.engine.shutdown()
        if state.coordinator is not None:
            # Keep serving ranks that are still finishing (e.g. collectives in a process set
            # without rank 0) until they shut down too, for a bounded time.
            state.coordinator.finish(state.settings.shutdown_grace_s)
        if state.timeline is not None:
            state.timeline.close()
        for sid, ps in state.sets.items():
            if sid != 0:
                ps._invalidate()


def _require() -> _State:
    state = _state
    if state is None:
        raise ValueError(NOT_INITIALIZED)
    return state


def is_initialized() -> bool:
    return _state is not None


def rank() -> int:
    return _require().rank


def size() -> int:
    return _require().size


def local_rank() -> int:
    return _require().topology["local_rank"]


def local_size() -> int:
    return _require().topology["local_size"]


def cross_rank() -> int:
    return _require().topology["cross_rank"]


def cross_size() -> int:
    return _require().topology["cross_size"]


def is_homogeneous() -> bool:
    return _require().topology["homogeneous"]


def _set_ranks(set_id: int) -> list:
    state = _require()
    ranks = state.engine.set_ranks.get(set_id)
    if ranks is None:
        raise ValueError(f"process set {set_id} is not registered")
    return ranks


def engine() -> Engine:
    return _require().engine


def submit(entries: list[Entry]) -> Handle:
    """Hand tensors to the engine; the single entry point for every frontend collective."""
    return _require().engine.enqueue(entries)


def wait(handle: Handle) -> list:
    state = _state
    alive = state.engine.alive if state is not None else None
    return handle.wait(alive)


# ---------------------------------------------------------------------- process sets
def _resolve_set(process_set) -> int:
    if process_set is None:
        return 0
    sid = process_set.process_set_id
    if sid is None:
        raise ValueError(f"{process_set} is not registered: pass it to init(process_sets=...) or "
                         f"add_process_set() first")
    return sid


def add_process_set(process_set) -> ProcessSet:
    """Register a new process set on every rank (a collective: every rank must call it, in the
    same order, with the same ranks)."""
    state = _require()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise ValueError("add_process_set needs a ProcessSet built from a list of ranks")
    if not state.dynamic:
        raise ValueError("add_process_set() needs dynamic process sets: call "
                         "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1.")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    state.add_counter += 1
    req = Request(rank=state.rank, name=f"process_set.add.{state.add_counter}",
                  type=ADD_PROCESS_SET, extra=tuple(ps.ranks), cacheable=False)
    try:
        (sid,) = wait(submit([Entry(req)]))
    except HorovodInternalError as exc:
        raise ValueError(str(exc)) from None
    ps.process_set_id = sid
    state.sets[sid] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (a collective). Returns True when removed."""
    state = _require()
    sid = process_set.process_set_id
    if sid is None:
        return False
    if sid == 0:
        raise ValueError("the global process set cannot be removed")
    state.add_counter += 1
    req = Request(rank=state.rank, name=f"process_set.remove.{state.add_counter}",
                  type=REMOVE_PROCESS_SET, extra=sid, cacheable=False)
    try:
        wait(submit([Entry(req)]))
    except HorovodInternalError as exc:
        raise ValueError(str(exc)) from None
    process_set._invalidate()
    state.sets.pop(sid, None)
    return True


# ---------------------------------------------------------------------- timeline
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline now (rank 0 writes it; other ranks' calls are accepted)."""
    state = _require()
    if state.timeline is not None:
        state.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    state = _require()
    if state.timeline is not None:
        state.timeline.stop()


# ---------------------------------------------------------------------- naming
_site_counters: dict[tuple, int] = {}
_site_lock = threading.Lock()
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def auto_name(op: str, set_id: int = 0) -> str:
    """A name for an unnamed collective that is identical on every rank: the calling line in the
    user's code plus how many times that line has run for this process set. (Horovod used a
    global handle counter, which breaks as soon as ranks interleave calls differently.)"""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PKG_DIR):
        frame = frame.f_back
    if frame is None:
        site = ("?", 0)
    else:
        site = (os.path.basename(frame.f_code.co_filename), frame.f_lineno)
    key = (op, set_id) + site
    with _site_lock:
        n = _site_counters.get(key, 0)
        _site_counters[key] = n + 1
    return f"{op}.noname.{site[0]}:{site[1]}.{n}"


# ---------------------------------------------------------------------- build info
def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (hvdlite's MPI transport requires it)."""
    return mpi_backend.available() and mpi_backend.threads_supported()


def mpi_enabled() -> bool:
    """True when this job's collectives run on MPI."""
    state = _state
    return state is not None and state.transport == "mpi"


def mpi_built() -> bool:
    """True when mpi4py and an MPI library are importable."""
    return mpi_backend.available()


def gloo_enabled() -> bool:
    state = _state
    return state is None or state.transport == "gloo"


def gloo_built() -> bool:
    return True


def nccl_built() -> bool:
    """True when torch has NCCL and a GPU is visible: CUDA tensors then reduce over NCCL."""
    return nccl_backend.available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    import torch
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return False
