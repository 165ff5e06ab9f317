"""The driver: provides the rendezvous store (serves it, or hands its socket to a local rank 0),
starts every rank, watches them, stops them together.

Both `hvdlite-run` and `hvdlite.runner.run` go through `Rendezvous` + `run_job`, so a failing
rank, Ctrl-C and cleanup behave the same in either. The rules:

- the first rank that exits non-zero (or dies by a signal) is the cause: it is reported in one
  line, every other rank is stopped (SIGTERM to its process group, SIGKILL after a grace period),
  and the job's exit code is that rank's (128+N for signal N). Exits caused by our own SIGTERM are
  never reported as the cause;
- SIGINT/SIGTERM to the driver stop every rank the same way; a second signal skips the grace;
- nothing started by a rank's process group outlives the job. A remote rank's local process is
  its ssh client: stopping it closes the client's stdin, and the remote side (remote_exec.py)
  stops the rank's process group there, SIGTERM then SIGKILL;
- remote hosts are checked with `ssh host true` (in parallel, bounded by --start-timeout) before
  any rank starts, so an unreachable host or a wrong port fails the job with a message naming the
  host, and nothing is left running anywhere.
"""
from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from hvdlite.common.rendezvous import STORE_FD_ENV, serve_store_on
from hvdlite.runner import hang_report, secret
from hvdlite.runner.hosts import SlotInfo, driver_address_for, is_local_host
from hvdlite.runner.local import (LaunchError, Spawner, SSHSettings, kill, remote_host,
                                  spawn_local, spawner_for, terminate)
from hvdlite.runner.output import Console, RankOutput
from hvdlite.runner.remote import REMOTE_GRACE_S
from hvdlite.runner.worker_env import rank_env

TERMINATE_GRACE_S = 5.0
# A remote rank gets the remote side's grace, plus time for ssh to report back.
REMOTE_TERMINATE_GRACE_S = REMOTE_GRACE_S + 3.0


@dataclass
class JobSpec:
    """What to run, where, and how to present it."""

    command: list[str]
    slots: list[SlotInfo]
    env: dict[str, str]                 # base environment of every rank (caller's + tuning)
    start_timeout: int = 30
    nics: Optional[list[str]] = None
    output_filename: Optional[str] = None
    prefix_timestamp: bool = False
    verbose: bool = False
    name: str = "hvdlite-run"           # prefix of the driver's own messages
    ssh: SSHSettings = field(default_factory=SSHSettings)


@dataclass
class JobResult:
    exit_code: int
    failed_rank: Optional[int] = None   # the rank reported as the cause
    interrupted_by: Optional[int] = None  # signal that stopped the driver
    returncodes: dict[int, Optional[int]] = field(default_factory=dict)


class Rendezvous:
    """The job's c10d TCPStore, where workers (and `run`'s payloads) meet.

    With `serve=True` the driver serves it itself. With `serve=False` (a fixed-size
    `hvdlite-run` job whose rank 0 runs on this machine) the driver only opens the listening
    socket, and rank 0 serves the store on it (`handover`): the launcher then never imports
    torch, which costs ~1.5 s at every start on a small host (more with a CUDA build), before
    any rank can begin its own imports. Ranks that connect before rank 0's store runs wait in
    the socket's backlog. Elastic jobs, `hvdlite.runner.run` and Ray keep the driver's store:
    there it must outlive any one worker, or the driver reads and writes keys itself.

    `background=True` (with `serve=True`; hvdlite-run's drivers, which never read or write a key
    themselves): the listening socket is opened at once, and `serve()`, called once the first
    ranks are started, imports torch and starts the store in a thread behind it, so the ranks
    import torch meanwhile instead of after it. (Not before they start: loading torch's
    libraries holds the GIL for ~0.3 s at a time, and the driver's own thread could not start
    them meanwhile.) The first use of `store` waits for that start; `start_problem()` says,
    without waiting, whether it failed.

    It listens on 127.0.0.1 when every host is this machine, else on all interfaces; each host
    is told the driver address it can reach (`addr_for`)."""

    def __init__(self, hosts: list[str], timeout_s: int, nics: Optional[list[str]] = None,
                 all_interfaces: Optional[bool] = None, serve: bool = True,
                 background: bool = False) -> None:
        if all_interfaces is None:
            all_interfaces = not all(is_local_host(h) for h in hosts)
        bind = "0.0.0.0" if all_interfaces else "127.0.0.1"
        timeout = datetime.timedelta(seconds=max(timeout_s, 30))
        self._store: Any = None
        self._starting: Optional[threading.Thread] = None
        self._start_error: Optional[BaseException] = None
        self._timeout = timeout
        self.listener: Optional[socket.socket] = None
        if serve and not background:
            from torch.distributed import TCPStore  # imported here: torch is slow to import

            self._store = TCPStore(host_name=bind, port=0, world_size=None, is_master=True,
                                   wait_for_workers=False, timeout=timeout)
            self.port: int = int(self._store.port)
        else:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((bind, 0))
            listener.listen(socket.SOMAXCONN)  # every rank may connect before the store serves
            self.port = listener.getsockname()[1]
            if serve:
                self._starting = threading.Thread(target=self._serve, args=(bind, listener),
                                                  name="hvdlite-store-start", daemon=True)
            else:
                self.listener = listener
        self.bind = bind
        self.nics = nics
        self.key: bytes = secret.make_key()
        self._addrs: dict[str, str] = {}

    def _serve(self, bind: str, listener: socket.socket) -> None:
        """The background start: import torch, serve the store on the open socket."""
        try:
            from torch.distributed import TCPStore

            self._store = serve_store_on(TCPStore, bind, self.port, listener.detach(),
                                         self._timeout)
        except BaseException as exc:  # noqa: BLE001 - reported by store / start_problem
            self._start_error = exc

    def serve(self) -> None:
        """Start a background store's start (once; later calls do nothing)."""
        if self._starting is not None and self._starting.ident is None:
            self._starting.start()

    @property
    def store(self) -> Any:
        """The served store (None with serve=False); waits for a background start, at most the
        store's timeout, and raises what stopped it."""
        if self._starting is not None:
            self.serve()
            self._starting.join(self._timeout.total_seconds())
            if self._starting.is_alive():
                raise LaunchError(f"the job's store did not start within "
                                  f"{self._timeout.total_seconds():.0f} s (importing torch)")
            self._starting = None
        if self._start_error is not None:
            raise LaunchError(f"the job's store could not start: {self._start_error!r}")
        return self._store

    def start_problem(self) -> Optional[str]:
        """Without waiting: why the background start failed, or None (done, still going, or
        not asked for yet)."""
        if self._start_error is None:
            return None
        return f"the job's store could not start: {self._start_error!r}"

    def handover(self) -> Optional[int]:
        """The listening socket's descriptor for rank 0 to serve the store on, or None when the
        driver serves it."""
        return None if self.listener is None else self.listener.fileno()

    def close_listener(self) -> None:
        """Drop the driver's copy of the listening socket once rank 0 holds its own: from then
        on the store lives and dies with rank 0."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def addr_for(self, host: str) -> str:
        """The address workers on `host` reach the driver at."""
        if host not in self._addrs:
            self._addrs[host] = "127.0.0.1" if self.bind == "127.0.0.1" \
                else driver_address_for(host, self.nics)
        return self._addrs[host]

    def put_signed(self, key: str, data: bytes) -> None:
        assert self.store is not None, "put_signed needs the driver's own store (serve=True)"
        self.store.set(key, secret.sign(self.key, data))

    def get_signed(self, key: str) -> Optional[bytes]:
        """The verified value under `key`, or None when no worker wrote it."""
        assert self.store is not None, "get_signed needs the driver's own store (serve=True)"
        if not self.store.check([key]):
            return None
        return secret.verify(self.key, self.store.get(key))


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_has_live_members(pgid: int) -> bool:
    """True while a non-zombie process of the group `pgid` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def exit_description(returncode: int, remote: bool = False) -> str:
    """How a rank ended, in words. A remote rank's status comes through ssh: 128+N means the
    rank died from signal N there, 255 that ssh itself failed."""
    if returncode < 0:
        return f"was killed by signal {_signal_name(-returncode)}"
    if remote and returncode == 255:
        return "lost its ssh connection (ssh exited with code 255; see its error above)"
    if remote and 128 < returncode < 128 + 65:
        return f"was killed by signal {_signal_name(returncode - 128)} on its host"
    return f"exited with code {returncode}"


def describe_process(proc: Any, host: str) -> str:
    """`host h, pid p` for a local process; for a remote one the local pid (ssh's) is useless."""
    return f"host {host}" if remote_host(proc) is not None else f"host {host}, pid {proc.pid}"


def shell_exit_code(returncode: int) -> int:
    """Exit code for the driver: the rank's code, or 128+N when it died from signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Rank:
    def __init__(self, slot: SlotInfo, proc: Any, output: RankOutput) -> None:
        self.slot = slot
        self.proc = proc
        self.output = output
        self.pgid: int = proc.pid  # start_new_session: the rank leads its own group
        self.returncode: Optional[int] = None
        self.done = threading.Event()


class _Job:
    def __init__(self, spec: JobSpec, rendezvous: Rendezvous, console: Optional[Console]) -> None:
        self.spec = spec
        self.rdv = rendezvous
        self.console = console or Console()
        self.events: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self.ranks: list[_Rank] = []
        # Flight-recorder dumps of this job's ranks (hang_report.py); kept only when written.
        self.flight_dir = ""                  # made in run(), once ranks will start
        self._own_flight_dir = False
        self.hang_limit_s = hang_report.stall_shutdown_s(spec.env)
        self.stopped = hang_report.StoppedWatch()

    # -- signals ---------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.events.put(("signal", signum))  # SimpleQueue.put is safe in a signal handler

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may own handlers; cleanup still runs in `finally`
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    @staticmethod
    def _restore_handlers(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> JobResult:
        spawners = [spawner_for(s.hostname, self.spec.ssh) for s in self.spec.slots]
        check_reachable_hosts([s.hostname for s in self.spec.slots], self.spec.ssh,
                              self.console if self.spec.verbose else None, self.spec.name)
        if self.spec.output_filename:
            try:
                os.makedirs(self.spec.output_filename, exist_ok=True)
            except OSError as e:
                raise LaunchError(f"--output-filename {self.spec.output_filename}: "
                                  f"{e.strerror}") from None
        if self.spec.verbose:
            who = "the driver" if self.rdv.handover() is None else "rank 0"
            self.console.message(f"{self.spec.name}: rendezvous store on "
                                 f"{self.rdv.bind}:{self.rdv.port}, served by {who}")
        self.flight_dir, self._own_flight_dir = hang_report.flight_dir_for(self.spec.env)
        self.spec.env = dict(self.spec.env, **{hang_report.FLIGHT_DIR_ENV: self.flight_dir})
        previous = self._install_handlers()
        try:
            result = self._start(spawners)
            if result is None:
                self.rdv.serve()     # the driver's store, if it serves one, behind the ranks
                result = self._monitor()
        finally:
            self.rdv.close_listener()  # still open when rank 0 never started
            self._stop()
            self._sweep_groups(time.monotonic() + TERMINATE_GRACE_S)
            self._restore_handlers(previous)
            for r in self.ranks:
                r.output.join(2.0)
            self._report_hang()
        result.returncodes = {r.slot.rank: r.returncode for r in self.ranks}
        return result

    def _start(self, spawners: list[Spawner]) -> Optional[JobResult]:
        spec = self.spec
        secret_hex = self.rdv.key.hex()
        for slot, spawn in zip(spec.slots, spawners):
            env = rank_env(slot, spec.env, self.rdv.addr_for(slot.hostname), self.rdv.port,
                           spec.start_timeout, secret_hex, spec.nics)
            if spec.verbose:
                self.console.message(
                    f"{spec.name}: starting rank {slot.rank} on {slot.hostname} (local_rank "
                    f"{slot.local_rank}/{slot.local_size}, cross_rank "
                    f"{slot.cross_rank}/{slot.cross_size}): {' '.join(spec.command)}")
            store_fd = self.rdv.handover() if slot.rank == 0 else None
            try:
                if store_fd is None:
                    proc = spawn(spec.command, env)
                else:  # Rendezvous(serve=False) only when rank 0 is local
                    env[STORE_FD_ENV] = str(store_fd)
                    proc = spawn_local(spec.command, env, pass_fds=(store_fd,))
                    self.rdv.close_listener()
            except OSError as e:
                self.console.message(f"{spec.name}: cannot start rank {slot.rank} on host "
                                     f"{slot.hostname}: {spec.command[0]}: {e.strerror}")
                return JobResult(exit_code=127 if isinstance(e, FileNotFoundError) else 126,
                                 failed_rank=slot.rank)
            try:
                output = RankOutput(slot.rank, slot.size, proc.stdout, proc.stderr, self.console,
                                    spec.output_filename, spec.prefix_timestamp)
            except OSError as e:
                kill(proc)
                proc.wait()
                self.console.message(f"{spec.name}: cannot write the output of rank {slot.rank} "
                                     f"under {spec.output_filename}: {e}")
                return JobResult(exit_code=2, failed_rank=slot.rank)
            rank = _Rank(slot, proc, output)
            self.ranks.append(rank)
            threading.Thread(target=self._wait, args=(rank,), daemon=True,
                             name=f"hvdlite-wait-{slot.rank}").start()
        return None

    def _wait(self, rank: _Rank) -> None:
        rank.returncode = rank.proc.wait()
        rank.done.set()
        self.events.put(("exit", rank))

    def _monitor(self) -> JobResult:
        exited = 0
        while exited < len(self.ranks):
            try:
                kind, obj = self.events.get(timeout=1.0)
            except queue.Empty:
                hung = self._check_stopped()
                if hung is not None:
                    self._stop()
                    return JobResult(exit_code=1, failed_rank=hung)
                problem = self.rdv.start_problem()
                if problem is not None:     # the ranks would wait for it until their timeout
                    self.console.message(f"{self.spec.name}: {problem}")
                    self._stop()
                    return JobResult(exit_code=1)
                continue
            if kind == "signal":
                self._ask_dumps()
                stopped = self._stop()
                self.console.message(f"{self.spec.name}: interrupted, stopped {stopped} ranks")
                return JobResult(exit_code=128 + obj, interrupted_by=obj)
            exited += 1
            rank: _Rank = obj
            if rank.returncode != 0:
                rank.output.join(1.0)  # let its last lines (a traceback) come out first
                remote = remote_host(rank.proc) is not None
                self.console.message(
                    f"{self.spec.name}: rank {rank.slot.rank} "
                    f"({describe_process(rank.proc, rank.slot.hostname)}) "
                    f"{exit_description(rank.returncode, remote)}")
                self._stop()
                return JobResult(exit_code=shell_exit_code(rank.returncode),
                                 failed_rank=rank.slot.rank)
        return JobResult(exit_code=0)

    def _stop(self) -> int:
        """SIGTERM every live rank's group, SIGKILL what is left after the grace period (or at
        once on a second signal). Returns how many ranks were still running."""
        live = [r for r in self.ranks if not r.done.is_set()]
        if not live:
            return 0
        for r in live:
            if remote_host(r.proc) is None and hang_report.process_stopped(r.proc.pid):
                # A stopped process ignores SIGTERM until it is continued: it would outlive
                # the grace period, so it gets SIGKILL now.
                self.console.message(
                    f"{self.spec.name}: rank {r.slot.rank} "
                    f"({describe_process(r.proc, r.slot.hostname)}) is stopped (hung): "
                    f"killing it with SIGKILL")
                kill(r.proc)
            else:
                terminate(r.proc)
        remote = any(remote_host(r.proc) is not None for r in live)
        deadline = time.monotonic() + (REMOTE_TERMINATE_GRACE_S if remote else TERMINATE_GRACE_S)
        while any(not r.done.is_set() for r in live):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                kind, _ = self.events.get(timeout=min(0.1, remaining))
            except queue.Empty:
                continue
            if kind == "signal":
                break  # asked twice: do not wait any longer
        for r in live:
            if not r.done.is_set():
                kill(r.proc)
        for r in live:
            r.done.wait(10.0)
        self._sweep_groups(deadline)
        return len(live)

    def _check_stopped(self) -> Optional[int]:
        """A local rank stopped for longer than the stall shutdown time is hung: end the job
        (it is also what ends a job whose rank 0, the coordinator, is the one stopped)."""
        for r in self.ranks:
            if r.done.is_set() or remote_host(r.proc) is not None:
                continue
            if self.hang_limit_s > 0 and self.stopped.stopped_for(r.proc.pid) > self.hang_limit_s:
                self.console.message(
                    f"{self.spec.name}: rank {r.slot.rank} "
                    f"({describe_process(r.proc, r.slot.hostname)}) has been stopped (hung) for "
                    f"more than the stall shutdown time ({self.hang_limit_s:.0f} s); stopping "
                    f"the job")
                self._ask_dumps()
                return r.slot.rank
        return None

    def _ask_dumps(self) -> None:
        """Every live local rank dumps its flight recorder and stacks (SIGUSR1)."""
        hang_report.ask_dumps([r.proc.pid for r in self.ranks
                               if not r.done.is_set() and remote_host(r.proc) is None],
                              self.flight_dir)

    def _report_hang(self) -> None:
        hang_report.finish(self.flight_dir, self._own_flight_dir, len(self.spec.slots),
                           lambda text: self.console.message(f"{self.spec.name}: {text}"))

    def _sweep_groups(self, grace_until: float) -> None:
        """Stop what the ranks left behind in their process groups (orphaned children)."""
        groups = [r.pgid for r in self.ranks if r.done.is_set() and _group_has_live_members(r.pgid)]
        if not groups:
            return
        for pgid in groups:
            _killpg(pgid, signal.SIGTERM)
        while time.monotonic() < grace_until and any(_group_has_live_members(g) for g in groups):
            time.sleep(0.05)
        for pgid in groups:
            _killpg(pgid, signal.SIGKILL)


def run_job(spec: JobSpec, rendezvous: Rendezvous, console: Optional[Console] = None) -> JobResult:
    """Start every rank of `spec` against `rendezvous` and return when the job is over."""
    return _Job(spec, rendezvous, console).run()


def check_reachable_hosts(hosts: list[str], ssh: SSHSettings, console: Optional[Console] = None,
                          name: str = "hvdlite-run") -> None:
    """`ssh host true` on every remote host in parallel; LaunchError naming each one that fails.
    Local hosts need no check (and no ssh)."""
    from hvdlite.runner.remote import check_reachable

    remote = [h for h in dict.fromkeys(hosts) if not is_local_host(h)]
    if not remote:
        return
    if console is not None:
        console.message(f"{name}: checking ssh to {', '.join(remote)}")
    errors = check_reachable(remote, ssh)
    if errors:
        raise LaunchError("; ".join(errors))

