"""`RayExecutor`: Horovod 0.28's Ray API on hvdlite.

Fixed-size jobs: `start()` reserves a placement group, starts one actor per worker in it, asks
each actor which node it landed on, assigns ranks node by node (topology.py), serves the
rendezvous store in the driver process and sets every actor's rank environment (the variables
`hvdlite-run` gives a rank). `run(fn)` then calls `fn` in every actor; inside it
`hvd.init()` finds its rank. Results come back in rank order.

Failures never leave a job hanging: the first worker that fails (its `fn` raised, or its actor
died with its node) ends every actor of the job, and the driver raises that worker's exception
with its rank and node, or `HorovodInternalError` naming the node that was lost.

Elastic jobs (`min_workers`/`max_workers`) run on hvdlite's elastic driver, with Ray's live nodes
as the host list (elastic.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import ray

from hvdlite.common.exceptions import HorovodInternalError
from hvdlite.ray.placement import (RayRendezvous, alive_nodes, make_placement_group,
                                   node_addresses)
from hvdlite.ray.topology import assign_ranks
from hvdlite.ray.worker import HvdliteWorker
from hvdlite.runner.worker_env import rank_env


@dataclass
class RaySettings:
    """What `RayExecutor.create_settings` returns (Horovod's settings object, cut to what
    matters on Ray: there is no ssh)."""

    timeout_s: int = 30                   # rendezvous / start-up timeout (HVDLITE_START_TIMEOUT)
    placement_group_timeout_s: int = 100  # how long to wait for the cluster to place the workers
    nics: Optional[list[str]] = None      # network interfaces for gloo (the first is used)
    verbose: int = 1
    # A failed worker's peers often fail too (they lost it mid-collective); how long the driver
    # waits for the root cause (an actor that died with its node) before it reports.
    failure_grace_s: float = 20.0


def _nics(value: Union[None, str, Iterable[str]]) -> Optional[list[str]]:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return [n.strip() for n in items if n.strip()] or None


def _describe_node(node_id: str, ips: dict[str, str]) -> str:
    return f"node {node_id} ({ips.get(node_id, 'address unknown')})"


def _with_origin(exc: BaseException, note: str) -> BaseException:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc.args = (f"{exc.args[0] if exc.args else ''}\n{note}",) + tuple(exc.args[1:])
    return exc


class RayExecutor:
    """Runs hvdlite workers as Ray actors (Horovod's `horovod.ray.RayExecutor`).

    Either `num_workers` (placed where Ray finds room, packed) or `num_hosts` x
    `num_workers_per_host` (one bundle per node, on different nodes). With `min_workers` or
    `max_workers` the job is elastic: workers follow Ray's live nodes (see elastic.py).

    Beyond Horovod: `resources_per_worker` adds custom Ray resources to each worker (for example
    to keep workers on nodes that advertise them), and `placement_strategy` overrides the
    placement group strategy (Horovod's PACK / STRICT_SPREAD by default).
    """

    @staticmethod
    def create_settings(timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: int = 100,
                        nics: Union[None, str, Iterable[str]] = None,
                        verbose: int = 1) -> RaySettings:
        """Horovod's signature; the ssh arguments are accepted and unused (Ray starts the
        workers, not ssh)."""
        return RaySettings(timeout_s=int(timeout_s),
                           placement_group_timeout_s=int(placement_group_timeout_s),
                           nics=_nics(nics), verbose=verbose)

    def __init__(self, settings: Optional[RaySettings] = None,
                 num_workers: Optional[int] = None, num_hosts: Optional[int] = None,
                 num_workers_per_host: int = 1, cpus_per_worker: float = 1,
                 use_gpu: bool = False, gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None,
                 cooldown_range: Optional[tuple[int, int]] = None,
                 elastic_timeout: int = 1200, override_discovery: bool = True,
                 resources_per_worker: Optional[dict[str, float]] = None,
                 placement_strategy: Optional[str] = None) -> None:
        self.settings = settings or RaySettings()
        self.elastic = min_workers is not None or max_workers is not None
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("gpus_per_worker is set but use_gpu is False; set use_gpu=True")
        if self.elastic:
            if num_workers is not None or num_hosts is not None:
                raise ValueError("an elastic RayExecutor (min_workers/max_workers) sizes itself "
                                 "from the cluster: leave num_workers and num_hosts unset")
            min_workers = 1 if min_workers is None else min_workers
            if min_workers < 1:
                raise ValueError(f"min_workers must be at least 1, got {min_workers}")
            if max_workers is not None and max_workers < min_workers:
                raise ValueError(f"max_workers ({max_workers}) is less than min_workers "
                                 f"({min_workers})")
        else:
            if (num_workers is None) == (num_hosts is None):
                raise ValueError("give either num_workers, or num_hosts with "
                                 "num_workers_per_host (not both)")
            count = num_workers if num_workers is not None else num_hosts
            if count < 1 or num_workers_per_host < 1:
                raise ValueError(f"the job needs at least one worker: num_workers={num_workers}, "
                                 f"num_hosts={num_hosts}, "
                                 f"num_workers_per_host={num_workers_per_host}")
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker if gpus_per_worker is not None else 1) \
            if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.reset_limit = reset_limit
        self.cooldown_range = cooldown_range
        self.elastic_timeout = elastic_timeout
        self.resources_per_worker = dict(resources_per_worker or {})
        self.placement_strategy = placement_strategy
        self.workers: list[Any] = []          # actors, in rank order
        self.slots: list[Any] = []            # their SlotInfo, in rank order
        self.nodes: list[dict] = []           # their node_info, in rank order
        self.placement_group: Any = None
        self.rendezvous: Optional[RayRendezvous] = None
        self._elastic_args: Optional[dict] = None

    # ------------------------------------------------------------------ resources
    def _worker_resources(self) -> dict[str, float]:
        res = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            res["GPU"] = float(self.gpus_per_worker)
        res.update({k: float(v) for k, v in self.resources_per_worker.items()})
        return {k: v for k, v in res.items() if v}

    def _actor_class(self, **placement: Any) -> Any:
        custom = {k: v for k, v in self.resources_per_worker.items()}
        return ray.remote(HvdliteWorker).options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker or 0,
            resources=custom or None, max_concurrency=1, **placement)

    # ------------------------------------------------------------------ lifecycle
    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[Sequence[Any]] = None,
              executable_kwargs: Optional[dict] = None,
              extra_env_vars: Optional[dict[str, str]] = None) -> None:
        """Place the workers and set up the rendezvous. `executable_cls(*args, **kwargs)` is
        built in every worker (what `execute` passes to its function); `extra_env_vars` are set
        in every worker."""
        if not ray.is_initialized():
            ray.init()
        if self.elastic:
            self._elastic_args = {"executable_cls": executable_cls,
                                  "executable_args": list(executable_args or ()),
                                  "executable_kwargs": dict(executable_kwargs or {}),
                                  "env": dict(extra_env_vars or {})}
            return
        if self.workers:
            raise RuntimeError("RayExecutor.start() was called twice; call shutdown() first")
        try:
            self._start_fixed(executable_cls, list(executable_args or ()),
                              dict(executable_kwargs or {}), dict(extra_env_vars or {}))
        except BaseException:
            self.shutdown()
            raise

    def _start_fixed(self, executable_cls: Optional[type], args: list, kwargs: dict,
                     extra_env: dict[str, str]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from hvdlite.ray.placement import resources_text

        per_worker = self._worker_resources()
        if self.num_workers is not None:
            bundles = [dict(per_worker) for _ in range(self.num_workers)]
            per_bundle = 1
            strategy = self.placement_strategy or "PACK"
            what = f"{self.num_workers} workers of {resources_text(per_worker)}"
        else:
            w = self.num_workers_per_host
            bundles = [{k: v * w for k, v in per_worker.items()} for _ in range(self.num_hosts)]
            per_bundle = w
            strategy = self.placement_strategy or "STRICT_SPREAD"
            what = (f"{self.num_hosts} hosts x {w} workers of {resources_text(per_worker)} "
                    f"(one host per node)")
        self.placement_group = make_placement_group(
            bundles, strategy, self.settings.placement_group_timeout_s, what)
        actors = []
        for b in range(len(bundles)):
            for _ in range(per_bundle):
                actors.append(self._actor_class(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=b,
                        placement_group_capture_child_tasks=False)).remote())
        self.workers = actors  # so a failure below still ends them
        infos = self._get([a.node_info.remote() for a in actors], "report its node")
        order = assign_ranks([i["node_id"] for i in infos])
        self.workers = [actors[i] for i, _ in order]
        self.slots = [slot for _, slot in order]
        self.nodes = [infos[i] for i, _ in order]
        self.rendezvous = RayRendezvous([i["ip"] for i in infos], self.settings.timeout_s,
                                        self.settings.nics)
        envs = []
        for slot in self.slots:
            env = rank_env(slot, extra_env, self.rendezvous.addr_for(slot.hostname),
                           self.rendezvous.port, self.settings.timeout_s,
                           self.rendezvous.key.hex(), self.settings.nics)
            envs.append(env)
        if self.use_gpu:
            self._share_gpus(envs)
        self._get([w.update_env.remote(env, slot.rank)
                   for w, env, slot in zip(self.workers, envs, self.slots)], "take its environment")
        self._get([w.start_executable.remote(executable_cls, args, kwargs) for w in self.workers],
                  "build its executable")

    def _share_gpus(self, envs: list[dict]) -> None:
        """Every worker on a node sees the GPUs of all the job's workers there, in local-rank
        order, so `torch.cuda.set_device(hvd.local_rank())` picks its own (Horovod does this)."""
        gpu_ids = self._get([w.gpu_ids.remote() for w in self.workers], "report its GPUs")
        by_node: dict[str, list[str]] = {}
        for slot, ids in zip(self.slots, gpu_ids):
            by_node.setdefault(slot.hostname, []).extend(str(i) for i in ids)
        for slot, env in zip(self.slots, envs):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(by_node[slot.hostname])

    def _get(self, refs: list, doing: str) -> list:
        """ray.get bounded by the settings' timeout, with the worker named on failure."""
        try:
            return ray.get(refs, timeout=max(self.settings.timeout_s, 30))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"hvdlite.ray: a worker did not {doing} within "
                               f"{max(self.settings.timeout_s, 30)} s (timeout_s)") from None
        except ray.exceptions.RayActorError as exc:
            raise HorovodInternalError(f"hvdlite.ray: a worker died before it could {doing}: "
                                       f"{exc}") from None

    def shutdown(self) -> None:
        """End every worker and release the placement group."""
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers = []
        self.slots = []
        self.nodes = []
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None
        self.rendezvous = None

    # ------------------------------------------------------------------ running
    def _require_started(self) -> None:
        if not self.workers:
            raise RuntimeError("RayExecutor: call start() first (or the job was ended by an "
                               "earlier failure: start() again)")

    def run(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
            kwargs: Optional[dict] = None, callbacks: Optional[list[Callable]] = None) -> list[Any]:
        """`fn(*args, **kwargs)` on every worker; the results in rank order. `callbacks` is
        accepted for Horovod's signature; worker output goes through Ray's log."""
        args, kwargs = list(args or ()), dict(kwargs or {})
        if self.elastic:
            from hvdlite.ray.elastic import run_elastic_job

            if self._elastic_args is None:
                self.start()
            return run_elastic_job(self, fn, args, kwargs, callbacks)
        self._require_started()
        return self._gather([w.run.remote(fn, args, kwargs) for w in self.workers])

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[list[Callable]] = None) -> list[Any]:
        """`fn(executable)` on every worker (the object `start(executable_cls)` built there).
        `callbacks` is accepted for Horovod's signature; worker output goes through Ray's log."""
        self._require_started()
        return self._gather([w.execute.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(executable)` on rank 0 only."""
        self._require_started()
        return self._gather([self.workers[0].execute.remote(fn)], ranks=[0])[0]

    def run_remote(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
                   kwargs: Optional[dict] = None) -> list[Any]:
        """Start `fn(*args, **kwargs)` on every worker and return the Ray object refs (rank
        order) without waiting; `ray.get` raises a worker's exception as Ray wraps it."""
        self._require_started()
        args, kwargs = list(args or ()), dict(kwargs or {})
        return [w.run_raw.remote(fn, args, kwargs) for w in self.workers]

    def _gather(self, refs: list, ranks: Optional[list[int]] = None) -> list[Any]:
        ranks = ranks if ranks is not None else list(range(len(refs)))
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        failures: list[tuple[int, Any]] = []   # (position, outcome or the RayActorError)

        def collect(done: list) -> None:
            for ref in done:
                i = index[ref]
                try:
                    out = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
                    failures.append((i, exc))
                    continue
                if out[0] == "ok":
                    results[i] = out[1]
                else:
                    failures.append((i, out))

        while pending and not failures:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            collect(done)
        if not failures:
            return results
        # The first failure may be a consequence (a peer lost its partner mid-collective): give
        # the cause, an actor that died with its node, a moment to surface.
        deadline = time.monotonic() + (self.settings.failure_grace_s
                                       if self._looks_consequential(failures) else 1.0)
        while pending and time.monotonic() < deadline and not any(
                not isinstance(f, tuple) for _, f in failures):
            done, pending = ray.wait(pending, num_returns=1, timeout=0.25)
            collect(done)
            if not done and self._lost_nodes(ranks):
                break
        error = self._failure_error(failures, ranks)
        self.shutdown()  # every actor of the job ends: none is left waiting in a collective
        raise error

    @staticmethod
    def _looks_consequential(failures: list[tuple[int, Any]]) -> bool:
        for _, f in failures:
            if isinstance(f, tuple) and "HorovodInternalError" in (f[2] or ""):
                return True
        return False

    def _lost_nodes(self, ranks: list[int]) -> list[int]:
        alive = alive_nodes()
        return [r for r in ranks if self.slots[r].hostname not in alive]

    def _failure_error(self, failures: list[tuple[int, Any]], ranks: list[int]) -> BaseException:
        ips = node_addresses()
        lost = self._lost_nodes(ranks)
        died = [(i, f) for i, f in failures if not isinstance(f, tuple)]
        if died or lost:
            rank = ranks[died[0][0]] if died else lost[0]
            node = self.slots[rank].hostname
            state = "was lost" if node not in alive_nodes() else "lost its worker process"
            detail = f": {died[0][1]}" if died else ""
            others = sorted({ranks[i] for i, _ in died} | set(lost))
            text = (f"hvdlite.ray: {_describe_node(node, ips)} {state}; rank {rank} (ranks "
                    f"{others} in all) died with it{detail}. Every worker of the job was "
                    f"stopped; use min_workers/max_workers for a job that goes on without the "
                    f"node.")
            return HorovodInternalError(text)
        i, (_, blob, text, _, node) = failures[0]
        rank = ranks[i]
        node = node or self.slots[rank].hostname
        where = f"rank {rank} on {_describe_node(node, ips)}"
        exc: Optional[BaseException] = None
        if blob is not None:
            try:
                import cloudpickle

                exc = cloudpickle.loads(blob)
            except Exception:
                exc = None
        note = (f"hvdlite.ray: raised by {where}; every worker of the job was stopped. "
                f"The worker's traceback:\n{text}")
        if isinstance(exc, BaseException):
            return _with_origin(exc, note)
        return RuntimeError(f"{where} raised an exception:\n{text}")

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "RayExecutor":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
