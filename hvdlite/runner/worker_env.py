"""The environment contract between the launcher and a worker.

Every rank gets the caller's full environment, the tuning variables from the flags, and the
variables below. Each coordinate is exported under hvdlite's name and under the name that
`horovodrun --gloo` uses, so Horovod-era code that reads `HOROVOD_RANK` keeps working.

Rank 0 of a fixed job whose rank 0 runs on the launcher's machine also gets HVDLITE_STORE_FD, the
store's listening socket, which it serves the store on (set where the socket is passed to it:
driver._Job._start; see driver.Rendezvous).

An elastic worker gets no coordinates here: it learns them from the driver at every `init()`
(hvdlite/common/rendezvous.py), which also rewrites these variables in the worker's process.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from hvdlite.common.rendezvous import (DRIVER_ADDR_ENV, DRIVER_PORT_ENV, ELASTIC_SPAWN_ENV,
                                       ELASTIC_WORKER_ENV)
from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.secret import SECRET_ENV

# per-rank coordinates: exported as HVDLITE_<name> and HOROVOD_<name>
COORDINATES = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")


def _common_env(base_env: Mapping[str, str], store_addr: str, store_port: int,
                start_timeout: int, secret_hex: str,
                nics: Optional[Sequence[str]]) -> dict[str, str]:
    env = dict(base_env)
    # Ranks write into pipes; without this, Python buffers their prints until exit and a crashed
    # rank's last words are lost. A caller's explicit choice is kept.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["HVDLITE_STORE_ADDR"] = env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = store_addr
    env["HVDLITE_STORE_PORT"] = env["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(store_port)
    env["HVDLITE_START_TIMEOUT"] = env["HOROVOD_START_TIMEOUT"] = str(start_timeout)
    env["HOROVOD_CONTROLLER"] = "gloo"
    env["HOROVOD_CPU_OPERATIONS"] = "gloo"
    if nics:
        env["HVDLITE_GLOO_IFACE"] = env["HOROVOD_GLOO_IFACE"] = nics[0]
        env.setdefault("GLOO_SOCKET_IFNAME", nics[0])  # read by torch's gloo device
    env[SECRET_ENV] = secret_hex
    return env


def rank_env(slot: SlotInfo, base_env: Mapping[str, str], store_addr: str, store_port: int,
             start_timeout: int, secret_hex: str,
             nics: Optional[Sequence[str]] = None) -> dict[str, str]:
    """Full environment for the rank described by `slot` (fixed-size jobs)."""
    env = _common_env(base_env, store_addr, store_port, start_timeout, secret_hex, nics)
    for name in (ELASTIC_WORKER_ENV, ELASTIC_SPAWN_ENV, DRIVER_ADDR_ENV, DRIVER_PORT_ENV):
        env.pop(name, None)  # inherited from an elastic worker: this job is a fixed one
    values = {
        "RANK": slot.rank, "SIZE": slot.size,
        "LOCAL_RANK": slot.local_rank, "LOCAL_SIZE": slot.local_size,
        "CROSS_RANK": slot.cross_rank, "CROSS_SIZE": slot.cross_size,
        "HOSTNAME": slot.hostname,
    }
    for name in COORDINATES:
        env[f"HVDLITE_{name}"] = env[f"HOROVOD_{name}"] = str(values[name])
    return env


def elastic_env(host: str, slot: int, spawn_id: str, base_env: Mapping[str, str],
                store_addr: str, store_port: int, driver_port: int, start_timeout: int,
                secret_hex: str, nics: Optional[Sequence[str]] = None) -> dict[str, str]:
    """Full environment for an elastic worker on `host`, slot `slot`."""
    env = _common_env(base_env, store_addr, store_port, start_timeout, secret_hex, nics)
    for name in COORDINATES:
        env.pop(f"HVDLITE_{name}", None)
        env.pop(f"HOROVOD_{name}", None)
    env["HVDLITE_HOSTNAME"] = env["HOROVOD_HOSTNAME"] = host
    env["HVDLITE_ELASTIC"] = env["HOROVOD_ELASTIC"] = "1"
    env[ELASTIC_WORKER_ENV] = f"{host}:{slot}"
    env[ELASTIC_SPAWN_ENV] = spawn_id
    env[DRIVER_ADDR_ENV] = store_addr
    env[DRIVER_PORT_ENV] = str(driver_port)
    return env
