"""Where a rank learns who it is and where the job's c10d store lives.

Which environment started the process is read from one table (common/environment.py, whose
doc gives the precedence); the ways hvdlite-run itself starts ranks are:

- an elastic worker of `hvdlite-run` (HVDLITE_ELASTIC_WORKER set): its identity is not in the
  environment, because it changes whenever the job re-forms. At every `init()` the worker asks the
  driver, over an authenticated connection, for its place in the next *round*: rank, size, local
  and cross coordinates, and the round number that namespaces the round's keys in the store;
- hvdlite-run's variables (HVDLITE_*) for a fixed job. When rank 0 runs on the launcher's machine,
  the launcher only opens the store's listening socket and hands it to rank 0
  (HVDLITE_STORE_FD), whose `init()` serves the store on it; the launcher itself then never
  imports torch (hvdlite/runner/driver.py, `Rendezvous`);
- without hvdlite-run (Horovod's variables, torchrun, srun, Kubeflow, Ray), rank 0 serves the
  store at the address the environment names.

The driver link also carries the driver's host-update notifications to the elastic runtime
(hvdlite/common/elastic.py). Its handshake (`server_handshake` / `client_handshake`, used by the
driver too) derives a per-connection key from the job secret and two fresh nonces, so a frame
recorded on one connection is rejected on any other, and `wire.Channel`'s sequence numbers reject
one replayed on the same connection.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import signal
import socket
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import config, environment
from .exceptions import HorovodInternalError
from .wire import Channel, ProtocolError

log = logging.getLogger(__name__)

# Set by hvdlite-run for elastic workers.
ELASTIC_WORKER_ENV = "HVDLITE_ELASTIC_WORKER"    # "<host>:<slot>", stable for the process
ELASTIC_SPAWN_ENV = "HVDLITE_ELASTIC_SPAWN"      # random id of this spawn of that slot
DRIVER_ADDR_ENV = "HVDLITE_DRIVER_ADDR"          # the driver's control endpoint
DRIVER_PORT_ENV = "HVDLITE_DRIVER_PORT"
# Set by hvdlite-run on rank 0 of a fixed job whose rank 0 is local: the descriptor of the
# listening socket rank 0 serves the job's store on.
STORE_FD_ENV = "HVDLITE_STORE_FD"


@dataclass
class Identity:
    rank: int
    size: int
    store_host: str | None      # None: one-rank job, no store needed
    store_port: int | None
    store_is_master: bool       # this process hosts the store (rank 0 without a launcher)
    source: str                 # which environment it came from, for messages
    hostname: str
    round: int | None = None    # elastic: the driver's round; namespaces the round's store keys
    worker_id: str | None = None  # elastic: "<host>:<slot>"
    store_fd: int | None = None  # rank 0 serves the store on this listening socket (hvdlite-run)


def _int(name: str) -> int | None:
    value = config.raw(name) if config.declared(name) else os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def identify(found: Optional[environment.Detected] = None) -> Identity:
    """This process's place in the job, from the environment table (common/environment.py)
    or, for an elastic worker, from the driver."""
    found = environment.detect() if found is None else found
    hostname = (config.raw("HVDLITE_HOSTNAME") or config.raw("HOROVOD_HOSTNAME")
                or found.node or socket.gethostname())
    if found.elastic:
        return _identify_elastic(hostname)
    if found.over_mpi:
        # Here only when MPI cannot be used (basics meets over MPI where it can): more than one
        # rank must not carry on as many one-rank jobs.
        if found.size is None or found.size > 1:
            raise ValueError(
                f"this process was started by {found.source} ({' '.join(found.variables)}) but "
                f"hvdlite cannot use MPI here (mpi4py or an MPI library is missing: pip install "
                f"mpi4py mpich), so it cannot meet the other ranks. Install them, or start the "
                f"job with hvdlite-run.")
        return Identity(0, 1, None, None, False, found.source, hostname)
    if found.size is None or found.size <= 1 or not found.store_host:
        return Identity(found.rank or 0, found.size or 1, found.store_host, found.store_port,
                        found.store_is_master and bool(found.store_host), found.source,
                        hostname, store_fd=found.store_fd if found.store_host else None)
    host = found.store_host
    if found.source == "SLURM (srun)":
        host = environment.slurm_first_node_address(host)
    return Identity(found.rank, found.size, host, found.store_port, found.store_is_master,
                    found.source, hostname, store_fd=found.store_fd)


def store_prefix(ident: Identity, generation: int) -> str:
    """Namespace of one job generation's keys in the store. Elastic rounds are numbered by the
    driver, so a worker that joins in round 3 uses the same keys as the survivors."""
    if ident.round is not None:
        return f"hvdlite/elastic/{ident.round}/"
    return f"hvdlite/{config.raw('HVDLITE_JOB_GENERATION', '0')}/{generation}/"


_stores: dict[tuple, object] = {}


def connect_store(ident: Identity, timeout_s: float):
    """The job's store; kept for the life of the process so shutdown()/init() can reuse it."""
    import torch.distributed as dist  # here, not at the top: hvdlite-run imports this module

    if ident.store_host is None:
        return dist.HashStore()
    key = (ident.store_host, ident.store_port, ident.store_is_master)
    store = _stores.get(key)
    if store is None:
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if ident.store_fd is not None:
                store = serve_store_on(dist.TCPStore, ident.store_host, ident.store_port,
                                       ident.store_fd, timeout)
            elif ident.store_is_master:
                store = dist.TCPStore(ident.store_host, ident.store_port, None, True,
                                      timeout=timeout, wait_for_workers=False)
            else:
                store = reach_store(dist.TCPStore, ident.store_host, ident.store_port, timeout)
        except StoreSocketLost:
            raise  # its message is the whole story: no address or timeout is involved
        except Exception as exc:
            where = f"{ident.store_host}:{ident.store_port}"
            action = "serve" if ident.store_is_master else "reach"
            served_by = (" Under hvdlite-run, rank 0 serves the store from its init(): check "
                         "that rank 0 is running and reaches init()."
                         if ident.source == "hvdlite-run" and ident.rank != 0 else "")
            raise RuntimeError(
                f"rank {ident.rank} could not {action} the rendezvous store at {where} "
                f"(from the {ident.source}) within {timeout_s:.0f} s: {exc}. Check the address, "
                f"that the port is free on rank 0's host, and HVDLITE_START_TIMEOUT."
                f"{served_by}") from exc
        _stores[key] = store
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def reach_store(tcp_store: Callable[..., Any], host: str, port: int,
                timeout: datetime.timedelta) -> Any:
    """torch's TCPStore client, bounded by `timeout` whatever state the server is in.

    Why: when rank 0 serves the store (`serve_store_on`), its socket listens from before any
    rank starts, so a client's connection is accepted by the kernel at once, and torch's client
    then waits for the server's handshake reply with no timeout of its own: were rank 0 stuck
    before `init()`, the other ranks would wait forever. The constructor releases the GIL, so
    it runs in a daemon thread here, and the wait for it is what is bounded. (A refused
    connection is retried by torch itself within `timeout`.)"""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = tcp_store(host, port, None, False, timeout=timeout,
                                     wait_for_workers=False)
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=connect, name="hvdlite-store-connect", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    if thread.is_alive():
        raise TimeoutError(f"no answer from the store at {host}:{port} within "
                           f"{timeout.total_seconds():.0f} s")
    if "error" in box:
        raise box["error"]
    return box["store"]


class StoreSocketLost(RuntimeError):
    """Rank 0 was told to serve the store on a descriptor it does not hold."""


def serve_store_on(tcp_store: Callable[..., Any], host: str, port: int, fd: int,
                   timeout: datetime.timedelta) -> Any:
    """Serve the job's store on the listening socket `fd` that hvdlite-run handed to rank 0.

    The socket was bound and listening before any rank started, so ranks that connected early
    wait in its backlog. A torch without `master_listen_fd` (before 2.4) cannot take it: the
    socket is closed and the store binds the same port itself; early connections are reset and
    torch's client retries them within its timeout."""
    try:
        is_socket = stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        raise StoreSocketLost(
            f"{STORE_FD_ENV}={fd} is not an open socket in this process: hvdlite-run handed "
            f"rank 0 the store's listening socket as descriptor {fd}, and something between the "
            f"launcher and this process closed it (a wrapper that closes inherited descriptors, "
            f"or a child process started by rank 0 that calls init() again). Start rank 0's "
            f"command without closing inherited descriptors, or set HVDLITE_STORE_ON_DRIVER=1 "
            f"for hvdlite-run so that the launcher serves the store itself")
    os.set_inheritable(fd, False)  # the store is this process's, not its children's
    try:
        return tcp_store(host, port, None, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)
    except TypeError as exc:
        if "master_listen_fd" not in str(exc) and "incompatible" not in str(exc):
            raise
    os.close(fd)
    return tcp_store(host, port, None, True, timeout=timeout, wait_for_workers=False)


def advertised_host(ident: Identity) -> str:
    """The address other ranks should use to reach this host's sockets."""
    explicit = config.raw("HVDLITE_COORDINATOR_ADDR")
    if explicit:
        return explicit
    if ident.store_host is None:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(ident.store_host, ident.store_port or 0, socket.AF_INET)
        target = infos[0][4][0]
        if target.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, ident.store_port or 1))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


# ---------------------------------------------------------------------- control-channel handshake
_MAGIC = b"HVDLITE-CTL/1"
_NONCE = 32
_MAX_HELLO = 1 << 16


class WorkerRemoved(SystemExit):
    """This elastic worker is not part of the job any more (its host was removed, the job has
    enough workers, or it is finishing). Raised from `init()`; exits the process with status 0."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RoundAborted(HorovodInternalError):
    """The driver aborted the elastic round this worker was initialising for (a member died
    or hung during init()); init() asks for the next round."""


def round_aborted(ident: Identity, wait_s: float = 0.0) -> Optional[str]:
    """Why the driver aborted `ident`'s elastic round, or None. With wait_s, wait that long
    for the driver's word (a failure seen here may reach the driver a moment later)."""
    link = _link
    if link is None or ident.round is None:
        return None
    return link.aborted(ident.round, wait_s)


def expect_driver_close(why: str) -> None:
    """This worker is done (its function returned) but its process lives on (a Ray actor):
    the driver closing the link from now on is the job's end, not a lost driver."""
    link = _link
    if link is not None:
        with link._cond:
            link._reply = ("X", why)


def report_hung(ranks: list) -> None:
    """Ranks of the current round that the coordinator found hung (stalled past the stall
    shutdown time): the next join request names them, so the driver ends those processes."""
    link = _link
    if link is not None:
        with link._cond:
            link.suspects = sorted(set(link.suspects) | {int(r) for r in ranks})


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        data += chunk
    return bytes(data)


def _session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"hvdlite control channel" + server_nonce + client_nonce,
                    hashlib.sha256).digest()


PEER_MAGIC = b"hvdlite-peer1"
PEER_NONCE = 16


def peer_session_key(key: bytes, listener_nonce: bytes, client_nonce: bytes) -> bytes:
    """The key of one rank-to-rank connection of the steady state (engine.py).

    Those connections cannot use the driver's handshake: it waits for the server's nonce, and two
    background threads that connect to each other at once would each wait for the other. So
    the server's fresh value is its *listener nonce*, drawn once per process and handed to the
    other ranks by the coordinator over its own authenticated channel; the client sends its
    nonce first, in the clear, and never waits. The listener refuses a client nonce it has seen
    before, so a recorded connection replayed to it, or to any other process, is refused."""
    return hmac.new(key, b"hvdlite peer channel" + listener_nonce + client_nonce,
                    hashlib.sha256).digest()


def server_handshake(sock: socket.socket, key: bytes, timeout: float) -> tuple[Channel, Any]:
    """Driver side: returns the channel and the client's authenticated first message.
    Raises ProtocolError for a client that does not know the job secret (or replays)."""
    sock.settimeout(timeout)
    server_nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + server_nonce)
    client_nonce = _recv_exact(sock, _NONCE)
    # Before anything is buffered: a first frame announcing a huge payload is not a hello.
    header = sock.recv(12, socket.MSG_PEEK | socket.MSG_WAITALL)
    if len(header) == 12 and int.from_bytes(header[:4], "big") > _MAX_HELLO:
        raise ProtocolError("rejected a control message: oversized first frame")
    sock.settimeout(None)
    channel = Channel(sock, _session_key(key, server_nonce, client_nonce))
    hello = channel.recv_blocking(timeout)
    channel.send(("WELCOME",))
    return channel, hello


def client_handshake(sock: socket.socket, key: bytes, hello: Any, timeout: float) -> Channel:
    """Worker side: authenticate both ways (a driver without the secret cannot answer)."""
    sock.settimeout(timeout)
    head = _recv_exact(sock, len(_MAGIC) + _NONCE)
    if not head.startswith(_MAGIC):
        raise ProtocolError("the peer is not an hvdlite control endpoint")
    client_nonce = os.urandom(_NONCE)
    sock.sendall(client_nonce)
    sock.settimeout(None)
    channel = Channel(sock, _session_key(key, head[len(_MAGIC):], client_nonce))
    channel.send(hello)
    reply = channel.recv_blocking(timeout)
    if reply != ("WELCOME",):
        raise ProtocolError(f"unexpected answer from the driver: {reply!r}")
    return channel


# ---------------------------------------------------------------------- elastic workers
def is_elastic_worker() -> bool:
    return bool(config.raw(ELASTIC_WORKER_ENV))


def job_secret() -> bytes | None:
    """The job secret from HVDLITE_SECRET (hex or text), or from the file HVDLITE_SECRET_FILE
    names; None when neither is set. hvdlite-run always sets HVDLITE_SECRET; under torchrun or
    Horovod's variables the user may set either on every rank."""
    secret = config.raw("HVDLITE_SECRET", "")
    path = config.raw("HVDLITE_SECRET_FILE", "")
    if not secret and path:
        try:
            with open(path, "rb") as f:
                raw = f.read().strip()
        except OSError as exc:
            raise ValueError(f"HVDLITE_SECRET_FILE={path!r} cannot be read: {exc}") from None
        if not raw:
            raise ValueError(f"HVDLITE_SECRET_FILE={path!r} is empty")
        secret = raw.decode(errors="surrogateescape")
    if not secret:
        return None
    try:
        return bytes.fromhex(secret)
    except ValueError:
        return secret.encode(errors="surrogateescape")


def _job_secret() -> bytes:
    return job_secret() or b""


class DriverLink:
    """An elastic worker's connection to the driver: asks for rounds, hears host updates."""

    def __init__(self, addr: str, port: int, worker_id: str, timeout_s: float):
        self.addr, self.port, self.worker_id = addr, port, worker_id
        self.round: Optional[int] = None
        self.round_serial = 0                # host-update serial the current round reflects
        self._cond = threading.Condition()
        self._reply: Optional[tuple] = None
        self._closed: Optional[str] = None
        self._listeners: list[Callable[[int, int], Any]] = []
        # Host updates of the current round, replayed to listeners that register late (a
        # worker can hear of a change before its training function is entered).
        self._updates: list[tuple[int, int]] = []
        self._aborted: dict[int, str] = {}     # round -> why the driver aborted it
        self.suspects: list[int] = []          # hung ranks to report with the next join
        # The current round has no member that held the last commit: it resumes from the
        # checkpoint the driver was told of (report_checkpoint).
        self.from_checkpoint = False
        try:
            sock = socket.create_connection((addr, port), timeout=timeout_s)
            hello = ("HELLO", worker_id, config.raw(ELASTIC_SPAWN_ENV, ""), os.getpid(),
                     socket.gethostname())
            self.channel = client_handshake(sock, _job_secret(), hello, timeout_s)
        except (OSError, ProtocolError) as exc:
            raise HorovodInternalError(
                f"elastic worker {worker_id} could not reach the hvdlite-run driver at "
                f"{addr}:{port}: {exc}") from exc
        self._thread = threading.Thread(target=self._read, name="hvdlite-driver-link",
                                        daemon=True)
        self._thread.start()

    # -- notifications ---------------------------------------------------------------------
    def add_listener(self, callback: Callable[[int, int], Any]) -> None:
        with self._cond:
            if callback in self._listeners:
                return
            self._listeners.append(callback)
            missed = [u for u in self._updates if u[0] > self.round_serial]
        for serial, flags in missed:
            callback(serial, flags)

    def remove_listener(self, callback: Callable[[int, int], Any]) -> None:
        with self._cond:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def _read(self) -> None:
        try:
            while True:
                if not self.channel.feed():
                    raise ConnectionError("the driver closed the connection")
                for msg in self.channel.messages():
                    self._dispatch(msg)
        except Exception as exc:  # EOF, reset, a frame that fails authentication
            reason = str(exc) or type(exc).__name__
        with self._cond:
            self._closed = reason
            self._cond.notify_all()
            removed = self._reply is not None and self._reply[0] == "X"
        if removed:
            return  # told to leave: the process is exiting on its own
        # Without its driver an elastic worker cannot re-form, and nothing would stop it: exit
        # (SIGTERM runs the usual handlers) rather than outlive the job as an orphan.
        log.error("elastic worker %s lost its connection to the hvdlite-run driver at "
                  "%s:%s (%s); stopping", self.worker_id, self.addr, self.port, reason)
        os.kill(os.getpid(), signal.SIGTERM)

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("A", "X"):
            with self._cond:
                self._reply = msg
                self._cond.notify_all()
        elif kind == "R":
            with self._cond:
                self._aborted[int(msg[1])] = str(msg[2])
                self._cond.notify_all()
        elif kind == "U":
            with self._cond:
                self._updates.append((int(msg[1]), int(msg[2])))
                listeners = list(self._listeners)
            for callback in listeners:
                try:
                    callback(msg[1], msg[2])
                except Exception:  # a listener's bug must not kill the link
                    log.exception("hvdlite: host-update listener failed")

    # -- rounds ----------------------------------------------------------------------------
    def aborted(self, round_: int, wait_s: float = 0.0) -> Optional[str]:
        with self._cond:
            if round_ not in self._aborted and wait_s > 0:
                self._cond.wait_for(lambda: round_ in self._aborted or self._closed is not None,
                                    wait_s)
            return self._aborted.get(round_)

    def join(self) -> dict:
        """Block until the driver places this worker in a new round; returns the assignment."""
        with self._cond:
            self._reply = None
            if self._closed is not None:
                raise HorovodInternalError(f"the hvdlite-run driver is gone: {self._closed}")
        with self._cond:
            suspects, self.suspects = self.suspects, []
        self.channel.send(("J", self.round, suspects))
        with self._cond:
            while self._reply is None and self._closed is None:
                self._cond.wait()
            reply, closed = self._reply, self._closed
        if reply is None:
            raise HorovodInternalError(f"elastic worker {self.worker_id} lost the hvdlite-run "
                                       f"driver while waiting for a new round: {closed}")
        if reply[0] == "X":
            raise WorkerRemoved(reply[1])
        assignment = reply[1]
        with self._cond:
            self.round = assignment["round"]
            self.round_serial = assignment["serial"]
            self.from_checkpoint = bool(assignment.get("from_checkpoint"))
            self._updates = [u for u in self._updates if u[0] > self.round_serial]
        return assignment


    def report_checkpoint(self, commit_count: int, path: str) -> None:
        """Tell the driver a complete checkpoint exists, so that a round with no member
        holding the last commit may resume from it instead of stopping the job."""
        try:
            self.channel.send(("C", int(commit_count), str(path)))   # thread-safe
        except OSError:
            pass  # the driver is gone: the link's reader thread handles that


_link: Optional[DriverLink] = None
_link_lock = threading.Lock()


def driver_link() -> Optional[DriverLink]:
    """This process's link to the elastic driver (None outside elastic workers)."""
    global _link
    if not is_elastic_worker():
        return None
    with _link_lock:
        if _link is None:
            addr = config.raw(DRIVER_ADDR_ENV)
            port = _int(DRIVER_PORT_ENV)
            if not addr or port is None:
                raise ValueError(f"{ELASTIC_WORKER_ENV} is set but {DRIVER_ADDR_ENV}/"
                                 f"{DRIVER_PORT_ENV} are not; start elastic jobs with "
                                 f"hvdlite-run.")
            timeout = float(config.raw("HVDLITE_START_TIMEOUT") or 30)
            _link = DriverLink(addr, port, config.raw(ELASTIC_WORKER_ENV), timeout)
        return _link


_COORDINATES = (("RANK", "rank"), ("SIZE", "size"), ("LOCAL_RANK", "local_rank"),
                ("LOCAL_SIZE", "local_size"), ("CROSS_RANK", "cross_rank"),
                ("CROSS_SIZE", "cross_size"))


def _identify_elastic(hostname: str) -> Identity:
    worker_id = config.raw(ELASTIC_WORKER_ENV)
    link = driver_link()
    try:
        a = link.join()
    except WorkerRemoved as exc:
        log.warning("%s", exc)
        raise
    # Horovod-era code reads its coordinates from the environment: keep it current.
    for env_name, key in _COORDINATES:
        os.environ[f"HVDLITE_{env_name}"] = os.environ[f"HOROVOD_{env_name}"] = str(a[key])
    host = config.raw("HVDLITE_STORE_ADDR")
    port = _int("HVDLITE_STORE_PORT")
    if host is None or port is None:
        raise ValueError("elastic worker without HVDLITE_STORE_ADDR/HVDLITE_STORE_PORT; start "
                         "elastic jobs with hvdlite-run.")
    return Identity(a["rank"], a["size"], host, port, False, "hvdlite-run (elastic)", hostname,
                    round=a["round"], worker_id=worker_id)
