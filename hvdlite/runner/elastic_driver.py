"""The elastic driver: keeps a job running while hosts come and go.

One event loop (this module) owns all decisions; threads only report events to it: the discovery
poller, the control endpoint (control.py: worker hellos, join requests, lost connections,
rejected forgeries), one waiter per worker process, and signals.

Workers and rounds. A worker is one process for one slot of one host, named `host:slot`. It
learns its rank at every `hvd.init()` by asking the driver to *join* the next round. A round is
formed when every live worker has asked (survivors after a failure or a host update, and workers
started for new slots), so every member of the round enters `init()` with the same round number,
which namespaces the round's keys in the store.

Stable ordering. The slots of the current round keep their place; new slots are appended in the
order hosts were discovered, up to `--max-np`. Ranks are assigned host by host (so local ranks
are contiguous, as the coordinator computes them), hosts that still have workers from the last
round first, and within a host the survivors first: rank 0 is a survivor whenever there is one.

Host updates. When discovery (or a blacklist cooldown running out) changes the set of slots the
job should use, the driver starts workers for new slots right away (they wait in `init()`) and
tells every running worker, with a serial number and added/removed flags; the workers interrupt
at their next `state.commit()` and join the next round. Workers whose slot is no longer wanted
are told to leave when they ask to join, and exit with status 0.

Failures. A worker that exits non-zero, is killed, hangs or does not start costs its own slot:
the slot is blacklisted (for the cooldown of `--blacklist-cooldown-range`, else for good) while
other workers of its host still run, because they hold the last commit and one crashing process
(an OOM, a bad library on one GPU) says nothing about its host-mates. The whole host is
blacklisted only when the host itself is gone: unreachable (ssh failed), or every worker on it
failed. The peers see `HorovodInternalError`, roll back and join the next round without it.
A re-formed round always holds the last commit: it has a member of an earlier round, or a
worker reported a complete checkpoint (("C", commit, path), from hvdlite.torch.checkpoint), and
the round's workers are told to resume from it; otherwise the job stops with one line saying so
rather than silently training again from step 0. When every worker failed, new workers start
from such a checkpoint, once per checkpoint (a bug that kills every rank again stops the job).
The job stops with a message and a non-zero exit when
the reset limit is exceeded, when fewer than `--min-np` slots stay available for
`--elastic-timeout` seconds, when the discovery script fails on its first run, or when every
worker has failed. It succeeds when the workers of the last round finish with status 0.
"""
from __future__ import annotations

import os
import queue
import secrets
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from hvdlite.common.host_updates import HostUpdateResult
from hvdlite.runner import hang_report
from hvdlite.runner.control import ControlServer, WorkerConnection
from hvdlite.runner.discovery import (DEFAULT_INTERVAL_S, Blacklist, DiscoveryError, FixedHosts,
                                      HostDiscoveryScript)
from hvdlite.runner.driver import (REMOTE_TERMINATE_GRACE_S, TERMINATE_GRACE_S, Rendezvous,
                                   exit_description, shell_exit_code)
from hvdlite.runner.hosts import is_local_host
from hvdlite.runner.local import (Spawner, SSHSettings, find_command, kill, remote_host,
                                  spawner_for, terminate)
from hvdlite.runner.output import Console, RankOutput
from hvdlite.runner.worker_env import elastic_env

EXIT_STOPPED = 1   # the driver stopped the job (reset limit, too few slots, discovery failure)


@dataclass
class ElasticSpec:
    command: list[str]
    env: dict[str, str]
    discovery: Union[HostDiscoveryScript, FixedHosts]
    num_proc: int                       # slots needed to start
    min_np: int                         # slots needed to go on after a reset
    max_np: Optional[int] = None
    start_timeout: int = 30
    elastic_timeout: int = 600
    reset_limit: Optional[int] = None
    cooldown_range: Optional[tuple[int, int]] = None
    nics: Optional[list[str]] = None
    output_filename: Optional[str] = None
    prefix_timestamp: bool = False
    verbose: bool = False
    name: str = "hvdlite-run"
    ssh: SSHSettings = field(default_factory=SSHSettings)
    discovery_interval: float = DEFAULT_INTERVAL_S
    # host -> how to start a worker there; None: this machine directly, others over ssh.
    # hvdlite.ray plugs in Ray actors here (with its own discovery and rendezvous).
    spawner: Optional[Callable[[str], Spawner]] = None


@dataclass
class ElasticResult:
    exit_code: int
    message: Optional[str] = None
    interrupted_by: Optional[int] = None
    rounds: int = 0
    resets: int = 0
    final_ranks: dict[str, int] = field(default_factory=dict)   # worker id -> rank, last round
    failures: list[str] = field(default_factory=list)


class _Worker:
    def __init__(self, host: str, slot: int, spawn_id: str, proc: Any, output: RankOutput):
        self.host, self.slot, self.spawn_id = host, slot, spawn_id
        self.wid = f"{host}:{slot}"
        self.proc = proc
        self.output = output
        self.spawned_at = time.monotonic()
        self.conn: Optional[WorkerConnection] = None
        # starting -> waiting (asked to join) -> running (in a round) -> waiting ...;
        # removed: told to leave (or stopped by the driver); its exit is not a failure
        self.status = "starting"
        self.rank: Optional[int] = None
        self.round: Optional[int] = None
        self.returncode: Optional[int] = None
        self.failed = False
        self.done = threading.Event()     # the process has exited (set by its waiter thread)
        self.reaped = False               # ... and the event loop has handled that exit

    @property
    def alive(self) -> bool:
        """For decisions: a worker counts as alive until the event loop handled its exit, so a
        slot is never restarted (nor the job judged) before its exit was taken into account."""
        return not self.reaped

    def describe(self) -> str:
        parts = [f"host {self.host}"]
        if self.rank is not None and self.status in ("running", "waiting"):
            parts.append(f"rank {self.rank}")
        if remote_host(self.proc) is None:
            parts.append(f"pid {self.proc.pid}")
        return f"worker {self.wid} ({', '.join(parts)})"


class ElasticDriver:
    def __init__(self, spec: ElasticSpec, console: Optional[Console] = None,
                 rendezvous: Optional[Rendezvous] = None) -> None:
        self.spec = spec
        self.console = console or Console()
        self.events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.rdv = rendezvous
        self.server: Optional[ControlServer] = None
        self.available: "OrderedDict[str, int]" = OrderedDict()
        self.host_order: list[str] = []
        self.blacklist = Blacklist(spec.cooldown_range)         # hosts that are gone
        self.slot_blacklist = Blacklist(spec.cooldown_range)    # slots ("host:slot") that failed
        # The newest complete checkpoint a worker reported: (commit count, path), or None.
        self.checkpoint: Optional[tuple[int, str]] = None
        self.recovered_from: Optional[tuple[int, str]] = None  # ... once a round resumed from it
        self.workers: dict[str, _Worker] = {}
        self.retired: list[_Worker] = []      # earlier processes of a respawned slot
        self.round = 0
        self.plan: dict[str, dict] = {}       # worker id -> assignment of the current round
        self.resets = 0
        self.serial = 0                       # host-update serial
        self.notified: Optional[frozenset] = None
        self.short_since: Optional[float] = None
        self.finishing = False
        self.result: Optional[ElasticResult] = None
        self.failures: list[str] = []
        self.first_failure_code: Optional[int] = None
        self.failed_since_round = False
        self._recovery_announced = False
        self._stop_discovery = threading.Event()
        self._discovery_error: Optional[str] = None
        # Hung workers: named by the survivors' coordinator (a stall past the shutdown time),
        # or seen stopped here for that long (which also covers a stopped rank 0).
        self.hang_limit_s = hang_report.stall_shutdown_s(spec.env)
        self.stopped = hang_report.StoppedWatch()
        self.flight_dir: Optional[str] = None       # made in run(), once workers will start
        self._own_flight_dir = False
        self._dumps_asked = False

    # ------------------------------------------------------------------ helpers
    def _say(self, text: str) -> None:
        self.console.message(f"{self.spec.name}: {text}")

    def _verbose(self, text: str) -> None:
        if self.spec.verbose:
            self._say(text)

    def _live(self) -> list[_Worker]:
        return [w for w in self.workers.values() if w.alive and w.status != "removed"]

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> ElasticResult:
        spec = self.spec
        try:
            first = spec.discovery.find()
        except DiscoveryError as exc:
            self._say(f"elastic: {exc}")
            return ElasticResult(exit_code=EXIT_STOPPED, message=str(exc))
        self._on_hosts(first, announce=False)
        if spec.spawner is None and any(is_local_host(h) for h in first) \
                and find_command(spec.command[0]) is None:
            program = spec.command[0]
            if os.sep in program and os.path.exists(program):
                self._say(f"command {program!r} is not an executable file")
                return ElasticResult(exit_code=126, message="command not executable")
            self._say(f"command {program!r} not found")
            return ElasticResult(exit_code=127, message="command not found")
        if spec.output_filename:
            try:
                os.makedirs(spec.output_filename, exist_ok=True)
            except OSError as e:
                from hvdlite.runner.local import LaunchError

                raise LaunchError(f"--output-filename {spec.output_filename}: "
                                  f"{e.strerror}") from None
        all_local = isinstance(spec.discovery, FixedHosts) and \
            all(is_local_host(h) for h in first)
        if self.rdv is None:
            # The driver never reads or writes a key of the store itself: it starts in the
            # background while the first workers start (and import torch) too.
            self.rdv = Rendezvous(list(first), spec.start_timeout, spec.nics,
                                  all_interfaces=not all_local, background=True)
        self.flight_dir, self._own_flight_dir = hang_report.flight_dir_for(spec.env)
        spec.env = dict(spec.env, **{hang_report.FLIGHT_DIR_ENV: self.flight_dir})
        self.server = ControlServer(self.rdv.key, self.events.put,
                                    bind="127.0.0.1" if all_local else "0.0.0.0")
        self._verbose(f"elastic: store at port {self.rdv.port}, control endpoint at port "
                      f"{self.server.port}; hosts: {self._hosts_text(first)}")
        previous = self._install_handlers()
        poller = threading.Thread(target=self._poll_discovery, args=(first,),
                                  name="hvdlite-discovery", daemon=True)
        poller.start()
        try:
            self._loop()
        finally:
            self._stop_discovery.set()
            self._stop_all()
            self.server.close()
            self._restore_handlers(previous)
            for w in list(self.workers.values()) + self.retired:
                w.output.join(2.0)
            if self._dumps_asked:
                hang_report.finish(self.flight_dir, self._own_flight_dir, None,
                                   lambda text: self._say(text))
            elif self._own_flight_dir:
                import shutil
                shutil.rmtree(self.flight_dir, ignore_errors=True)
        assert self.result is not None
        self.result.rounds = self.round
        self.result.resets = self.resets
        self.result.failures = list(self.failures)
        return self.result

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: self.events.put(
                ("signal", signum)))
        return previous

    @staticmethod
    def _restore_handlers(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _poll_discovery(self, last: "OrderedDict[str, int]") -> None:
        while not self._stop_discovery.wait(self.spec.discovery_interval):
            try:
                hosts = self.spec.discovery.find()
            except DiscoveryError as exc:
                self.events.put(("discovery_error", str(exc)))
                continue
            if hosts != last:
                last = hosts
                self.events.put(("hosts", hosts))
            else:
                self.events.put(("discovery_ok",))

    def _loop(self) -> None:
        self._advance()              # the first workers start now, not after a first wait
        if self.result is None:
            self.rdv.serve()         # and the store (torch's import) behind them
        while self.result is None:
            try:
                event = self.events.get(timeout=0.25)
            except queue.Empty:
                event = ("tick",)
            self._handle(event)
            problem = self.rdv.start_problem()
            if problem is not None and self.result is None:
                self._say(problem)
                self.result = ElasticResult(exit_code=1, message=problem)
            if self.result is None:
                self._advance()

    # ------------------------------------------------------------------ events
    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "signal":
            self._ask_dumps()
            self._say(f"interrupted, stopping {len([w for w in self.workers.values() if w.alive])}"
                      f" workers")
            self.result = ElasticResult(exit_code=128 + event[1], interrupted_by=event[1])
        elif kind == "hosts":
            if self._discovery_error is not None:
                self._say("elastic: host discovery works again")
                self._discovery_error = None
            self._on_hosts(event[1])
        elif kind == "discovery_ok":
            if self._discovery_error is not None:
                self._say("elastic: host discovery works again")
                self._discovery_error = None
        elif kind == "discovery_error":
            if event[1] != self._discovery_error:
                self._say(f"elastic: {event[1]}; keeping the last host list and retrying")
                self._discovery_error = event[1]
        elif kind == "exit":
            self._on_exit(event[1])
        elif kind == "hello":
            self._on_hello(event[1])
        elif kind == "msg":
            self._on_message(event[1], event[2])
        elif kind == "lost":
            conn: WorkerConnection = event[1]
            w = self.workers.get(conn.worker_id)
            if w is not None and w.conn is conn:
                w.conn = None
        elif kind == "rejected":
            self._say(f"{event[1]} (the job goes on)")

    def _on_hosts(self, hosts: "OrderedDict[str, int]", announce: bool = True) -> None:
        for h in hosts:
            if h not in self.host_order:
                self.host_order.append(h)
        if announce:
            self._verbose(f"elastic: discovered hosts {self._hosts_text(hosts)}")
        self.available = OrderedDict(hosts)

    def _on_hello(self, conn: WorkerConnection) -> None:
        w = self.workers.get(conn.worker_id)
        if w is None or w.spawn_id != conn.spawn_id or not w.alive or w.conn is not None:
            self._say(f"rejected a control connection from {conn.peer} claiming to be worker "
                      f"{conn.worker_id}: no such worker is waiting for its connection "
                      f"(the job goes on)")
            conn.close()
            return
        w.conn = conn

    def _on_message(self, conn: WorkerConnection, msg: Any) -> None:
        w = self.workers.get(conn.worker_id)
        if w is None or w.conn is not conn:
            return
        if isinstance(msg, tuple) and msg and msg[0] == "J":
            if len(msg) > 2 and msg[2]:
                self._evict_named(w, msg[1], msg[2])
            if self.finishing:
                self._dismiss(w, "the job is finishing")
            elif w.status == "removed":
                self._dismiss(w, "its slot is no longer used")
            else:
                w.status = "waiting"
                self._verbose(f"elastic: {w.wid} asks to join round {self.round + 1}")
        elif isinstance(msg, tuple) and msg and msg[0] == "C" and len(msg) == 3:
            if self.checkpoint is None or int(msg[1]) >= self.checkpoint[0]:
                self.checkpoint = (int(msg[1]), str(msg[2]))
                self._verbose(f"elastic: checkpoint {msg[2]} (commit {msg[1]}) is complete")

    def _evict_named(self, reporter: _Worker, round_: Any, ranks: Any) -> None:
        """A survivor's coordinator found these ranks of `round_` hung (stalled past the stall
        shutdown time)."""
        named = [w for r in ranks for w in list(self.workers.values())
                 if w.round == round_ and w.rank == r and w.alive and w.status == "running"]
        for w in named:
            # Named together (a partitioned host's ranks all are): none of them counts as a
            # host-mate that still answers, so such a host is blacklisted as a whole.
            w.failed = True
        for w in named:
            self._evict_hung(w, f"rank {w.rank} made no progress for the stall shutdown time "
                                f"({self.hang_limit_s:.0f} s), as its peers' coordinator "
                                f"reported")

    def _evict_hung(self, w: _Worker, why: str) -> None:
        """End a hung worker as a failed one: SIGKILL (a stopped process ignores SIGTERM),
        blacklist its slot (its host, if nothing else runs there) with the cooldown, and let the
        others re-form without it."""
        if w.status == "removed" or not w.alive:
            return
        text = f"{w.describe()} hung: {why}"
        w.failed = True
        self.failures.append(text)
        self.failed_since_round = True
        if self.first_failure_code is None:
            self.first_failure_code = 1
        self._say(f"elastic: {text}; killing it (SIGKILL) and {self._blacklist_failed(w)}")
        w.status = "removed"
        kill(w.proc)
        self._abort_round(w, text)

    def _abort_round(self, failed: _Worker, text: str) -> None:
        """Tell the other members of the failed worker's round: any of them still in init()
        for it gives up at once and asks for the next round (rendezvous.RoundAborted)."""
        if failed.round is None or failed.round != self.round:
            return
        for w in self.workers.values():
            if w is not failed and w.alive and w.round == self.round and w.conn is not None \
                    and w.status == "running":
                w.conn.send(("R", self.round, f"round {self.round} was aborted: {text}"))

    def _ask_dumps(self) -> None:
        """On an interrupt: every live local worker dumps its flight recorder and stacks."""
        self._dumps_asked = True
        hang_report.ask_dumps([w.proc.pid for w in self.workers.values()
                               if w.alive and w.proc is not None and not w.done.is_set()
                               and remote_host(w.proc) is None], self.flight_dir)

    def _check_stopped(self) -> None:
        if self.finishing or self.hang_limit_s <= 0:
            return
        now = time.monotonic()
        for w in self._live():
            if remote_host(w.proc) is not None or w.proc is None:
                continue
            if self.stopped.stopped_for(w.proc.pid, now) > self.hang_limit_s:
                self._evict_hung(w, f"its process has been stopped for more than the stall "
                                    f"shutdown time ({self.hang_limit_s:.0f} s)")

    def _dismiss(self, w: _Worker, why: str) -> None:
        w.status = "removed"
        if w.conn is not None:
            w.conn.send(("X", f"elastic worker {w.wid} leaves the job: {why}"))

    def _on_exit(self, w: _Worker) -> None:
        w.reaped = True
        if w.output is not None:
            w.output.join(1.0)  # its last lines (a traceback) first
        code = w.returncode
        remote = remote_host(w.proc) is not None
        if w.status == "removed":
            self._verbose(f"elastic: {w.describe()} left the job "
                          f"({exit_description(code, remote)})")
            return
        if code == 0:
            if not self.finishing:
                self._verbose(f"elastic: {w.describe()} finished; the job is finishing")
            self.finishing = True
            return
        text = f"{w.describe()} {exit_description(code, remote)}"
        w.failed = True
        self.failures.append(text)
        if self.first_failure_code is None:
            self.first_failure_code = shell_exit_code(code)
        self.failed_since_round = True
        if self.finishing:
            self._say(f"elastic: {text}")
            return
        unreachable = remote and code == 255   # ssh itself failed: the host is gone
        self._say(f"elastic: {text}; {self._blacklist_failed(w, unreachable)}")
        self._abort_round(w, text)

    def _blacklist_failed(self, w: _Worker, unreachable: bool = False) -> str:
        """Blacklist what a failed worker says is broken, and say what that was.

        Its slot, while another worker of its host still runs: those host-mates hold the last
        commit, and dismissing them with the host would lose every committed step. Its host,
        when the host is unreachable or no worker on it is left (every one failed or exited).
        """
        mates = [o for o in self.workers.values()
                 if o is not w and o.host == w.host and o.alive and not o.failed
                 and not o.done.is_set() and o.status != "removed"]
        if unreachable or not mates:
            if self.blacklist.is_blacklisted(w.host):
                return f"host {w.host} is blacklisted already"
            what, delay = f"host {w.host}", self.blacklist.add(w.host)
        else:
            what, delay = f"slot {w.wid}", self.slot_blacklist.add(w.wid)
        how_long = "for the rest of the job" if delay is None else f"for {delay:.0f} s"
        return f"blacklisting {what} {how_long}"

    # ------------------------------------------------------------------ decisions
    def _advance(self) -> None:
        self._check_stopped()
        now = time.monotonic()
        for host in self.blacklist.expired(now):
            self._say(f"elastic: host {host} is back after its blacklist cooldown")
        for wid in self.slot_blacklist.expired(now):
            self._say(f"elastic: slot {wid} is back after its blacklist cooldown")
        if self.finishing:
            self._finish()
            return
        live = self._live()
        if self._all_failed():
            if self.checkpoint is None or self.checkpoint == self.recovered_from:
                self._stop(f"elastic: every worker has failed; the last error: "
                           f"{self.failures[-1]}", self.first_failure_code or 1)
                return
            if not self._recovery_announced:
                # Once per checkpoint: a bug that kills every rank again stops the job.
                self._recovery_announced = True
                self._say(f"elastic: every worker has failed; new workers will resume from "
                          f"checkpoint {self.checkpoint[1]} (commit {self.checkpoint[0]})")
        target = self._target(now)
        # Workers that never joined and whose slot is no longer wanted: stop them now.
        for w in live:
            if w.status == "starting" and w.wid not in target:
                self._retire(w, "its slot is no longer used")
        # Start workers for wanted slots that have none; they wait in init() for a round.
        for wid in target:
            w = self.workers.get(wid)
            if w is None or not w.alive or w.status == "removed":
                if w is not None and w.alive:
                    continue  # still leaving
                self._spawn(*self._split(wid))
        if self.result is not None:
            return
        self._notify_changes(target)
        # Too few slots (whatever the workers are doing): wait for more, --elastic-timeout long.
        needed = self.spec.num_proc if self.round == 0 else self.spec.min_np
        if len(target) < needed:
            if getattr(self.spec.discovery, "fixed", False) and not self.blacklist.returns() \
                    and not self.slot_blacklist.returns():
                # A fixed host list gains no slots, and no blacklisted host comes back: waiting
                # --elastic-timeout (600 s) cannot help.
                self._stop(f"elastic: only {len(target)} slots left but {needed} needed "
                           f"({self._needed_flag()}), and a fixed host list (-H/--hostfile, no "
                           f"--host-discovery-script) gains none"
                           + ("" if self.spec.cooldown_range else
                              " (a failed host stays out without --blacklist-cooldown-range)")
                           + f"; hosts: {self._usable_text(now)}", EXIT_STOPPED)
                return
            if self.short_since is None:
                self.short_since = now
                self._say(f"elastic: waiting for more slots: {len(target)} available, "
                          f"{needed} needed ({self._needed_flag()}); hosts: "
                          f"{self._usable_text(now)}")
            elif now - self.short_since > self.spec.elastic_timeout:
                self._stop(f"elastic: only {len(target)} slots available but {needed} needed "
                           f"({self._needed_flag()}) for --elastic-timeout "
                           f"{self.spec.elastic_timeout} s; hosts: {self._usable_text(now)}",
                           EXIT_STOPPED)
                return
        elif self.short_since is not None:
            self.short_since = None
            self._verbose("elastic: enough slots again")
        live = self._live()
        starting = [w for w in live if w.status == "starting"]
        for w in starting:
            if now - w.spawned_at > self.spec.start_timeout:
                self._fail_start(w)
        if any(w.status in ("starting", "running") for w in live):
            return
        waiting = [w for w in live if w.status == "waiting"]
        for w in waiting:
            if w.wid not in target:
                self._dismiss(w, "its host was removed or the job has --max-np workers")
        members = [w for w in waiting if w.wid in target]
        if len(members) < needed or not members:
            return
        from_checkpoint = self.round > 0 and not any(w.round is not None for w in members)
        if from_checkpoint and self.checkpoint is None:
            self._stop(self._state_lost_text(), EXIT_STOPPED)
            return
        if self.round > 0:
            limit = self.spec.reset_limit
            if limit is not None and self.resets >= limit:
                self._stop(f"elastic: the job needs reset number {self.resets + 1} but "
                           f"--reset-limit is {limit}; stopping", EXIT_STOPPED)
                return
            self.resets += 1
        if from_checkpoint:
            self._say(f"elastic: no worker left holds the last commit; round {self.round + 1} "
                      f"resumes from checkpoint {self.checkpoint[1]} (commit "
                      f"{self.checkpoint[0]})")
            self.recovered_from = self.checkpoint
            self._recovery_announced = False
        self._form_round([w.wid for w in members], target, from_checkpoint)

    def _all_failed(self) -> bool:
        """No worker left, and every worker of the last round (or, before the first round,
        every worker started) failed: nothing to go on with."""
        if any(w.alive for w in list(self.workers.values()) + self.retired):
            return False
        if self.round == 0:
            group = list(self.workers.values()) + self.retired
        else:
            group = [self.workers[wid] for wid in self.plan if wid in self.workers]
        return bool(group) and all(w.failed for w in group)

    def _state_lost_text(self) -> str:
        """Why a round with only fresh workers may not form: they would train from step 0."""
        held = [wid for wid in self.plan]
        return (f"elastic: no worker left holds the last commit (round {self.round}'s workers "
                f"{', '.join(held)} are gone) and no checkpoint was saved; stopping instead of "
                f"restarting from step 0 (give the state a checkpoint_dir to resume from disk)")

    def _needed_flag(self) -> str:
        return f"-np {self.spec.num_proc}" if self.round == 0 else f"--min-np {self.spec.min_np}"

    @staticmethod
    def _split(wid: str) -> tuple[str, int]:
        host, _, slot = wid.rpartition(":")
        return host, int(slot)

    def _target(self, now: float) -> list[str]:
        """The slots the job should use now, in stable order, at most --max-np."""
        usable = [h for h in self.host_order
                  if h in self.available and not self.blacklist.is_blacklisted(h, now)]
        slots = {h: self.available[h] for h in usable}
        kept = []
        for wid, _ in sorted(self.plan.items(), key=lambda kv: kv[1]["rank"]):
            host, slot = self._split(wid)
            if host in slots and slot < slots[host] \
                    and not self.slot_blacklist.is_blacklisted(wid, now):
                kept.append(wid)
        target = list(kept)
        taken = set(kept)
        for h in usable:
            for i in range(slots[h]):
                wid = f"{h}:{i}"
                if wid not in taken and not self.slot_blacklist.is_blacklisted(wid, now):
                    target.append(wid)
                    taken.add(wid)
        if self.spec.max_np is not None:
            target = target[:self.spec.max_np]
        return target

    def _notify_changes(self, target: list[str]) -> None:
        """Tell the running workers when the slots to use differ from the current round's."""
        if self.round == 0 or self.finishing:
            return
        wanted, current = frozenset(target), frozenset(self.plan)
        if wanted == current:
            self.notified = None  # back to the round's slots: a later change is news again
            return
        if wanted == self.notified:
            return
        if any(wid not in self.workers or not self.workers[wid].alive
               or self.workers[wid].status != "running" for wid in self.plan):
            return  # a reset is under way anyway (a worker failed or is re-joining)
        added, removed = wanted - current, current - wanted
        flags = (HostUpdateResult.added if added else 0) | \
            (HostUpdateResult.removed if removed else 0)
        self.serial += 1
        self.notified = wanted
        parts = []
        if added:
            parts.append(f"adding {', '.join(sorted(added))}")
        if removed:
            parts.append(f"removing {', '.join(sorted(removed))}")
        self._say(f"elastic: hosts changed ({'; '.join(parts)}); notifying the workers")
        for wid in self.plan:
            w = self.workers.get(wid)
            if w is not None and w.alive and w.status == "running" and w.conn is not None:
                w.conn.send(("U", self.serial, int(flags)))

    def _assign(self, members: list[str]) -> list[tuple[str, dict]]:
        """Ranks for the next round (see the module docstring for the order)."""
        # Survivors: the very processes of the last round (not a slot's new process).
        previous = {wid: a["rank"] for wid, a in self.plan.items()
                    if wid in self.workers and self.workers[wid].round == self.round}
        position = {wid: i for i, wid in enumerate(members)}
        by_host: "OrderedDict[str, list[str]]" = OrderedDict()
        for wid in members:
            by_host.setdefault(self._split(wid)[0], []).append(wid)

        def host_key(host: str) -> tuple:
            kept = [previous[w] for w in by_host[host] if w in previous]
            return (min(kept) if kept else float("inf"), position[by_host[host][0]])

        hosts = sorted(by_host, key=host_key)
        for host in hosts:
            by_host[host].sort(key=lambda w: (previous.get(w, float("inf")), self._split(w)[1]))
        size = len(members)
        out = []
        rank = 0
        for host in hosts:
            wids = by_host[host]
            for local_rank, wid in enumerate(wids):
                peers = [h for h in hosts if len(by_host[h]) > local_rank]
                out.append((wid, {"rank": rank, "size": size, "local_rank": local_rank,
                                  "local_size": len(wids), "cross_rank": peers.index(host),
                                  "cross_size": len(peers)}))
                rank += 1
        return out

    def _form_round(self, members: list[str], target: list[str],
                    from_checkpoint: bool = False) -> None:
        assignments = self._assign(members)
        self.round += 1
        self.plan = {wid: a for wid, a in assignments}
        self.notified = None
        self.failed_since_round = False
        for wid, a in assignments:
            w = self.workers[wid]
            w.status, w.rank, w.round = "running", a["rank"], self.round
            payload = dict(a, round=self.round, serial=self.serial,
                           from_checkpoint=from_checkpoint)
            if w.conn is None or not w.conn.send(("A", payload)):
                pass  # it died meanwhile: its exit is a failure and the round re-forms
        layout = ", ".join(f"{wid}={a['rank']}" for wid, a in assignments)
        if self.round == 1:
            self._verbose(f"elastic: round 1 with {len(assignments)} workers: {layout}")
        else:
            self._say(f"elastic: reset {self.resets}: round {self.round} with "
                      f"{len(assignments)} workers: {layout}")

    # ------------------------------------------------------------------ processes
    def _spawn(self, host: str, slot: int) -> None:
        spec = self.spec
        wid = f"{host}:{slot}"
        spawn_id = secrets.token_hex(8)
        env = elastic_env(host, slot, spawn_id, spec.env, self.rdv.addr_for(host), self.rdv.port,
                          self.server.port, spec.start_timeout, self.rdv.key.hex(), spec.nics)
        self._verbose(f"elastic: starting worker {wid}: {' '.join(spec.command)}")
        try:
            spawn = spec.spawner(host) if spec.spawner is not None else spawner_for(host, spec.ssh)
            proc = spawn(spec.command, env)
        except OSError as exc:
            # The command cannot run here at all: retrying elsewhere will not help.
            self._stop(f"elastic: cannot start worker {wid}: {spec.command[0]}: {exc.strerror}",
                       127 if isinstance(exc, FileNotFoundError) else 126)
            return
        dir_name = f"worker.{host}.{slot}".replace(":", "_").replace("/", "_")
        try:
            output = RankOutput(0, 1, proc.stdout, proc.stderr, self.console,
                                spec.output_filename, spec.prefix_timestamp, label=wid,
                                dir_name=dir_name)
        except OSError as exc:
            kill(proc)
            proc.wait()
            self._stop(f"cannot write the output of worker {wid} under "
                       f"{spec.output_filename}: {exc}", 2)
            return
        old = self.workers.get(wid)
        if old is not None:
            self.retired.append(old)
        w = _Worker(host, slot, spawn_id, proc, output)
        self.workers[wid] = w

        def wait() -> None:
            w.returncode = proc.wait()
            w.done.set()
            self.events.put(("exit", w))

        threading.Thread(target=wait, name=f"hvdlite-wait-{wid}", daemon=True).start()

    def _retire(self, w: _Worker, why: str) -> None:
        self._verbose(f"elastic: stopping {w.describe()}: {why}")
        w.status = "removed"
        terminate(w.proc)

    def _fail_start(self, w: _Worker) -> None:
        text = (f"{w.describe()} did not call hvd.init() within --start-timeout "
                f"{self.spec.start_timeout} s")
        self.failures.append(text)
        self.failed_since_round = True
        w.failed = True
        if self.first_failure_code is None:
            self.first_failure_code = 1
        self._say(f"elastic: {text}; stopping it and {self._blacklist_failed(w)}")
        w.status = "removed"
        kill(w.proc)

    def _finish(self) -> None:
        """After a worker finished: dismiss the others as they ask, then report."""
        for w in self._live():
            if w.status == "starting":
                self._retire(w, "the job is finishing")
            elif w.status == "waiting":
                self._dismiss(w, "the job is finishing")
        if any(w.alive for w in self.workers.values()):
            return
        final = {wid: a["rank"] for wid, a in self.plan.items()
                 if wid in self.workers and self.workers[wid].returncode == 0
                 and self.workers[wid].status != "removed"}
        failed_members = [wid for wid in self.plan
                          if wid in self.workers and self.workers[wid].returncode not in (0, None)
                          and self.workers[wid].status != "removed"]
        if failed_members:
            code = self.first_failure_code or 1
            self.result = ElasticResult(exit_code=code, final_ranks=final,
                                        message=self.failures[-1] if self.failures else None)
        else:
            self.result = ElasticResult(exit_code=0, final_ranks=final)

    def _stop(self, message: str, code: int) -> None:
        self._say(message)
        self.result = ElasticResult(exit_code=code, message=message)

    def _stop_all(self) -> None:
        """Stop every worker still running: terminate, then kill after the grace period."""
        live = [w for w in list(self.workers.values()) + self.retired if not w.done.is_set()]
        if not live:
            return
        for w in live:
            w.status = "removed"
            if w.conn is not None:
                w.conn.send(("X", "the job is stopping"))
            terminate(w.proc)
        remote = any(remote_host(w.proc) is not None for w in live)
        deadline = time.monotonic() + (REMOTE_TERMINATE_GRACE_S if remote else TERMINATE_GRACE_S)
        second_signal = False
        while any(not w.done.is_set() for w in live) and time.monotonic() < deadline \
                and not second_signal:
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            second_signal = event[0] == "signal"
        for w in live:
            if not w.done.is_set():
                kill(w.proc)
        for w in live:
            w.done.wait(10.0)
        from hvdlite.runner.driver import _group_has_live_members, _killpg

        for w in live:
            if remote_host(w.proc) is None and _group_has_live_members(w.proc.pid):
                _killpg(w.proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ text
    @staticmethod
    def _hosts_text(hosts: "OrderedDict[str, int]") -> str:
        return ",".join(f"{h}:{n}" for h, n in hosts.items()) or "(none)"

    def _usable_text(self, now: float) -> str:
        parts = []
        for h, n in self.available.items():
            mark = " (blacklisted)" if self.blacklist.is_blacklisted(h, now) else ""
            out = [f"{h}:{i}" for i in range(n)
                   if self.slot_blacklist.is_blacklisted(f"{h}:{i}", now)]
            if out and not mark:
                mark = f" (slot{'s' if len(out) > 1 else ''} {', '.join(out)} blacklisted)"
            parts.append(f"{h}:{n}{mark}")
        return ", ".join(parts) or "(none)"


def run_elastic(spec: ElasticSpec, console: Optional[Console] = None,
                rendezvous: Optional[Rendezvous] = None) -> ElasticResult:
    return ElasticDriver(spec, console, rendezvous).run()
