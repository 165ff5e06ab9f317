"""Where a rank learns who it is and where the job's c10d store lives.

Three ways in, in this order: hvdlite-run's variables (HVDLITE_*), Horovod's (HOROVOD_RANK, ...,
HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT), torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). With
none of them the process is a one-rank job, as `python train.py` is under Horovod.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class Identity:
    rank: int
    size: int
    store_host: str | None      # None: one-rank job, no store needed
    store_port: int | None
    store_is_master: bool       # this process hosts the store (rank 0 without a launcher)
    source: str                 # which environment it came from, for messages
    hostname: str


def _int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def identify() -> Identity:
    hostname = (os.environ.get("HVDLITE_HOSTNAME") or os.environ.get("HOROVOD_HOSTNAME")
                or socket.gethostname())
    rank = _int("HVDLITE_RANK")
    if rank is not None:
        size = _int("HVDLITE_SIZE")
        host = os.environ.get("HVDLITE_STORE_ADDR")
        port = _int("HVDLITE_STORE_PORT")
        if size is None or host is None or port is None:
            raise ValueError("HVDLITE_RANK is set but HVDLITE_SIZE, HVDLITE_STORE_ADDR or "
                             "HVDLITE_STORE_PORT is missing; start the job with hvdlite-run.")
        return Identity(rank, size, host, port, False, "hvdlite-run", hostname)
    rank = _int("HOROVOD_RANK")
    if rank is not None:
        size = _int("HOROVOD_SIZE")
        if size is None:
            raise ValueError("HOROVOD_RANK is set but HOROVOD_SIZE is not.")
        host = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        port = _int("HOROVOD_GLOO_RENDEZVOUS_PORT")
        if size > 1 and (host is None or port is None):
            raise ValueError("HOROVOD_RANK/HOROVOD_SIZE are set but HOROVOD_GLOO_RENDEZVOUS_ADDR/"
                             "HOROVOD_GLOO_RENDEZVOUS_PORT are not: set them to rank 0's address "
                             "and a free port (rank 0 serves the rendezvous there).")
        return Identity(rank, size, host, port, rank == 0, "HOROVOD_* environment", hostname)
    rank = _int("RANK")
    if rank is not None and _int("WORLD_SIZE") is not None:
        size = _int("WORLD_SIZE")
        host = os.environ.get("MASTER_ADDR")
        port = _int("MASTER_PORT")
        if size > 1 and (host is None or port is None):
            raise ValueError("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not.")
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return Identity(rank, size, host, port, rank == 0 and not agent, "torchrun environment",
                        hostname)
    return Identity(0, 1, None, None, False, "single process", hostname)


_stores: dict[tuple, object] = {}


def connect_store(ident: Identity, timeout_s: float):
    """The job's store; kept for the life of the process so shutdown()/init() can reuse it."""
    if ident.store_host is None:
        return dist.HashStore()
    key = (ident.store_host, ident.store_port, ident.store_is_master)
    store = _stores.get(key)
    if store is None:
        try:
            store = dist.TCPStore(ident.store_host, ident.store_port, None,
                                  ident.store_is_master,
                                  timeout=datetime.timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        except Exception as exc:
            where = f"{ident.store_host}:{ident.store_port}"
            action = "serve" if ident.store_is_master else "reach"
            raise RuntimeError(
                f"rank {ident.rank} could not {action} the rendezvous store at {where} "
                f"(from the {ident.source}) within {timeout_s:.0f} s: {exc}. Check the address, "
                f"that the port is free on rank 0's host, and HVDLITE_START_TIMEOUT.") from exc
        _stores[key] = store
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def advertised_host(ident: Identity) -> str:
    """The address other ranks should use to reach this host's sockets."""
    explicit = os.environ.get("HVDLITE_COORDINATOR_ADDR")
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
