"""Elastic jobs on Ray: hvdlite's own elastic driver (runner/elastic_driver.py), with Ray's live
nodes as the host list and Ray actors as the workers.

- Host discovery (`RayHostDiscovery`): every alive node is a host; its slots are how many workers
  of the asked size its resources hold (CPU, GPU and custom resources, divided by the per-worker
  amount, as Horovod's Ray discovery counts them). A node that joins adds slots; a node that dies
  disappears from the list, and the actors on it die with it, which the driver treats as a
  failed worker: the peers roll back to the last commit and re-form without it.
- Workers: each start of a slot is a fresh actor pinned to its node (a hard node-affinity
  scheduling strategy), running the user's function after the elastic worker environment is
  set. Its "process" for the driver is `_ActorProcess`, which waits on the actor's result and ends
  the actor when the driver stops it.
- Rounds, ranks, commits and rollbacks are exactly those of `hvdlite-run --min-np/--max-np`:
  the same driver, the same `hvd.elastic.run`.

Slots are counted from the nodes' total resources (not what is free now), as in Horovod: the job's
own actors hold some of them. A node whose resources another job holds leaves the worker
unscheduled; the driver then counts a failed start after `timeout_s` and blacklists that node.
"""
from __future__ import annotations

import io
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import ray

from hvdlite.ray.placement import RayRendezvous, node_addresses
from hvdlite.runner.discovery import DiscoveryError

if TYPE_CHECKING:
    from hvdlite.ray.runner import RayExecutor

# How a worker whose actor died (with its node, or killed) is reported to the driver: as a
# process killed by SIGKILL on its host.
ACTOR_DIED_CODE = 128 + 9


class RayHostDiscovery:
    """Ray's alive nodes and how many workers each can hold."""

    def __init__(self, cpus_per_slot: float = 1, gpus_per_slot: float = 0,
                 resources_per_slot: Optional[Mapping[str, float]] = None) -> None:
        self.per_slot = {"CPU": float(cpus_per_slot or 0), "GPU": float(gpus_per_slot or 0)}
        self.per_slot.update({k: float(v) for k, v in (resources_per_slot or {}).items()})
        self.per_slot = {k: v for k, v in self.per_slot.items() if v > 0}

    def describe(self) -> str:
        return "Ray's alive nodes"

    def slots_of(self, resources: Mapping[str, float]) -> int:
        if not self.per_slot:
            return 1
        return min(int(math.floor(resources.get(k, 0.0) / v + 1e-9))
                   for k, v in self.per_slot.items())

    def find(self) -> "OrderedDict[str, int]":
        try:
            nodes = ray.nodes()
        except Exception as exc:  # the GCS is unreachable
            raise DiscoveryError(f"cannot list Ray's nodes: {exc}") from None
        hosts: "OrderedDict[str, int]" = OrderedDict()
        for node in nodes:
            if not node.get("Alive"):
                continue
            slots = self.slots_of(node.get("Resources", {}))
            if slots > 0:
                hosts[node["NodeID"]] = slots
        return hosts


class _ActorProcess:
    """The elastic driver's view of one worker actor: a process-like object (runner/local.py
    stops it through `hvdlite_stop`)."""

    pid = 0  # not a process of this machine: the driver never signals it

    def __init__(self, actor: Any, ref: Any, node_id: str) -> None:
        self.actor, self.ref = actor, ref
        self.hvdlite_remote_host = node_id   # remote_host(): no pid, no process group
        self.stdin = None
        self.stdout = io.BytesIO()           # the actor's output goes through Ray's log
        self.stderr = io.BytesIO()
        self.outcome: Optional[tuple] = None
        self.returncode: Optional[int] = None
        self._lock = threading.Lock()

    def wait(self) -> int:
        try:
            out = ray.get(self.ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
            self.outcome = ("died", str(exc))
            code = ACTOR_DIED_CODE
        else:
            self.outcome = out
            code = 0 if out[0] in ("ok", "removed") else 1
        self.returncode = code
        return code

    def poll(self) -> Optional[int]:
        return self.returncode

    def hvdlite_stop(self, force: bool) -> None:
        with self._lock:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:
                pass


def run_elastic_job(executor: "RayExecutor", fn: Callable[..., Any], args: Sequence[Any],
                    kwargs: Mapping[str, Any],
                    callbacks: Optional[list[Callable]] = None) -> list[Any]:
    """Run `fn` elastically; the results of the last round's workers, in rank order."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from hvdlite.common.exceptions import HorovodInternalError
    from hvdlite.ray.runner import _describe_node, _with_origin
    from hvdlite.runner.elastic_driver import ElasticSpec, run_elastic

    settings = executor.settings
    extra = executor._elastic_args or {}
    discovery = RayHostDiscovery(executor.cpus_per_worker, executor.gpus_per_worker,
                                 executor.resources_per_worker)
    rendezvous = RayRendezvous(None, settings.timeout_s, settings.nics)
    procs: dict[str, _ActorProcess] = {}
    every: list[_ActorProcess] = []

    def spawner(host: str) -> Callable[[Sequence[str], Mapping[str, str]], _ActorProcess]:
        def spawn(command: Sequence[str], env: Mapping[str, str]) -> _ActorProcess:
            actor = executor._actor_class(
                scheduling_strategy=NodeAffinitySchedulingStrategy(host, soft=False)).remote()
            ref = actor.run_elastic.remote(dict(env), fn, list(args), dict(kwargs))
            proc = _ActorProcess(actor, ref, host)
            procs[env["HVDLITE_ELASTIC_WORKER"]] = proc
            every.append(proc)
            return proc
        return spawn

    spec = ElasticSpec(command=["(Ray actor)"], env=dict(extra.get("env", {})),
                       discovery=discovery, num_proc=executor.min_workers,
                       min_np=executor.min_workers, max_np=executor.max_workers,
                       start_timeout=max(settings.timeout_s, 30),
                       elastic_timeout=executor.elastic_timeout,
                       reset_limit=executor.reset_limit,
                       cooldown_range=tuple(executor.cooldown_range)
                       if executor.cooldown_range else None,
                       nics=settings.nics, verbose=settings.verbose >= 2, name="hvdlite.ray",
                       spawner=spawner)
    try:
        result = run_elastic(spec, rendezvous=rendezvous)
    finally:
        for proc in every:
            proc.hvdlite_stop(True)
    if result.interrupted_by is not None:
        raise KeyboardInterrupt
    order = sorted(result.final_ranks, key=result.final_ranks.get)
    if result.exit_code != 0:
        ips = node_addresses()
        candidates = [procs[w] for w in order if w in procs] + every
        for proc in candidates:
            out = proc.outcome
            if out is not None and out[0] == "error":
                _, blob, text, _, node = out
                exc = None
                if blob is not None:
                    try:
                        import cloudpickle

                        exc = cloudpickle.loads(blob)
                    except Exception:
                        exc = None
                where = f"a worker on {_describe_node(node or proc.hvdlite_remote_host, ips)}"
                note = f"hvdlite.ray: raised by {where}; the worker's traceback:\n{text}"
                if isinstance(exc, BaseException) and not isinstance(exc, HorovodInternalError):
                    raise _with_origin(exc, note)
                raise RuntimeError(f"{where} raised an exception:\n{text}")
        raise RuntimeError(f"hvdlite.ray: the elastic job failed: "
                           f"{result.message or 'see the messages above'}")
    values = []
    for wid in order:
        out = procs[wid].outcome
        if out is None or out[0] != "ok":
            raise RuntimeError(f"hvdlite.ray: worker {wid} of the last round returned no "
                               f"result ({out[0] if out else 'none'})")
        values.append(out[1])
    return values


@dataclass
class ElasticRaySettings:
    """What `ElasticRayExecutor.create_settings` returns."""

    min_np: int = 1
    max_np: Optional[int] = None
    reset_limit: Optional[int] = None
    cooldown_range: Optional[tuple[int, int]] = None
    elastic_timeout: int = 600
    timeout_s: int = 30
    placement_group_timeout_s: int = 100
    nics: Optional[list[str]] = None
    verbose: int = 1
    failure_grace_s: float = 20.0


class ElasticRayExecutor:
    """Horovod's older elastic Ray API, on the same machinery as `RayExecutor(min_workers=...)`."""

    @staticmethod
    def create_settings(min_np: int = 1, max_np: Optional[int] = None,
                        reset_limit: Optional[int] = None, elastic_timeout: int = 600,
                        timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        nics: Any = None, cooldown_range: Optional[tuple[int, int]] = None,
                        verbose: int = 1, **_ignored: Any) -> ElasticRaySettings:
        from hvdlite.ray.runner import _nics

        return ElasticRaySettings(min_np=min_np, max_np=max_np, reset_limit=reset_limit,
                                  cooldown_range=cooldown_range, elastic_timeout=elastic_timeout,
                                  timeout_s=timeout_s, nics=_nics(nics), verbose=verbose)

    def __init__(self, settings: ElasticRaySettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: Optional[float] = None,
                 env_vars: Optional[dict[str, str]] = None, override_discovery: bool = True,
                 resources_per_slot: Optional[dict[str, float]] = None) -> None:
        from hvdlite.ray.runner import RayExecutor

        self.settings = settings
        self.env_vars = dict(env_vars or {})
        self._executor = RayExecutor(settings, cpus_per_worker=cpus_per_slot, use_gpu=use_gpu,
                                     gpus_per_worker=gpus_per_slot, min_workers=settings.min_np,
                                     max_workers=settings.max_np,
                                     reset_limit=settings.reset_limit,
                                     cooldown_range=settings.cooldown_range,
                                     elastic_timeout=settings.elastic_timeout,
                                     resources_per_worker=resources_per_slot)

    def start(self) -> None:
        self._executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any], callbacks: Optional[list[Callable]] = None) \
            -> list[Any]:
        return self._executor.run(worker_fn, callbacks=callbacks)

    def shutdown(self) -> None:
        self._executor.shutdown()
