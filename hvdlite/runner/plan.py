"""`hvdlite-run --dry-run`: what the launcher found and what it would start, without starting it.

Built from the same functions the launch uses (host placement, the srun and mpiexec lines, the
ssh line), so what it prints is what would run.
"""
from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Mapping

from hvdlite.common.environment import DetectionError, detect
from hvdlite.runner.hosts import assign_slots, is_local_host

# A rank's coordinates, shown in front of a local rank's command (the rest of its environment
# is the launcher's, plus the job secret, which is never printed).
_SHOWN = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")


def _environment_line(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    if args.host_source:
        return args.host_source
    try:
        found = detect(environ)
    except DetectionError as exc:
        return f"(this shell's environment cannot start a job by itself: {exc})"
    if found.source == "single process":
        return "none (no scheduler or launcher variables; hosts from -np)"
    return found.describe()


def _ranks(ranks: list) -> str:
    return f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def plan_text(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str:
    """The lines --dry-run prints."""
    environ = os.environ if environ is None else environ
    command = list(args.command)
    lines = [f"environment: {_environment_line(args, environ)}"]
    if args.elastic:
        lines.append("elastic: hosts from "
                     + (f"--host-discovery-script {args.host_discovery_script}"
                        if args.host_discovery_script else
                        ", ".join(str(h) for h in args.host_list or [])))
        lines.append(f"ranks: {args.num_proc or args.min_num_proc or 1} to start, "
                     f"{args.min_num_proc or args.num_proc} at least, "
                     f"{args.max_num_proc or 'no'} at most; each starts as: "
                     f"{shlex.join(command)}")
        return "\n".join(lines) + "\n"
    hosts = args.host_list or []
    lines.append("hosts: " + ", ".join(str(h) for h in hosts))
    slots = assign_slots(hosts, args.num_proc)
    per_host: dict = {}
    for slot in slots:
        per_host.setdefault(slot.hostname, []).append(slot.rank)
    lines.append("ranks per host: " + ", ".join(f"{h}: {len(r)} (rank {_ranks(r)})"
                                                for h, r in per_host.items()))
    lines.append("commands:")
    if getattr(args, "slurm", None) is not None:
        from hvdlite.runner.slurm import srun_command

        lines.append("  " + shlex.join(srun_command(args.slurm, args.num_proc, command)))
    elif args.use_mpi:
        from hvdlite.runner.mpi_run import (
            MPILaunchError,
            find_mpiexec,
            flavour,
            mpi_command,
        )

        try:
            mpiexec = find_mpiexec()
            mpi_args = " ".join(a for a in (args.binding_args, args.mpi_args) if a) or None
            line = mpi_command(mpiexec, args.num_proc, args.host_list, command, mpi_args,
                               flavour(mpiexec))
            lines.append("  HOROVOD_CPU_OPERATIONS=mpi " + shlex.join(line))
        except MPILaunchError as exc:
            lines.append(f"  (no mpiexec: {exc})")
    else:
        from hvdlite.runner.local import SSHSettings
        from hvdlite.runner.remote import ssh_command

        ssh = SSHSettings(args.ssh_port, args.ssh_identity_file, args.start_timeout)
        for slot in slots:
            coords = " ".join(f"HVDLITE_{n}={getattr(slot, n.lower())}" for n in _SHOWN)
            if is_local_host(slot.hostname):
                lines.append(f"  rank {slot.rank} on {slot.hostname}: {coords} "
                             f"{shlex.join(command)}")
            else:
                lines.append(f"  rank {slot.rank} on {slot.hostname}: "
                             f"{shlex.join(ssh_command(slot.hostname, ssh))} (runs in "
                             f"{os.getcwd()}: {coords} {shlex.join(command)})")
    return "\n".join(lines) + "\n"
