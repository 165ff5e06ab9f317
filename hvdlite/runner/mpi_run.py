"""`hvdlite-run --mpi`: start the ranks through the MPI launcher (mpiexec from the mpich wheel, or
any MPICH/Open MPI on PATH), so the job's collectives run on MPI.

Ranks then find each other over MPI (see hvdlite/common/backends/mpi.py); hvdlite-run only builds
the mpiexec command line, exports HOROVOD_CPU_OPERATIONS=mpi with the tuning variables, forwards
Ctrl-C, and returns mpiexec's exit code.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Sequence

from hvdlite.runner.hosts import HostSpec, is_local_host


class MPILaunchError(RuntimeError):
    """No usable mpiexec, or an option it cannot express."""


def find_mpiexec() -> str:
    """mpiexec next to this Python (the mpich wheel installs it there), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise MPILaunchError("--mpi needs an MPI launcher: pip install mpi4py mpich (or put "
                             "mpiexec on PATH), or drop --mpi to use gloo")
    return found


def flavour(mpiexec: str) -> str:
    """'hydra' (MPICH, Intel MPI) or 'openmpi'."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "hydra"


def mpi_command(mpiexec: str, num_proc: int, hosts: Sequence[HostSpec] | None,
                command: Sequence[str], mpi_args: str | None = None,
                kind: str = "hydra") -> list[str]:
    """The mpiexec command line for `num_proc` ranks on `hosts` (None: this machine)."""
    cmd = [mpiexec, "-n", str(num_proc)]
    remote = hosts is not None and not all(is_local_host(h.name) for h in hosts)
    if kind == "openmpi":
        cmd += ["--bind-to", "none", "--map-by", "slot"]
        if remote:
            cmd += ["-H", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
        cmd += ["-x", "HOROVOD_CPU_OPERATIONS", "-x", "HOROVOD_CONTROLLER", "-x", "PYTHONPATH"]
    elif remote:
        # Hydra passes the whole environment by default (-genvall).
        cmd += ["-hosts", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
    if mpi_args:
        cmd += shlex.split(mpi_args)
    # Each rank's output is prefixed line by line by a small wrapper (mpi_rank.py).
    return cmd + [sys.executable, "-m", "hvdlite.runner.mpi_rank"] + list(command)


def run_mpi(num_proc: int, hosts: Sequence[HostSpec] | None, command: Sequence[str],
            env: dict, mpi_args: str | None = None, verbose: bool = False) -> int:
    """Run the job under mpiexec; returns its exit code (Ctrl-C is forwarded). `verbose`
    (--verbose) prints the mpiexec command line first, as horovodrun prints mpirun's."""
    mpiexec = find_mpiexec()
    cmd = mpi_command(mpiexec, num_proc, hosts, command, mpi_args, flavour(mpiexec))
    if verbose:
        print(shlex.join(cmd), file=sys.stderr, flush=True)
    env = dict(env)
    env["HOROVOD_CPU_OPERATIONS"] = env["HVDLITE_CPU_OPERATIONS"] = "mpi"
    env.setdefault("HOROVOD_CONTROLLER", "mpi")
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if code != 0:
        print(f"hvdlite-run: mpiexec exited with code {code}", file=sys.stderr, flush=True)
    return code if code >= 0 else 128 - code
