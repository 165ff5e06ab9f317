"""`hvdlite.runner.run`: horovod.run's Python API on the same driver as `hvdlite-run`.

The function travels to the workers through the driver's rendezvous store (cloudpickled and
signed with the job secret), each worker writes back its return value or its traceback, and the
driver returns the values in rank order or raises with the remote traceback. In elastic mode the
values are those of the workers of the last round, in their final rank order.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from hvdlite.runner.env_flags import tuning_env
from hvdlite.runner.launch import UsageError, build_parser, check_args

_API_NAME = "hvdlite.runner.run"


def _nic_list(*values: Union[None, str, Iterable[str]]) -> Optional[list[str]]:
    nics: list[str] = []
    for value in values:
        if value is None:
            continue
        items = value.split(",") if isinstance(value, str) else list(value)
        for nic in items:
            nic = nic.strip()
            if nic and nic not in nics:
                nics.append(nic)
    return nics or None


# hvdlite-run's flags in the messages check_args shares with the launcher, and the parameter
# of run() each stands for: a caller of run() typed no flag.
_PARAMS = (
    ("-np/--num-proc", "num_proc"), ("--min-np/--min-num-proc", "min_num_proc"),
    ("--max-np/--max-num-proc", "max_num_proc"), ("--slots-per-host", "slots"),
    ("--reset-limit", "reset_limit"), ("--blacklist-cooldown-range", "cooldown_range"),
    ("-H/--hosts", "hosts"), ("-hostfile/--hostfile", "hostfile"),
    ("--host-discovery-script", "host_discovery_script"), ("--start-timeout", "start_timeout"),
    ("-p/--ssh-port", "ssh_port"), ("-i/--ssh-identity-file", "ssh_identity_file"),
    ("--network-interfaces", "network_interfaces"), ("--output-filename", "output_filename"),
    ("--gloo", "use_gloo"), ("--mpi", "use_mpi"),
)


def _api_message(text: str) -> str:
    """A check_args message in run()'s terms: "argument -np/--num-proc: ..." becomes
    "num_proc: ...", and "--max-np 2" becomes "max_num_proc=2"."""
    import re

    for flags, param in _PARAMS:
        names = sorted(set(flags.split("/")) | {flags}, key=len, reverse=True)
        alt = "|".join(re.escape(n) for n in names)
        text = re.sub(rf"argument (?:{alt})(?![\w-])", param, text)
        text = re.sub(rf"(?<![\w-])(?:{alt}) (\d+)", rf"{param}=\1", text)
        text = re.sub(rf"(?<![\w-])(?:{alt})(?![\w-])", param, text)
    return text


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict] = None,
        num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
        max_num_proc: Optional[int] = None, slots: Optional[int] = None,
        reset_limit: Optional[int] = None, cooldown_range: Optional[Sequence[int]] = None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None,
        host_discovery_script: Optional[str] = None, start_timeout: Optional[int] = None,
        ssh_port: Optional[int] = None, ssh_identity_file: Optional[str] = None,
        disable_cache: Optional[bool] = None, output_filename: Optional[str] = None,
        verbose: Optional[int] = None, use_gloo: Optional[bool] = None,
        use_mpi: Optional[bool] = None, mpi_args: Optional[str] = None,
        network_interface: Union[None, str, Iterable[str]] = None,
        network_interfaces: Union[None, str, Iterable[str]] = None,
        executable: Optional[str] = None, np: Optional[int] = None,
        min_np: Optional[int] = None, max_np: Optional[int] = None) -> list[Any]:
    """Run `func(*args, **kwargs)` on `num_proc` ranks and return their results, by rank.

    Same signature as `horovod.run` (`np`, `min_np`, `max_np` are its deprecated aliases).
    `hosts="a:2,b:2"` runs ranks on other hosts over ssh (`ssh_port`, `ssh_identity_file`).
    With `min_num_proc` or `host_discovery_script` the job is elastic (`max_num_proc` caps
    it): `func` should train through `hvd.elastic.run`, and the result is the list of values
    returned by the workers of the last round. Raises ValueError for bad arguments and RuntimeError naming the
    rank, with the remote traceback, when a rank raises or dies.
    """
    import cloudpickle

    from hvdlite.runner.driver import JobSpec, Rendezvous, exit_description, run_job
    from hvdlite.runner.hosts import assign_slots
    from hvdlite.runner.local import LaunchError, SSHSettings
    from hvdlite.runner.run_task import FUNC_KEY, result_key

    hargs = build_parser().parse_args([])
    hargs.num_proc = num_proc if num_proc is not None else np
    hargs.min_num_proc = min_num_proc if min_num_proc is not None else min_np
    hargs.max_num_proc = max_num_proc if max_num_proc is not None else max_np
    # Elastic as horovod.run decides it: a minimum or a discovery script (launch.check_args).
    elastic = hargs.min_num_proc is not None or host_discovery_script is not None
    if hargs.num_proc is None and not elastic:
        hargs.num_proc = 1  # horovod.run's default
    hargs.slots = slots
    hargs.elastic_timeout = None
    hargs.reset_limit = reset_limit
    hargs.cooldown_range = list(cooldown_range) if cooldown_range is not None else None
    hargs.hosts = hosts
    hargs.hostfile = hostfile
    hargs.host_discovery_script = host_discovery_script
    hargs.start_timeout = start_timeout
    hargs.ssh_port = ssh_port
    hargs.ssh_identity_file = ssh_identity_file
    hargs.disable_cache = bool(disable_cache)
    hargs.output_filename = output_filename
    hargs.verbose = bool(verbose)
    hargs.use_gloo = bool(use_gloo)
    hargs.use_mpi = bool(use_mpi)
    hargs.mpi_args = mpi_args
    hargs.nics = _nic_list(network_interfaces, network_interface)
    try:
        check_args(hargs, need_command=False)
    except UsageError as e:
        raise ValueError(_api_message(str(e))) from None
    if hargs.use_mpi:
        if hargs.elastic:
            raise ValueError("use_mpi cannot run elastic jobs (Horovod's elastic mode needs "
                             "gloo); drop use_mpi or min_num_proc/host_discovery_script")
        unused = [name for name, value in (
            ("ssh_port", ssh_port), ("ssh_identity_file", ssh_identity_file),
            ("network_interface(s)", hargs.nics), ("output_filename", output_filename))
            if value]
        if unused:
            raise ValueError(f"{', '.join(unused)} cannot be used with use_mpi=True: mpiexec "
                             f"starts the ranks (pass its own options in mpi_args), or drop "
                             f"use_mpi")

    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    env = dict(os.environ)
    env.update(tuning_env(hargs))
    command = [executable or sys.executable, "-m", "hvdlite.runner.run_task"]
    if hargs.elastic:
        return _run_elastic(hargs, command, env, payload)
    if hargs.use_mpi:
        return _run_mpi(hargs, command, env, payload)

    slots_info = assign_slots(hargs.host_list, hargs.num_proc)
    spec = JobSpec(command=command, slots=slots_info, env=env,
                   start_timeout=hargs.start_timeout, nics=hargs.nics,
                   output_filename=output_filename, verbose=hargs.verbose, name=_API_NAME,
                   ssh=SSHSettings(ssh_port, ssh_identity_file, hargs.start_timeout))
    rendezvous = Rendezvous([s.hostname for s in slots_info], hargs.start_timeout, hargs.nics)
    rendezvous.put_signed(FUNC_KEY, payload)
    try:
        result = run_job(spec, rendezvous)
    except LaunchError as e:
        raise ValueError(str(e)) from None

    def outcome(rank: int) -> Optional[tuple[str, Any]]:
        data = rendezvous.get_signed(result_key(rank))
        return None if data is None else cloudpickle.loads(data)

    if result.interrupted_by is not None:
        if result.interrupted_by == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(result.exit_code)
    if result.exit_code != 0:
        failed = result.failed_rank if result.failed_rank is not None else 0
        ranks = [failed] + [r for r in range(hargs.num_proc) if r != failed]
        for rank in ranks:
            got = outcome(rank)
            if got is not None and got[0] == "error":
                raise RuntimeError(f"rank {rank} raised an exception:\n{got[1]}")
        code = result.returncodes.get(failed)
        how = exit_description(code) if code is not None else "could not be started"
        raise RuntimeError(f"rank {failed} {how} before returning a result")
    values: list[Any] = []
    for rank in range(hargs.num_proc):
        got = outcome(rank)
        if got is None:
            raise RuntimeError(f"rank {rank} exited with code 0 without returning a result")
        values.append(got[1])
    return values


def _run_mpi(hargs: Any, command: list[str], env: dict[str, str], payload: bytes) -> list[Any]:
    """use_mpi=True: the ranks start under mpiexec, as with `hvdlite-run --mpi`, and run their
    collectives on MPI; they reach the driver's store only to fetch `func` and to hand back
    its result (run_task.py)."""
    import cloudpickle

    from hvdlite.runner.driver import Rendezvous
    from hvdlite.runner.mpi_run import MPILaunchError, run_mpi
    from hvdlite.runner.run_task import FUNC_KEY, result_key
    from hvdlite.runner.secret import SECRET_ENV
    from hvdlite.runner.worker_env import COORDINATES

    hosts = [h.name for h in hargs.host_list]
    rendezvous = Rendezvous(hosts, hargs.start_timeout, hargs.nics)
    rendezvous.put_signed(FUNC_KEY, payload)
    # One environment for every rank (mpiexec passes it on): the address the first host
    # reaches the driver at (127.0.0.1 where every host is this machine).
    env = dict(env)
    for name in COORDINATES:          # the ranks' coordinates are MPI's, not a caller's
        env.pop(f"HVDLITE_{name}", None)
        env.pop(f"HOROVOD_{name}", None)
    env["HVDLITE_STORE_ADDR"] = rendezvous.addr_for(hosts[0])
    env["HVDLITE_STORE_PORT"] = str(rendezvous.port)
    env["HVDLITE_START_TIMEOUT"] = str(hargs.start_timeout)
    env[SECRET_ENV] = rendezvous.key.hex()
    mpi_args = " ".join(a for a in (getattr(hargs, "binding_args", None), hargs.mpi_args)
                        if a) or None
    try:
        code = run_mpi(hargs.num_proc, hargs.host_list, command, env, mpi_args,
                       verbose=hargs.verbose)
    except MPILaunchError as e:
        raise ValueError(str(e)) from None

    outcomes = []
    for rank in range(hargs.num_proc):
        data = rendezvous.get_signed(result_key(rank))
        outcomes.append(None if data is None else cloudpickle.loads(data))
    for rank, got in enumerate(outcomes):
        if got is not None and got[0] == "error":
            raise RuntimeError(f"rank {rank} raised an exception:\n{got[1]}")
    missing = [rank for rank, got in enumerate(outcomes) if got is None]
    if missing or code != 0:
        raise RuntimeError(f"rank {missing[0] if missing else 0} exited before returning a "
                           f"result (mpiexec exited with code {code}; see its output above)")
    return [got[1] for got in outcomes]


def _run_elastic(hargs: Any, command: list[str], env: dict[str, str], payload: bytes) -> list[Any]:
    import cloudpickle

    from hvdlite.runner.driver import Rendezvous
    from hvdlite.runner.elastic_driver import run_elastic
    from hvdlite.runner.hosts import is_local_host
    from hvdlite.runner.launch import elastic_spec
    from hvdlite.runner.local import LaunchError
    from hvdlite.runner.run_task import FUNC_KEY, result_key

    spec = elastic_spec(hargs, command, env, name=_API_NAME)
    all_local = hargs.host_list is not None and all(is_local_host(h.name)
                                                    for h in hargs.host_list)
    rendezvous = Rendezvous([], hargs.start_timeout, hargs.nics, all_interfaces=not all_local)
    rendezvous.put_signed(FUNC_KEY, payload)
    try:
        result = run_elastic(spec, rendezvous=rendezvous)
    except LaunchError as e:
        raise ValueError(str(e)) from None
    if result.interrupted_by is not None:
        if result.interrupted_by == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(result.exit_code)

    def outcome(worker_id: str) -> Optional[tuple[str, Any]]:
        data = rendezvous.get_signed(result_key(worker_id))
        return None if data is None else cloudpickle.loads(data)

    if result.exit_code != 0:
        for worker_id in sorted(result.final_ranks, key=result.final_ranks.get):
            got = outcome(worker_id)
            if got is not None and got[0] == "error":
                raise RuntimeError(f"worker {worker_id} raised an exception:\n{got[1]}")
        raise RuntimeError(f"the elastic job failed: {result.message or 'see the output above'}")
    values = []
    for worker_id in sorted(result.final_ranks, key=result.final_ranks.get):
        got = outcome(worker_id)
        if got is None:
            raise RuntimeError(f"worker {worker_id} exited with code 0 without returning a "
                               f"result")
        if got[0] == "error":
            raise RuntimeError(f"worker {worker_id} raised an exception:\n{got[1]}")
        values.append(got[1])
    return values
