"""`hvdlite-run`: horovodrun's command line, on hvdlite's driver.

Every horovodrun 0.28 flag is accepted so that existing launch scripts work unchanged. Hosts
that are this machine start locally, others over ssh (-p/-i); `--min-np`, `--max-np` or
`--host-discovery-script` select elastic mode (elastic_driver.py). Flags for parts that hvdlite
does not provide (--jsrun) are parsed and validated, then refused with a clear message
instead of being silently ignored.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from typing import Any, Mapping, Optional, Sequence

from hvdlite.common import config
from hvdlite.runner.config_file import ConfigError, apply_config, load_config
from hvdlite.runner.env_flags import (LOG_LEVELS, elastic_timeout_s, start_timeout_from_env,
                                      tuning_env)
from hvdlite.runner.hosts import (HostError, HostSpec, assign_slots, is_local_host,
                                  parse_hostfile, parse_hosts, too_few_slots_message,
                                  total_slots)

PROG = "hvdlite-run"


class UsageError(ValueError):
    """Arguments that cannot work together; the message names the flag."""


def version() -> str:
    try:
        from hvdlite import __version__
        return str(__version__)
    except ImportError:
        from importlib.metadata import version as dist_version
        return dist_version("hvdlite")


class _NicAction(argparse.Action):
    """--network-interfaces a,b / --network-interface a (repeatable): one ordered, unique list."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("metavar", "NIC[,NIC...]")
        super().__init__(option_strings, dest, nargs=None, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        current = getattr(namespace, self.dest, None)
        nics = list(current) if isinstance(current, list) else []
        for nic in str(values).split(","):
            nic = nic.strip()
            if nic and nic not in nics:
                nics.append(nic)
        if not nics:
            parser.error(f"argument {option_string}: no interface name given")
        setattr(namespace, self.dest, nics)


def _bool_pair(group: Any, name: str, dest: str, help_on: str, hide_off: bool = False) -> None:
    """`--X` / `--no-X` storing True/False in `dest` (None when neither is given)."""
    pair = group.add_mutually_exclusive_group()
    pair.add_argument(f"--{name}", dest=dest, action="store_const", const=True, default=None,
                      help=help_on)
    pair.add_argument(f"--no-{name}", dest=dest, action="store_const", const=False, default=None,
                      help=argparse.SUPPRESS if hide_off else
                      f"Explicitly disable --{name} (pins it against autotuning).")


def build_parser() -> argparse.ArgumentParser:
    """horovodrun 0.28's flags, grouped the same way."""
    p = argparse.ArgumentParser(
        prog=PROG, description="hvdlite runner (horovodrun-compatible)",
        usage=f"{PROG} -np N [-H host1:2,host2:2 | -hostfile FILE] [options] command [args ...]")
    p.add_argument("-v", "--version", action="version", version=f"{PROG} {version()}",
                   help="Show hvdlite's version and exit.")
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N",
                   help="Total number of training processes (required unless elastic).")
    p.add_argument("-cb", "--check-build", dest="check_build", action="store_true",
                   help="Show which frameworks, controllers and tensor operations are available.")
    p.add_argument("--disable-cache", dest="disable_cache", action="store_true",
                   help="Do not cache host checks (accepted for compatibility).")
    p.add_argument("--start-timeout", dest="start_timeout", type=int, metavar="SECONDS",
                   help="Seconds for workers to start and meet (default 30, or "
                        "HVDLITE_START_TIMEOUT / HOROVOD_START_TIMEOUT).")
    p.add_argument("--network-interfaces", dest="nics", action=_NicAction,
                   help='Network interfaces to use, comma separated, e.g. "eth0,eth1".')
    p.add_argument("--network-interface", dest="nics", action=_NicAction,
                   help="Deprecated: one interface; may be repeated.")
    p.add_argument("--output-filename", dest="output_filename", metavar="DIR",
                   help="Also write each rank's output to DIR/rank.<N>/{stdout,stderr}.")
    p.add_argument("--verbose", dest="verbose", action="store_true",
                   help="Print what the launcher does.")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="Print the detected environment (SLURM allocation, hostfile), the hosts, "
                        "the ranks per host and the exact commands that would run, then exit.")
    p.add_argument("--config-file", dest="config_file", metavar="YAML",
                   help="YAML file with tuning parameters; command-line flags win over it.")
    p.add_argument("command", nargs=argparse.REMAINDER, help="Command to run on every rank.")

    ssh = p.add_argument_group("SSH arguments")
    ssh.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, help="SSH port on all hosts.")
    ssh.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file",
                     help="Private key file for SSH.")

    params = p.add_argument_group("tuneable parameter arguments")
    params.add_argument("--fusion-threshold-mb", dest="fusion_threshold_mb", type=int,
                        help="Fusion buffer size in MB; 0 disables fusion (default 128).")
    params.add_argument("--cycle-time-ms", dest="cycle_time_ms", type=float,
                        help="Delay between fusion cycles in ms (default 1).")
    params.add_argument("--cache-capacity", dest="cache_capacity", type=int,
                        help="Response cache entries; 0 disables the cache (default 1024).")
    _bool_pair(params, "hierarchical-allreduce", "hierarchical_allreduce",
               "Hierarchical allreduce: reduce within each host, allreduce across hosts, "
               "broadcast within each host (HOROVOD_HIERARCHICAL_ALLREDUCE=1).")
    _bool_pair(params, "hierarchical-allgather", "hierarchical_allgather",
               "Not supported by hvdlite (allgather is flat); refused.")
    _bool_pair(params, "torus-allreduce", "torus_allreduce",
               "Not supported by hvdlite; refused (use --hierarchical-allreduce).")

    autotune = p.add_argument_group("autotune arguments")
    _bool_pair(autotune, "autotune", "autotune",
               "Autotune the parameters above that are not set explicitly.", hide_off=True)
    autotune.add_argument("--autotune-log-file", dest="autotune_log_file",
                          help="CSV log of autotune trials.")
    autotune.add_argument("--autotune-warmup-samples", dest="autotune_warmup_samples", type=int,
                          help="Samples discarded before tuning (default 3).")
    autotune.add_argument("--autotune-steps-per-sample", dest="autotune_steps_per_sample",
                          type=int, help="Steps per autotune sample (default 10).")
    autotune.add_argument("--autotune-bayes-opt-max-samples",
                          dest="autotune_bayes_opt_max_samples", type=int,
                          help="Samples per Bayesian optimisation (default 20).")
    autotune.add_argument("--autotune-gaussian-process-noise",
                          dest="autotune_gaussian_process_noise", type=float,
                          help="Noise regularisation in [0, 1] (default 0.8).")

    elastic = p.add_argument_group("elastic arguments")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", type=int,
                         help="Minimum number of processes (elastic).")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", type=int,
                         help="Maximum number of processes (elastic).")
    elastic.add_argument("--slots-per-host", dest="slots", type=int,
                         help="Slots per host when discovery does not say.")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=int,
                         help="Seconds to wait for enough hosts after a reset (default 600).")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=int,
                         help="Maximum number of resets before the job fails.")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=int, nargs=2,
                         metavar=("MIN", "MAX"),
                         help="Seconds range a failing host stays blacklisted.")

    timeline = p.add_argument_group("timeline arguments")
    timeline.add_argument("--timeline-filename", dest="timeline_filename",
                          help="Write a Chrome-trace timeline to this file.")
    _bool_pair(timeline, "timeline-mark-cycles", "timeline_mark_cycles",
               "Mark cycles on the timeline.", hide_off=True)

    stall = p.add_argument_group("stall check arguments")
    stall_pair = stall.add_mutually_exclusive_group()
    stall_pair.add_argument("--no-stall-check", dest="no_stall_check", action="store_const",
                            const=True, default=None, help="Disable the stall check.")
    stall_pair.add_argument("--stall-check", dest="no_stall_check", action="store_const",
                            const=False, default=None, help=argparse.SUPPRESS)
    stall.add_argument("--stall-check-warning-time-seconds",
                       dest="stall_check_warning_time_seconds", type=int,
                       help="Seconds before a stall warning (default 60).")
    stall.add_argument("--stall-check-shutdown-time-seconds",
                       dest="stall_check_shutdown_time_seconds", type=int,
                       help="Seconds of stall before the job is shut down.")
    stall.add_argument("--straggler-report", dest="straggler_report", type=float,
                       metavar="SECONDS",
                       help="Every SECONDS, print each rank's time to submit the same tensors "
                            "relative to the median rank (HVDLITE_STRAGGLER_REPORT).")

    lib = p.add_argument_group("library arguments")
    _bool_pair(lib, "mpi-threads-disable", "mpi_threads_disable",
               "Do not request MPI_THREAD_MULTIPLE.", hide_off=True)
    lib.add_argument("--mpi-args", dest="mpi_args", help="Extra arguments for mpirun.")
    lib.add_argument("--tcp", dest="tcp_flag", action="store_true",
                     help="Use TCP only (sets NCCL_IB_DISABLE=1).")
    lib.add_argument("--binding-args", dest="binding_args",
                     help="Process binding arguments for mpiexec (with --mpi only).")
    lib.add_argument("--num-nccl-streams", dest="num_nccl_streams", type=int,
                     help="Number of NCCL streams: hvdlite uses one; other values are refused.")
    lib.add_argument("--thread-affinity", dest="thread_affinity", metavar="CORE[,CORE...]",
                     help="Not supported by hvdlite; refused (pin ranks with taskset/numactl).")
    lib.add_argument("--gloo-timeout-seconds", dest="gloo_timeout_seconds", type=int,
                     help="Timeout of Gloo operations (default 30).")

    log = p.add_argument_group("logging arguments")
    log.add_argument("--log-level", dest="log_level", type=str.upper, choices=LOG_LEVELS,
                     help="Minimum level of hvdlite's log records (default WARNING; sets "
                          "HOROVOD_LOG_LEVEL).")
    log_pair = log.add_mutually_exclusive_group()
    log_pair.add_argument("--log-with-timestamp", dest="log_with_timestamp",
                          action="store_const", const=True, default=None,
                          help="Show the time in hvdlite's log records (the default; sets "
                               "HOROVOD_LOG_HIDE_TIME=0).")
    log_pair.add_argument("--log-without-timestamp", "--log-hide-timestamp",
                          dest="log_with_timestamp", action="store_const", const=False,
                          default=None, help="Hide the time in hvdlite's log records (sets "
                                             "HOROVOD_LOG_HIDE_TIME=1).")
    log_pair.add_argument("--no-log-hide-timestamp", dest="log_with_timestamp",
                          action="store_const", const=True, default=None,
                          help=argparse.SUPPRESS)        # (horovodrun's deprecated alias)
    log.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                     dest="prefix_output_with_timestamp", action="store_true",
                     help="Prefix every forwarded output line with a timestamp.")

    hosts = p.add_argument_group("host arguments").add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS[,...]",
                       help="Hosts and slots, e.g. host1:2,host2:4 (default localhost:<np>).")
    hosts.add_argument("-hostfile", "--hostfile", dest="hostfile",
                       help="File with one '<host> slots=<n>' (the MPI runtime's, e.g. "
                            "/etc/mpi/hostfile) or '<host>:<n>' per line. Without -H or "
                            "--hostfile: inside a SLURM allocation its nodes, started by srun; "
                            "with OMPI_MCA_orte_default_hostfile set (Kubeflow's MPIJob), that "
                            "file.")
    hosts.add_argument("--host-discovery-script", dest="host_discovery_script",
                       help="Script printing available hosts (enables elastic mode).")

    ctl = p.add_argument_group("controller arguments").add_mutually_exclusive_group()
    ctl.add_argument("--gloo", dest="use_gloo", action="store_true", help="Gloo controller.")
    ctl.add_argument("--mpi", dest="use_mpi", action="store_true", help="MPI controller.")
    ctl.add_argument("--jsrun", dest="use_jsrun", action="store_true", help="LSF jsrun launcher.")
    return p


# (dest, kind, minimum, maximum): checked after the config file is merged, so values from either
# source get the same errors.
_NUMBERS: tuple[tuple[str, type, float, Optional[float]], ...] = (
    ("num_proc", int, 1, None), ("min_num_proc", int, 1, None), ("max_num_proc", int, 1, None),
    ("slots", int, 1, None), ("start_timeout", int, 1, None), ("ssh_port", int, 1, 65535),
    ("fusion_threshold_mb", int, 0, None), ("cycle_time_ms", float, 0, None),
    ("cache_capacity", int, 0, None), ("autotune_warmup_samples", int, 0, None),
    ("autotune_steps_per_sample", int, 0, None), ("autotune_bayes_opt_max_samples", int, 0, None),
    ("autotune_gaussian_process_noise", float, 0, 1),
    ("stall_check_warning_time_seconds", int, 0, None),
    ("stall_check_shutdown_time_seconds", int, 0, None), ("num_nccl_streams", int, 1, None),
    ("straggler_report", float, 0, None),
    ("gloo_timeout_seconds", int, 1, None), ("elastic_timeout", int, 0, None),
    ("reset_limit", int, 0, None), ("ccl_bgt_affinity", int, 0, None),
)
_BOOLS = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "autotune",
          "timeline_mark_cycles", "no_stall_check", "mpi_threads_disable", "log_with_timestamp")
_STRINGS = ("autotune_log_file", "timeline_filename")

_FLAG_NAMES = {"ccl_bgt_affinity": "library_options.ccl_bgt_affinity"}


def _flag(dest: str) -> str:
    """The option strings a user typed for `dest`, for error messages."""
    if dest not in _FLAG_NAMES:
        for action in build_parser()._actions:
            if action.dest == dest and action.option_strings:
                _FLAG_NAMES[dest] = "/".join(action.option_strings)
                break
        else:
            _FLAG_NAMES[dest] = dest
    return _FLAG_NAMES[dest]


def _refuse_unsupported(args: argparse.Namespace) -> None:
    """horovodrun flags for parts hvdlite does not have: one clear line instead of a flag that
    is accepted and silently does nothing (the config file's keys land here too)."""
    refused = (
        ("hierarchical_allgather", args.hierarchical_allgather is True,
         "not supported by hvdlite (its allgather is flat); drop the flag"),
        ("torus_allreduce", args.torus_allreduce is True,
         "not supported by hvdlite; use --hierarchical-allreduce"),
        ("num_nccl_streams", args.num_nccl_streams not in (None, 1),
         "not supported by hvdlite: its NCCL transport uses one stream (use 1 or drop the flag)"),
        ("thread_affinity", args.thread_affinity is not None,
         "not supported by hvdlite (its background thread is not pinned); pin whole ranks "
         "with taskset or numactl instead"),
        ("binding_args", args.binding_args is not None and not args.use_mpi,
         "only applies to --mpi (mpiexec binds processes; the gloo launcher does not)"),
    )
    for dest, given, why in refused:
        if given:
            raise UsageError(f"argument {_flag(dest)}: {why}")


def _source(args: argparse.Namespace, dest: str) -> str:
    """Where `dest`'s value came from, for an error message: "argument --flag", or for a value
    read from --config-file the file and key (config_file.apply_config records them), so that
    a bad value in the file is not blamed on a flag nobody typed."""
    key = (getattr(args, "config_sources", None) or {}).get(dest)
    if key is not None:
        return f"config file {args.config_file}: {key} ({_flag(dest)})"
    return f"argument {_flag(dest)}"


def _check_values(args: argparse.Namespace) -> None:
    for dest, kind, low, high in _NUMBERS:
        value = getattr(args, dest, None)
        if value is None:
            continue
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if kind is int and not number.is_integer():
                raise ValueError
        except (TypeError, ValueError):
            expected = "an integer" if kind is int else "a number"
            raise UsageError(f"{_source(args, dest)}: expected {expected}, "
                             f"got {value!r}") from None
        value = int(number) if kind is int else number
        setattr(args, dest, value)
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise UsageError(f"{_source(args, dest)}: must be {bound}, got {value}")
    for dest in _BOOLS:
        value = getattr(args, dest, None)
        if value is not None and not isinstance(value, bool):
            raise UsageError(f"{_source(args, dest)}: expected true or false, got {value!r}")
    for dest in _STRINGS:
        value = getattr(args, dest, None)
        if value is not None and (not isinstance(value, str) or not value):
            raise UsageError(f"{_source(args, dest)}: expected a file name, got {value!r}")
    if args.log_level is not None:
        level = str(args.log_level).upper()
        if level not in LOG_LEVELS:
            raise UsageError(f"{_source(args, 'log_level')}: invalid choice {args.log_level!r} "
                             f"(choose from {', '.join(LOG_LEVELS)})")
        args.log_level = level
    if args.thread_affinity is not None:
        text = str(args.thread_affinity).replace(" ", "")
        if not re.fullmatch(r"\d+(,\d+)*", text):
            raise UsageError(f"{_source(args, 'thread_affinity')}: expected a core id or a "
                             f"comma-separated list of core ids, got {args.thread_affinity!r}")
        args.thread_affinity = text
    if args.cooldown_range is not None:
        low, high = args.cooldown_range
        if low < 0 or high < low:
            raise UsageError("argument --blacklist-cooldown-range: expected 0 <= MIN <= MAX, "
                             f"got {low} {high}")
    _refuse_unsupported(args)
    if args.stall_check_shutdown_time_seconds and args.stall_check_warning_time_seconds and \
            args.stall_check_shutdown_time_seconds <= args.stall_check_warning_time_seconds:
        raise UsageError("argument --stall-check-shutdown-time-seconds: must be larger than "
                         "--stall-check-warning-time-seconds")


def _check_nics(args: argparse.Namespace) -> None:
    """--network-interface(s) must name interfaces this machine has, where every host is this
    machine (other hosts' interfaces are theirs to have); UsageError otherwise.

    Why: gloo failed inside the first collective on every rank ("[enforce fail at ...
    device.cc:84] ifa != nullptr. Unable to find address for: bogus0"), and a job with no
    collectives succeeded; horovodrun checks the names before it starts anything."""
    if not args.nics or not args.host_list or \
            not all(is_local_host(h.name) for h in args.host_list):
        return
    try:
        have = [name for _, name in socket.if_nameindex()]
    except OSError:                  # (no interface table to read: gloo will say)
        return
    missing = [n for n in args.nics if n not in have]
    if missing:
        raise UsageError(f"argument --network-interfaces: this machine has no interface "
                         f"{', '.join(missing)}; it has {', '.join(have)}")


def check_args(args: argparse.Namespace, need_command: bool = True,
               environ: Optional[Mapping[str, str]] = None) -> None:
    """Validate parsed arguments and resolve hosts; raises UsageError. Sets `args.elastic`,
    `args.host_list` and the effective `args.start_timeout`."""
    environ = os.environ if environ is None else environ
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    _check_values(args)
    # Elastic as horovodrun decides it (launch.py's _is_elastic): a minimum or a discovery
    # script. (--max-np alone made the job elastic and gave localhost max(-np, --max-np)
    # slots, so `-np 2 --max-np 4` started 4 ranks.)
    args.elastic = args.min_num_proc is not None or args.host_discovery_script is not None
    args.host_list = None
    if args.check_build:
        return
    given = [f for f, v in (("-H/--hosts", args.hosts), ("-hostfile/--hostfile", args.hostfile),
                            ("--host-discovery-script", args.host_discovery_script)) if v]
    if len(given) > 1:
        raise UsageError(f"argument {given[1]}: not allowed with argument {given[0]}")
    controllers = [f for f, v in (("--gloo", args.use_gloo), ("--mpi", args.use_mpi),
                                  ("--jsrun", args.use_jsrun)) if v]
    if len(controllers) > 1:
        raise UsageError(f"argument {controllers[1]}: not allowed with argument {controllers[0]}")
    if args.start_timeout is None:
        try:
            args.start_timeout = start_timeout_from_env(environ)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.start_timeout < 1:
            raise UsageError(f"start timeout must be >= 1 second, got {args.start_timeout}")
    if not args.elastic and args.num_proc is None:
        raise UsageError("argument -np/--num-proc is required")
    if args.min_num_proc is not None and args.max_num_proc is not None and \
            args.min_num_proc > args.max_num_proc:
        raise UsageError(f"argument --min-np/--min-num-proc: {args.min_num_proc} is larger than "
                         f"--max-np {args.max_num_proc}")
    if args.elastic and args.num_proc is not None:
        if args.min_num_proc is not None and args.num_proc < args.min_num_proc:
            raise UsageError(f"argument -np/--num-proc: {args.num_proc} is smaller than "
                             f"--min-np {args.min_num_proc}")
        if args.max_num_proc is not None and args.num_proc > args.max_num_proc:
            raise UsageError(f"argument -np/--num-proc: {args.num_proc} is larger than "
                             f"--max-np {args.max_num_proc}")
    args.slurm = None
    args.host_source = None
    try:
        if not args.hosts and not args.hostfile and not args.host_discovery_script:
            _hosts_from_environment(args, environ)
        if args.hosts:
            args.host_list = parse_hosts(args.hosts)
            args.host_source = "-H/--hosts"
        elif args.hostfile:
            args.host_list = parse_hostfile(args.hostfile)
            args.host_source = args.host_source or f"hostfile {args.hostfile}"
        elif args.slurm is not None:
            args.host_list = list(args.slurm.hosts)
        elif args.num_proc is not None and not args.host_discovery_script:
            args.host_list = [HostSpec("localhost", max(args.num_proc, args.max_num_proc or 0)
                                       if args.elastic else args.num_proc)]
        elif not args.host_discovery_script:  # elastic, -np not given: localhost, enough slots
            args.host_list = [HostSpec("localhost",
                                       max(args.min_num_proc or 1, args.max_num_proc or 1))]
    except HostError as e:
        raise UsageError(str(e)) from None
    if not args.elastic and args.num_proc > total_slots(args.host_list):
        where = f" ({args.slurm.describe()})" if args.slurm is not None else ""
        raise UsageError(too_few_slots_message(args.num_proc, args.host_list) + where)
    if args.elastic and not args.host_discovery_script:
        # Fixed hosts never gain slots: waiting for more (horovodrun waits --elastic-timeout,
        # 600 s, then fails) cannot help.
        start_np = args.num_proc or args.min_num_proc or 1
        if start_np > total_slots(args.host_list):
            raise UsageError(
                too_few_slots_message(start_np, args.host_list).replace(
                    "-np", "-np" if args.num_proc else "--min-np", 1)
                + "; an elastic job on a fixed host list (-H/--hostfile) cannot gain hosts, so "
                  "give more slots, a smaller -np/--min-np, or a --host-discovery-script")
    _check_nics(args)
    if need_command and not args.command:
        raise UsageError(f"no command given: {PROG} -np N [options] command [args ...]")


# Set by Kubeflow's MPI runtime (MPIJob) in the launcher pod: the workers, `host slots=N`.
MPI_HOSTFILE_ENV = "OMPI_MCA_orte_default_hostfile"


def _hosts_from_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Hosts where neither -H nor --hostfile says: a SLURM allocation's nodes (fixed jobs,
    not --mpi: mpirun reads the allocation itself), else the MPI runtime's hostfile."""
    from hvdlite.runner.slurm import allocation

    if not args.elastic and not args.use_mpi and not args.check_build:
        args.slurm = allocation(environ)
        if args.slurm is not None:
            args.host_source = args.slurm.describe()
            return
    mpi_hostfile = environ.get(MPI_HOSTFILE_ENV)
    if mpi_hostfile:
        args.hostfile = mpi_hostfile
        args.host_source = f"hostfile {mpi_hostfile} ({MPI_HOSTFILE_ENV})"


_UNSET = object()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate horovodrun-style arguments; exits with status 2 and an argparse-style
    message naming the flag on any error (and 0 for --help/--version)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    dests = {a.dest: a.default for a in parser._actions if a.dest != argparse.SUPPRESS}
    # Pre-filled sentinels tell which flags were typed: those win over the config file.
    args = argparse.Namespace(**{d: _UNSET for d in dests})
    parser.parse_args(argv, namespace=args)
    explicit = {d for d in dests if getattr(args, d) is not _UNSET}
    for d, default in dests.items():
        if getattr(args, d) is _UNSET:
            setattr(args, d, default)
    try:
        if args.config_file:
            apply_config(args, load_config(args.config_file), explicit, args.config_file)
        check_args(args)
    except (UsageError, ConfigError) as e:
        parser.error(str(e))
    return args


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    return code


def _check_command(program: str, hosts: Sequence[str]) -> Optional[int]:
    """Refuse a command that does not exist here (when a rank runs here); remote hosts check
    their own PATH when the rank starts (exit 127 naming the host)."""
    from hvdlite.runner.local import find_command

    if hosts and not any(is_local_host(h) for h in hosts):
        return None
    if find_command(program) is None:
        if os.sep in program and os.path.exists(program):
            return _fail(f"command {program!r} is not an executable file", 126)
        return _fail(f"command {program!r} not found", 127)
    return None


def elastic_spec(args: argparse.Namespace, command: list[str], env: dict[str, str],
                 name: str = PROG):
    """The elastic driver's job description from validated arguments."""
    from hvdlite.runner.discovery import FixedHosts, HostDiscoveryScript
    from hvdlite.runner.elastic_driver import ElasticSpec
    from hvdlite.runner.local import SSHSettings

    num_proc = args.num_proc or args.min_num_proc or 1
    min_np = args.min_num_proc or num_proc
    if args.host_discovery_script:
        discovery = HostDiscoveryScript(args.host_discovery_script, args.slots,
                                        max(10, args.start_timeout))
    else:
        discovery = FixedHosts(args.host_list)
    return ElasticSpec(
        command=command, env=env, discovery=discovery, num_proc=num_proc, min_np=min_np,
        max_np=args.max_num_proc, start_timeout=args.start_timeout,
        elastic_timeout=elastic_timeout_s(args.elastic_timeout, env),
        reset_limit=args.reset_limit,
        cooldown_range=tuple(args.cooldown_range) if args.cooldown_range else None,
        nics=args.nics, output_filename=args.output_filename,
        prefix_timestamp=bool(getattr(args, "prefix_output_with_timestamp", False)),
        verbose=bool(args.verbose), name=name,
        ssh=SSHSettings(args.ssh_port, args.ssh_identity_file, args.start_timeout))


def launch(args: argparse.Namespace) -> int:
    """Run the job described by validated `args`; returns the launcher's exit code."""
    from hvdlite.runner.driver import JobSpec, Rendezvous, run_job
    from hvdlite.runner.elastic_driver import run_elastic
    from hvdlite.runner.local import LaunchError, SSHSettings

    if getattr(args, "dry_run", False):
        from hvdlite.runner.plan import plan_text

        print(plan_text(args), end="", flush=True)
        return 0
    if args.use_mpi:
        return _launch_mpi(args)
    if args.use_jsrun:
        return _fail("--jsrun is not available yet; use --gloo (the default)", 2)
    env = dict(os.environ)
    env.update(tuning_env(args))
    if getattr(args, "slurm", None) is not None:
        return _launch_srun(args, env)
    if args.elastic:
        if args.host_list is not None:
            failed = _check_command(args.command[0], [h.name for h in args.host_list])
            if failed is not None:
                return failed
        try:
            return run_elastic(elastic_spec(args, list(args.command), env)).exit_code
        except LaunchError as e:
            return _fail(str(e), 2)
    slots = assign_slots(args.host_list, args.num_proc)
    failed = _check_command(args.command[0], [s.hostname for s in slots])
    if failed is not None:
        return failed
    spec = JobSpec(command=list(args.command), slots=slots, env=env,
                   start_timeout=args.start_timeout, nics=args.nics,
                   output_filename=args.output_filename,
                   prefix_timestamp=args.prefix_output_with_timestamp, verbose=args.verbose,
                   name=PROG,
                   ssh=SSHSettings(args.ssh_port, args.ssh_identity_file, args.start_timeout))
    try:
        # A local rank 0 serves the store on the driver's socket: no torch in the launcher.
        # Otherwise the launcher serves it, importing torch in a thread while the ranks start.
        rank0_local = is_local_host(next(s.hostname for s in slots if s.rank == 0))
        on_driver = not rank0_local or config.truthy(config.raw("HVDLITE_STORE_ON_DRIVER"))
        rendezvous = Rendezvous([s.hostname for s in slots], args.start_timeout, args.nics,
                                serve=on_driver, background=True)
        return run_job(spec, rendezvous).exit_code
    except LaunchError as e:
        return _fail(str(e), 2)


def _launch_srun(args: argparse.Namespace, env: dict) -> int:
    """Inside a SLURM allocation: the ranks start as the tasks of one srun step."""
    from hvdlite.runner.slurm import run_srun, srun_command, srun_env

    unused = [flag for flag, value in (
        ("-p/--ssh-port", args.ssh_port), ("-i/--ssh-identity-file", args.ssh_identity_file),
        ("--output-filename", args.output_filename)) if value]
    if unused:
        return _fail(f"{', '.join(unused)} cannot be used inside a SLURM allocation: srun starts "
                     f"the ranks (give -H to start them over ssh instead)", 2)
    return run_srun(srun_command(args.slurm, args.num_proc, list(args.command)),
                    srun_env(args.slurm, env, args.start_timeout), verbose=bool(args.verbose))


def _launch_mpi(args: argparse.Namespace) -> int:
    """--mpi: the ranks start under mpiexec and run their collectives on MPI."""
    from hvdlite.runner.mpi_run import MPILaunchError, run_mpi

    if args.elastic:
        return _fail("--mpi cannot run elastic jobs (Horovod's elastic mode needs gloo too); "
                     "drop --mpi or the elastic flags", 2)
    # What mpiexec starts is mpiexec's: these would be silently ignored (horovodrun hands
    # them to mpirun's own options), so they are refused, as every unsupported flag is.
    unused = [flag for flag, value in (
        ("-p/--ssh-port", args.ssh_port), ("-i/--ssh-identity-file", args.ssh_identity_file),
        ("--network-interfaces", args.nics), ("--output-filename", args.output_filename),
        ("--prefix-output-with-timestamp", args.prefix_output_with_timestamp)) if value]
    if unused:
        return _fail(f"{', '.join(unused)} cannot be used with --mpi: mpiexec starts the ranks "
                     f"(pass its own options with --mpi-args), or drop --mpi", 2)
    failed = _check_command(args.command[0], [h.name for h in args.host_list or []])
    if failed is not None:
        return failed
    env = dict(os.environ)
    env.update(tuning_env(args))
    try:
        mpi_args = " ".join(a for a in (args.binding_args, args.mpi_args) if a) or None
        return run_mpi(args.num_proc, args.host_list, list(args.command), env, mpi_args,
                       verbose=bool(args.verbose))
    except MPILaunchError as e:
        return _fail(str(e), 2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point of `hvdlite-run`."""
    code = _main(argv)
    if argv is None and "torch" in sys.modules:
        # Where the launcher served the job's store it imported torch, and a process holding
        # torch's objects spent ~0.9 s of every job's end here in the interpreter's final
        # garbage collections over them (0.2 s with them frozen). The launcher's own objects
        # need no collecting at its exit. (Only as the command: a caller's process is its own.)
        import gc

        gc.freeze()
    return code


def _main(argv: Optional[Sequence[str]]) -> int:
    args = parse_args(argv)
    from hvdlite.common.config import check_values, warn_misspelled

    warn_misspelled(lambda text: print(f"{PROG}: warning: {text}", file=sys.stderr, flush=True))
    bad = check_values()
    if bad:
        return _fail("error: " + "\n  ".join(bad), 2)
    os.environ["HVDLITE_ENV_CHECKED"] = "1"  # the ranks need not warn again
    if args.check_build:
        from hvdlite.runner.check_build import check_build_text

        print(check_build_text(version()), end="", flush=True)
        return 0
    try:
        return launch(args)
    except KeyboardInterrupt:  # before the driver's own handlers were installed
        return _fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
