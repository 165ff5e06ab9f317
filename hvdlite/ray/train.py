"""A Ray Train backend for hvdlite: `HvdliteConfig`.

    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer   # Ray >= 2.4x, V2
    trainer = DataParallelTrainer(train_loop, backend_config=HvdliteConfig(),
                                  scaling_config=ScalingConfig(num_workers=4))

The train loop is a script written for `hvdlite.torch` or `hvdlite.tensorflow.keras`: it calls
`hvd.init()` and reports through `ray.train.report` as usual. Before it runs, the backend serves
hvdlite's rendezvous store in the process that drives the workers (Ray Train's controller),
and sets in each worker the rank environment `hvdlite-run` would give it. hvdlite's rank is Ray
Train's world rank; local and cross ranks come from the nodes Ray Train placed the workers on.

`ray.train.backend` is a Ray developer API; this backend is tested with the Ray versions in
`hvdlite.ray.TESTED_RAY_VERSIONS`, with Ray Train V2 (the default) and V1
(`RAY_TRAIN_V2_ENABLED=0`, `ray.train.data_parallel_trainer.DataParallelTrainer`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.train.backend import Backend, BackendConfig

from hvdlite.ray.topology import slots_in_order
from hvdlite.runner.worker_env import rank_env


@dataclass
class HvdliteConfig(BackendConfig):
    """How to set up hvdlite in Ray Train's workers.

    timeout_s: rendezvous / start-up timeout of every worker (HVDLITE_START_TIMEOUT).
    nics: network interfaces for gloo (the first one is used).
    env: extra environment for every worker (HOROVOD_* / HVDLITE_* tuning variables).
    """

    timeout_s: int = 300
    nics: Optional[list[str]] = None
    env: Optional[dict[str, str]] = None

    @property
    def backend_cls(self) -> type:
        return HvdliteBackend

    def to_dict(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "nics": list(self.nics or [])}


def _where() -> tuple[str, str]:
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _set_env(env: dict[str, str]) -> None:
    for name in ("HVDLITE_ELASTIC_WORKER", "HVDLITE_ELASTIC_SPAWN", "HVDLITE_DRIVER_ADDR",
                 "HVDLITE_DRIVER_PORT", "HVDLITE_ELASTIC", "HOROVOD_ELASTIC"):
        os.environ.pop(name, None)
    os.environ.update(env)


def _shutdown_hvdlite() -> None:
    import sys

    basics = sys.modules.get("hvdlite.common.basics")
    if basics is not None:
        try:
            basics.shutdown()
        except Exception:
            pass


class HvdliteBackend(Backend):
    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        self._rendezvous: Any = None

    def on_start(self, worker_group: Any, backend_config: HvdliteConfig) -> None:
        from hvdlite.ray.placement import RayRendezvous

        where = worker_group.execute(_where)
        slots = slots_in_order([node for node, _ in where])
        self._rendezvous = rdv = RayRendezvous([ip for _, ip in where], backend_config.timeout_s,
                                               backend_config.nics)
        refs = []
        for i, slot in enumerate(slots):
            env = rank_env(slot, dict(backend_config.env or {}), rdv.addr_for(slot.hostname),
                           rdv.port, backend_config.timeout_s, rdv.key.hex(),
                           backend_config.nics)
            refs.append(worker_group.execute_single_async(i, _set_env, env))
        ray.get(refs)

    def on_shutdown(self, worker_group: Any, backend_config: HvdliteConfig) -> None:
        try:
            worker_group.execute(_shutdown_hvdlite)
        finally:
            self._rendezvous = None
