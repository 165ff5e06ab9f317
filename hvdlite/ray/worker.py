"""The Ray actor that hosts one hvdlite worker, and how its outcome comes back to the driver.

The actor's process is the worker: the driver sets hvdlite's rank environment in it (the same
variables `hvdlite-run` gives a rank, runner/worker_env.py) before the user's function runs, so
`hvd.init()` inside that function finds its rank, the job's store and the job secret.

Outcomes travel as ("ok", value) or ("error", pickled exception or None, traceback text, rank,
node): a user exception may not unpickle on the driver, and its traceback must survive anyway.
"""
from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

# Variables of another kind of job that must not leak into this one's workers.
_ELASTIC_ONLY = ("HVDLITE_ELASTIC_WORKER", "HVDLITE_ELASTIC_SPAWN", "HVDLITE_DRIVER_ADDR",
                 "HVDLITE_DRIVER_PORT", "HVDLITE_ELASTIC", "HOROVOD_ELASTIC")


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _outcome_of(call: Callable[[], Any], where: dict) -> tuple:
    try:
        return ("ok", call())
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the driver
        from hvdlite.common.rendezvous import WorkerRemoved

        if isinstance(exc, WorkerRemoved):
            return ("removed", str(exc))
        text = traceback.format_exc()
        try:
            import cloudpickle

            blob: Optional[bytes] = cloudpickle.dumps(exc)
        except Exception:
            blob = None
        return ("error", blob, text, where.get("rank"), where.get("node"))


class HvdliteWorker:
    """One hvdlite rank (made a Ray actor by the executor with its resource options)."""

    def __init__(self) -> None:
        self.executable: Any = None
        self.where: dict = {"rank": None, "node": None}

    def node_info(self) -> dict:
        import ray

        return {"node_id": _node_id(), "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid()}

    def update_env(self, env: Mapping[str, str], rank: Optional[int] = None) -> None:
        for name in _ELASTIC_ONLY:
            os.environ.pop(name, None)
        os.environ.update({k: str(v) for k, v in env.items()})
        self.where = {"rank": rank, "node": _node_id()}

    def start_executable(self, executable_cls: Optional[type], args: Sequence[Any],
                         kwargs: Mapping[str, Any]) -> None:
        if executable_cls is not None:
            self.executable = executable_cls(*args, **kwargs)

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple:
        return _outcome_of(lambda: fn(*args, **kwargs), self.where)

    def run_raw(self, fn: Callable[..., Any], args: Sequence[Any],
                kwargs: Mapping[str, Any]) -> Any:
        return fn(*args, **kwargs)

    def gpu_ids(self) -> list:
        import ray

        return list(ray.get_gpu_ids())

    def execute(self, fn: Callable[[Any], Any]) -> tuple:
        return _outcome_of(lambda: fn(self.executable), self.where)

    def run_elastic(self, env: Mapping[str, str], fn: Callable[..., Any], args: Sequence[Any],
                    kwargs: Mapping[str, Any]) -> tuple:
        """An elastic worker: a fresh actor per start, which learns its rank from the driver at
        every `hvd.init()` (hvdlite/common/rendezvous.py)."""
        os.environ.update({k: str(v) for k, v in env.items()})
        self.where = {"rank": None, "node": _node_id()}
        outcome = _outcome_of(lambda: fn(*args, **kwargs), self.where)
        # Under hvdlite-run the process would exit now. The actor lives on until the driver ends
        # it, so its link to the driver must not take the driver's closing for a lost driver.
        from hvdlite.common import rendezvous

        rendezvous.expect_driver_close("the worker's function returned")
        return outcome
