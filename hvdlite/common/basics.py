"""Lifecycle and topology shared by every frontend: init, shutdown, rank, size, process sets.

Frontends re-export these names; collectives go through `ops` (the op layer), transports are
chosen in `backends.select`.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from types import TracebackType
from typing import Any, Iterable, Optional

from . import buckets, config, flight_recorder, hierarchical, logs, naming, rendezvous, threads
from .backends import mpi as mpi_backend
from .backends import nccl as nccl_backend
from .backends import select, shm
from .config import Settings
from .controller import Coordinator
from .engine import Engine
from .environment import Detected, DetectionError, detect
from .exceptions import HorovodInternalError
from . import process_sets
from .process_sets import ProcessSet, global_process_set
from .protocol import Msg
from .rendezvous import PEER_NONCE, client_handshake
from .timeline import Timeline
from .wire import ProtocolError

log = logging.getLogger(__name__)

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class _State:
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.coordinator: Coordinator | None = None
        self.timeline: Timeline | None = None
        self.rank = 0
        self.size = 1
        self.topology: dict[str, Any] = {}
        self.settings: Settings | None = None
        self.sets: dict[int, ProcessSet] = {}
        self.dynamic = False
        self.add_counter = 0
        self.transport = "gloo"
        # (set, name) -> the last request of a named allreduce under that name, reused while
        # the call's signature is unchanged (ops._allreduce_request).
        self.requests: dict[Any, Any] = {}


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


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start hvdlite in this process: join the job, start the background thread.

    `process_sets` is a list of ProcessSet to register on every rank, or "dynamic" to allow
    add_process_set/remove_process_set later. Calling init() twice is harmless.

    An elastic worker whose round is aborted while it is still in init() (a member died there)
    asks the driver for the next round at once instead of waiting out HVDLITE_START_TIMEOUT.
    """
    global _state, _atexit_registered
    with _lock:
        if _state is not None:
            return
        checked = config.raw("HVDLITE_ENV_CHECKED")   # hvdlite-run checked them already
        bad = [] if checked else config.check_values()
        if bad:
            raise ValueError("hvdlite.init(): " + "; ".join(bad))
        settings = Settings.from_env()
        logs.setup()  # HOROVOD_LOG_LEVEL / _HIDE_TIME, HVDLITE_LOG_FORMAT; propagates
        if not checked:
            config.warn_misspelled(log.warning)
        dynamic = settings.dynamic_process_sets
        static: list[ProcessSet] = []
        if isinstance(comm, (list, tuple)) and not comm:
            comm = None                 # Horovod's default: an empty list, all of the world
        if isinstance(process_sets, str) and process_sets.lower() == "dynamic":
            # (Horovod's init also exports HOROVOD_DYNAMIC_PROCESS_SETS=1 for its C++ core,
            # which then makes every later init() in the process dynamic; hvdlite does not.)
            dynamic = True
        elif process_sets:
            static = list(process_sets)
            for ps in static:
                if not isinstance(ps, ProcessSet) or ps.ranks is None:
                    raise ValueError("init(process_sets=...) takes a list of ProcessSet built "
                                     "from rank lists, or 'dynamic'")
            _check_distinct_sets(static)
        transport = select.choose_transport(comm)
        while True:
            try:
                state = _init_once(comm, settings, dynamic, static, transport)
                break
            except rendezvous.RoundAborted as exc:
                log.warning("elastic: %s; asking the driver for the next round", exc)
        _state = state
        threads.fit_torch_threads(state.topology.get("local_size", 1))
        flight_recorder.install(state.rank, state.topology.get("hosts", {}).get(state.rank, ""),
                                settings, state.size)
        flight_recorder.RECORDER.coordinator_view = (
            state.coordinator.view if state.coordinator is not None else None)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        _watch_uncaught()


def _init_once(comm: Any, settings: Settings, dynamic: bool, static: list[ProcessSet],
               transport: str) -> "_State":
    global _generation
    found = _detect(comm)
    world = select.mpi_world(transport, comm)
    ident = mpi_backend.identity(world) if world is not None else rendezvous.identify(found)
    logs.set_rank(ident.rank)
    _check_mpi_world(found, ident, comm)
    log.debug("hvdlite.init: rank %s of %s from %s (%s)", ident.rank, ident.size, found.source,
              " ".join(found.variables) or "no variables")
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
        naming.reset()
    state = _State()
    try:
        _join(state, ident, world, settings, dynamic, static, transport, prefix, found)
    except Exception as exc:
        if state.coordinator is not None:
            state.coordinator.stop()
        aborted = rendezvous.round_aborted(ident, wait_s=2.0) if ident.round is not None \
            else None
        if aborted and not isinstance(exc, rendezvous.WorkerRemoved):
            raise rendezvous.RoundAborted(aborted) from exc
        raise
    return state


def _join(state: "_State", ident: Any, world: Any, settings: Settings, dynamic: bool,
          static: list[ProcessSet], transport: str, prefix: str, found: Detected) -> None:
    if world is None:
        store = rendezvous.connect_store(ident, settings.start_timeout_s)
    else:
        store = mpi_backend.share_store(world, settings.start_timeout_s)
    key = _job_key(ident, store, prefix) if world is None else mpi_backend.job_key(world)
    state.settings = settings
    state.rank, state.size = ident.rank, ident.size
    state.dynamic = dynamic
    timeline = None
    if ident.rank == 0:
        path = settings.timeline
        timeline = Timeline(None if path in (None, "DYNAMIC") else path,
                            settings.timeline_mark_cycles)
        state.coordinator = Coordinator(ident.size, key, settings, timeline)
        if ident.round is not None:
            state.coordinator.abort_check = lambda: rendezvous.round_aborted(ident)
        state.coordinator.start()
    state.timeline = timeline
    deadline = time.monotonic() + settings.start_timeout_s
    port = state.coordinator.port if state.coordinator is not None else None
    if world is not None:
        host, port = mpi_backend.share_address(world, port)
    else:
        host, port = _share_address(ident, store, prefix, port, settings)
    sock = _connect(host, int(port), deadline)
    # Steady-state rounds travel on direct connections between ranks (steady.py).
    peer_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    peer_listener.bind(("0.0.0.0", 0))
    peer_listener.listen(128)
    peer_nonce = os.urandom(PEER_NONCE)     # this process's half of every peer channel's key
    hello = (Msg.HELLO, {"rank": ident.rank, "size": ident.size, "hostname": ident.hostname,
                         "pid": os.getpid(), "dynamic": dynamic,
                         "peer_port": peer_listener.getsockname()[1],
                         "peer_nonce": peer_nonce.hex(),
                         "process_sets": [ps.ranks for ps in static]})
    wait_s = max(1.0, deadline - time.monotonic()) + 5.0
    try:
        # The nonce handshake of the driver's endpoints: a per-connection key, so a frame
        # recorded on one connection is refused on any other.
        channel = client_handshake(sock, key, hello, wait_s)
    except (OSError, ConnectionError, ProtocolError) as exc:
        sock.close()
        peer_listener.close()
        raise HorovodInternalError(f"rank {ident.rank} could not join the job: the "
                                   f"coordinator at {host}:{port} refused or dropped the "
                                   f"connection ({exc}); do all ranks share the job "
                                   f"secret (HVDLITE_SECRET)?") from exc
    try:
        reply = channel.recv_blocking(wait_s)
    except (OSError, ConnectionError) as exc:
        channel.close()
        peer_listener.close()
        raise HorovodInternalError(f"rank {ident.rank} could not join the job: {exc}") from exc
    if reply[0] == Msg.FATAL:
        channel.close()
        peer_listener.close()
        raise HorovodInternalError(reply[1])
    topo = reply[1]
    _check_topology(found, ident, topo)
    state.topology = topo
    set_ranks = {0: list(range(ident.size))}
    for ps, sid in zip(static, topo["process_set_ids"]):
        ps.process_set_id = sid
        set_ranks[sid] = list(ps.ranks)
        state.sets[sid] = ps
    global_process_set.ranks = list(range(ident.size))
    state.sets[0] = global_process_set

    factory = select.comm_factory(transport, store=store, prefix=prefix, world=world,
                                  rank=ident.rank, timeout_s=_transport_timeout(settings))
    if settings.hierarchical_allreduce:  # the one hook: the global set's CPU communicator
        factory = hierarchical.wrap_factory(factory, ident.rank, topo["hosts"], ident.size)
    local_size = topo.get("local_size", 1)
    shared_memory = 1 < ident.size == local_size and \
        (transport == "mpi" or (transport == "gloo" and shm.mode() == "on"))
    settings = _settings_for_host(settings, local_size, shared_memory)
    state.engine = Engine(rank=ident.rank, size=ident.size, settings=settings,
                          channel=channel, comm_factory=factory, set_ranks=set_ranks,
                          timeline=timeline, peer_listener=peer_listener, key=key,
                          peers=topo.get("peers"), peer_nonce=peer_nonce)
    state.transport = transport


def _detect(comm) -> Detected:
    """The environment table's reading of this process (environment.py); its errors become
    the ValueError init() raises, naming the variables."""
    if comm is not None:
        return Detected("MPI communicator passed to init()", None, None,
                                    over_mpi=True, launcher=True)
    try:
        return detect()
    except DetectionError as exc:
        raise ValueError(f"hvdlite.init(): {exc}") from None


def _check_mpi_world(found: Detected, ident, comm) -> None:
    """A job meeting over MPI whose world is not the size the environment says: MPI_Init ran
    as a singleton (an MPI library that cannot reach this launcher's PMI), and each rank would
    train alone."""
    if comm is not None or ident.source != "MPI" or found.size is None or \
            found.size == ident.size:
        return
    raise ValueError(
        f"hvdlite.init(): {found.source} says {found.size} ranks ({' '.join(found.variables)}) "
        f"but MPI's world has {ident.size}: this MPI library cannot reach the launcher that "
        f"started the job (for srun, match --mpi to the MPI build, or use "
        f"HOROVOD_CPU_OPERATIONS=gloo).")


def _check_topology(found: Detected, ident, topo: dict) -> None:
    """The local coordinates the environment gave against those the ranks' host names give:
    apart, two hosts share a name (containers with one hostname) and GPUs would be shared."""
    if found.local_rank is None or found.source == "single process":
        return
    mine = (found.local_rank, found.local_size if found.local_size is not None
            else topo.get("local_size"))
    theirs = (topo.get("local_rank"), topo.get("local_size"))
    if mine != theirs:
        raise HorovodInternalError(
            f"rank {ident.rank}: {found.source} says local rank {mine[0]} of {mine[1]} but the "
            f"ranks' host names ({ident.hostname!r}) make it local rank {theirs[0]} of "
            f"{theirs[1]}; give each host its own name (HVDLITE_HOSTNAME) or fix the launcher's "
            f"variables")


def _settings_for_host(settings: Settings, local_ranks: int, shared_memory: bool,
                       cores: int | None = None) -> Settings:
    """The engine's settings on this host: buckets follow how many ranks share its cores
    (buckets.whole_pass_on_host and cpu_cap_on_host say why); `shared_memory`: the job is on
    this host alone and its data moves through shared memory. A copy, so an elastic re-init
    decides afresh."""
    cores = threads.usable_cores() if cores is None else cores
    whole = buckets.whole_pass_on_host(settings.bucket_cap_bytes, settings.buckets_explicit,
                                       local_ranks, cores)
    cap = buckets.cpu_cap_on_host(settings.bucket_cap_bytes, settings.buckets_explicit,
                                  local_ranks, cores, shared_memory)
    cpu_cap = None if cap == settings.bucket_cap_bytes else cap
    if whole == settings.cpu_whole_pass and cpu_cap == settings.cpu_bucket_cap_bytes:
        return settings
    if whole:
        log.info("%d ranks share %d cores on this host: a step's CPU gradients go as one bucket "
                 "(set HVDLITE_BUCKET_CAP_MB / HVDLITE_FIRST_BUCKET_MB to choose)",
                 local_ranks, cores)
    elif cpu_cap is not None:
        log.info("%d ranks on %d cores, data through shared memory: CPU gradients go in buckets "
                 "of %.0f MB (set HVDLITE_BUCKET_CAP_MB to choose)", local_ranks, cores,
                 cpu_cap / (1 << 20))
    return dataclasses.replace(settings, cpu_whole_pass=whole, cpu_bucket_cap_bytes=cpu_cap)


def _transport_timeout(settings: Settings) -> float:
    """The transport's timeout, at most the stall shutdown time when that is shorter: a
    collective already released runs in the transport, where the stall inspector cannot see it,
    so a peer cut off mid-transfer (a partitioned host) is noticed after this long. Past the
    stall shutdown time the job calls a wait a hang anyway."""
    stall = settings.stall_shutdown_s
    if settings.stall_check_disable or stall <= 0:
        return settings.gloo_timeout_s
    return min(settings.gloo_timeout_s, stall)


def _share_address(ident: Any, store: Any, prefix: str, port: Optional[int],
                   settings: Settings) -> tuple[str, int]:
    """Rank 0 publishes its coordinator's address in the store; every rank reads it."""
    if port is not None:
        store.set(prefix + "coordinator", f"{rendezvous.advertised_host(ident)}:{port}")
    try:
        if ident.round is not None:
            # Poll, so that a round aborted by the driver ends this wait at once.
            deadline = time.monotonic() + settings.start_timeout_s
            while not store.check([prefix + "coordinator"]):
                why = rendezvous.round_aborted(ident)
                if why:
                    raise rendezvous.RoundAborted(why)
                if time.monotonic() > deadline:
                    raise TimeoutError("timed out")
                time.sleep(0.05)
        host, port = store.get(prefix + "coordinator").decode().rsplit(":", 1)
    except rendezvous.RoundAborted:
        raise
    except Exception as exc:
        raise HorovodInternalError(
            f"rank {ident.rank} did not hear from rank 0 within "
            f"{settings.start_timeout_s:.0f} s (HVDLITE_START_TIMEOUT): {exc}. Is rank 0 "
            f"running?") from exc
    return host, int(port)


def _job_key(ident: Any, store: Any, prefix: str) -> bytes:
    """The per-job secret that signs every control message."""
    secret = rendezvous.job_secret()
    if secret:
        return secret
    if ident.size == 1:
        return os.urandom(32)
    _warn_unauthenticated(ident)
    if ident.rank == 0:
        key = os.urandom(32)
        store.set(prefix + "key", key.hex())
        return key
    return bytes.fromhex(store.get(prefix + "key").decode())


_warned_unauthenticated = False


def _warn_unauthenticated(ident: Any) -> None:
    """Said once per process, on rank 0: without a secret the key travels in the c10d store,
    which anyone who reaches the store can read."""
    global _warned_unauthenticated
    if _warned_unauthenticated or ident.rank != 0:
        return
    _warned_unauthenticated = True
    log.warning("the control plane runs UNAUTHENTICATED: this job started from the %s without "
                "HVDLITE_SECRET or HVDLITE_SECRET_FILE, so rank 0 publishes the job key in the "
                "rendezvous store at %s:%s, where anyone who reaches it can read it. Set "
                "HVDLITE_SECRET (or HVDLITE_SECRET_FILE) to the same value on every rank, or "
                "start the job with hvdlite-run.", ident.source, ident.store_host,
                ident.store_port)


def _note_uncaught(kind: type[BaseException], value: BaseException,
                   tb: Optional[TracebackType]) -> None:
    """sys.excepthook while hvdlite runs: remember what ends the process, then print it as
    the hook before would (the atexit shutdown that follows tells the other ranks).

    Why: a rank that crashed left its peers "rank 1 already called hvd.shutdown() ... use
    hvd.join() for uneven inputs", which sent people looking for uneven data; now they read
    that rank 1 exited after an uncaught ValueError, and its message."""
    global _exit_reason
    text = str(value).strip().splitlines()
    _exit_reason = f"an uncaught {kind.__name__}" + (f": {text[0][:200]}" if text else "")
    (_previous_excepthook or sys.__excepthook__)(kind, value, tb)


_exit_reason: Optional[str] = None
_previous_excepthook = None


def _watch_uncaught() -> None:
    """Put _note_uncaught in front of the process's excepthook (once)."""
    global _previous_excepthook
    if sys.excepthook is not _note_uncaught:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _note_uncaught


def shutdown() -> None:
    """Stop the background thread; pending collectives fail. init() may be called again."""
    global _state
    with _lock:
        state = _state
        if state is None:
            return
        _state = None
        if state.engine is not None:
            state.engine.exit_reason = _exit_reason
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
    """Whether `init()` has run in this process and `shutdown()` has not."""
    return _state is not None


def rank() -> int:
    """This process's rank in the job, 0 to `size() - 1`."""
    return _require().rank


def size() -> int:
    """The number of ranks in the job."""
    return _require().size


def local_rank() -> int:
    """This process's rank among the ranks on its host (use it to pick the GPU)."""
    return _require().topology["local_rank"]


def local_size() -> int:
    """The number of ranks on this process's host."""
    return _require().topology["local_size"]


def cross_rank() -> int:
    """The index of this process's host among the hosts holding its local rank."""
    return _require().topology["cross_rank"]


def cross_size() -> int:
    """The number of hosts with a rank of this process's local rank."""
    return _require().topology["cross_size"]


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return _require().topology["homogeneous"]


def _set_ranks(set_id: int) -> list[int]:
    state = _require()
    ranks = state.engine.set_ranks.get(set_id)
    if ranks is None:
        raise ValueError(f"process set {set_id} is not registered")
    return ranks


def engine() -> Engine:
    return _require().engine


def engine_counters() -> dict[str, int]:
    """This rank's engine counters: messages to the coordinator, steady-state rounds and the
    tensors they released, fallbacks to full negotiation (tests and benchmarks read them),
    `shm_collectives`: collectives the gloo transport ran through shared memory,
    `in_place_members`: members of fused allreduces that MPI reduced in place,
    `in_place_sequences`: fused allreduces whose in-place members MPI ran as one chain, and
    `staged_allreduces`: GPU allreduces moved through page-locked host memory in one copy each
    way (a host transport serving CUDA tensors), `caller_reads`: control connections read
    by a waiting caller instead of the background thread (engine.Engine._read_peers), and
    `caller_finished`: express-lane collectives that their caller saw to the end itself,
    without the finisher thread (engine.Engine._express)."""
    engine = _require().engine
    counters = dict(engine.counters)
    counters["in_place_members"] = engine.executor.in_place_members
    counters["in_place_sequences"] = engine.executor.in_place_sequences
    counters["staged_allreduces"] = engine.executor.staged_allreduces
    counters["shm_collectives"] = sum(c.shm.ops for c in list(engine.comms.values())
                                      if c.shm is not None)
    return counters


# ---------------------------------------------------------------------- process sets
def _check_distinct_sets(sets: list[ProcessSet]) -> None:
    """Horovod refuses the same ranks twice in init(process_sets=...), on every rank (the
    list is the same everywhere, so every rank decides alike without communicating)."""
    seen: dict[tuple[int, ...], int] = {}
    for i, ps in enumerate(sets):
        key = tuple(ps.ranks)
        if key in seen:
            raise ValueError(f"init(process_sets=...): process sets {seen[key]} and {i} both hold "
                             f"ranks {list(key)}; pass each process set once")
        seen[key] = i


def find_process_set(ranks: Iterable[int]) -> Optional[ProcessSet]:
    """The registered process set with exactly these global ranks (any order), or None."""
    state = _require()
    want = sorted(int(r) for r in ranks)
    if want == list(range(state.size)):
        return global_process_set
    for sid in sorted(state.sets):
        ps = state.sets[sid]
        if ps.process_set_id is not None and ps.ranks is not None and sorted(ps.ranks) == want:
            return ps
    return None


def dynamic_process_sets() -> bool:
    """True when this job may add and remove process sets after init()."""
    return _require().dynamic


# ---------------------------------------------------------------------- timeline
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline now (rank 0 writes it; other ranks' calls are accepted)."""
    state = _require()
    if state.timeline is not None:
        state.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording the timeline that `start_timeline()` started (the file is complete)."""
    state = _require()
    if state.timeline is not None:
        state.timeline.stop()


def auto_name(op: str, set_id: int = 0) -> str:
    """Kept for compatibility: see `naming.auto_name`."""
    return naming.auto_name(op, set_id)


# ---------------------------------------------------------------------- build info
def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (hvdlite's MPI transport requires it).
    Raises ValueError, as Horovod does, where this job's collectives do not run on MPI."""
    if not mpi_enabled():
        raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and "
                         "enabled (hvdlite: hvd.init() under mpirun/mpiexec, or "
                         "HOROVOD_CPU_OPERATIONS=mpi).")
    return mpi_backend.threads_supported()


def mpi_enabled() -> bool:
    """True when this job's collectives run on MPI."""
    state = _state
    return state is not None and state.transport == "mpi"


def mpi_built() -> bool:
    """True when mpi4py and an MPI library are importable."""
    return mpi_backend.available()


def gloo_enabled() -> bool:
    """True when this job's collectives run on gloo (False before init(), as in Horovod)."""
    state = _state
    return state is not None and state.transport == "gloo"


def gloo_built() -> bool:
    """Always True: the gloo transport is torch's own build."""
    return True


def nccl_built() -> int:
    """NCCL's version code (major * 10000 + minor * 100 + patch, Horovod's NCCL_VERSION_CODE)
    when torch has NCCL and a GPU is visible, so that CUDA tensors reduce over NCCL; else 0.
    An int, as Horovod returns, so `if hvd.nccl_built():` reads the same."""
    if not nccl_backend.available():
        return 0
    try:
        import torch
        version = torch.cuda.nccl.version()
    except Exception:                  # a build whose NCCL cannot say: still built
        return 1
    if isinstance(version, int):       # torch before 1.13 returned the code itself
        return version
    major, minor, patch = (tuple(version) + (0, 0, 0))[:3]
    return major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    """Always False: hvdlite has no IBM DDL transport."""
    return False


def ccl_built() -> bool:
    """Always False: hvdlite has no oneCCL transport."""
    return False


def cuda_built() -> bool:
    """Whether torch was built with CUDA (CUDA tensors are then supported)."""
    import torch
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Always False: hvdlite is not built for ROCm (Horovod's compile-time flag)."""
    return False


# ProcessSet.size/rank/included read the job's membership through these (process_sets.py sits
# below this module, which owns the job's state).
process_sets.bind(_set_ranks, rank)
