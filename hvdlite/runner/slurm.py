"""hvdlite-run inside a SLURM allocation (salloc, sbatch): hosts from the allocation, ranks by srun.

As horovodrun does with jsrun under LSF, the launcher hands the start to the scheduler's own
launcher, so the ranks are under SLURM's control: its signals, accounting and cgroups. Each task finds its rank in SLURM's variables (common/environment.py,
the "SLURM (srun)" row) and rank 0 serves the rendezvous; the launcher only adds the job secret
and the rendezvous address to the environment srun passes on; each task runs under the per-rank
wrapper that prints the prefixes every other hvdlite-run job prints (`[rank]<stdout>:`).
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hvdlite.common.environment import DetectionError, slurm_first_node_address
from hvdlite.common.hostlist import HostlistError, expand_counts, expand_hostlist
from hvdlite.runner.hosts import (
    HostError,
    HostSpec,
    assign_slots,
    too_few_slots_message,
)
from hvdlite.runner.secret import SECRET_ENV, make_key

# hvdlite-run's variables a rank must not inherit from the launcher's own environment: under
# srun every task's identity comes from SLURM's variables.
_RANK_ONLY = re.compile(r"(HVDLITE|HOROVOD)_(RANK|SIZE|LOCAL_RANK|LOCAL_SIZE|CROSS_RANK|CROSS_SIZE|"
                        r"HOSTNAME|STORE_FD|STORE_PORT|ELASTIC_WORKER|ELASTIC_SPAWN|DRIVER_ADDR|"
                        r"DRIVER_PORT|GLOO_RENDEZVOUS_ADDR|GLOO_RENDEZVOUS_PORT)$")


@dataclass(frozen=True)
class Allocation:
    """A SLURM job's nodes and how many ranks each may run, as the shell inside it sees them."""

    job_id: str
    hosts: list
    variables: tuple     # "NAME=value" it was read from, for --dry-run and messages

    def describe(self) -> str:
        return f"SLURM allocation {self.job_id} ({' '.join(self.variables)})"


def allocation(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this shell runs in (salloc, an sbatch script), or None: outside SLURM,
    and inside an srun step, whose task is one rank's place, not an allocation to fill."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job or env.get("SLURM_STEP_ID"):
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    # Tasks asked for (salloc -n) bound the ranks per node; else every CPU is a slot.
    counts_var = "SLURM_TASKS_PER_NODE" if env.get("SLURM_NTASKS") else "SLURM_JOB_CPUS_PER_NODE"
    counts_text = env.get(counts_var)
    seen = tuple(f"{n}={env[n]}" for n in ("SLURM_JOB_NODELIST", "SLURM_NTASKS", counts_var)
                 if env.get(n))
    if not nodelist or not counts_text:
        raise HostError(f"inside SLURM job {job}, but SLURM_JOB_NODELIST or {counts_var} is "
                        f"not set; give the hosts with -H")
    try:
        names, counts = expand_hostlist(nodelist), expand_counts(counts_text)
    except HostlistError as exc:
        raise HostError(f"SLURM job {job}: {exc}") from None
    if len(counts) != len(names):
        raise HostError(f"SLURM job {job}: {len(names)} nodes in SLURM_JOB_NODELIST={nodelist} "
                        f"but {len(counts)} counts in {counts_var}={counts_text}")
    return Allocation(job, [HostSpec(n, c) for n, c in zip(names, counts)], seen)


def srun_command(alloc: Allocation, num_proc: int, command: Sequence[str],
                 srun: str = "srun") -> list:
    """The srun line that starts `num_proc` ranks filling the allocation's nodes in order, as
    hvdlite-run places ranks on a host list. Each task's output is prefixed by the per-rank
    wrapper (runner/mpi_rank.py), whole lines at a time: srun's --label cuts lines longer than
    about 1 KiB into labelled pieces. Not
    --kill-on-bad-exit: a rank that exits on purpose with a status (an elastic job stopped by a
    signal exits 128 + it after saving) would have its peers killed mid-exit; a rank that fails
    makes the others fail on their own, as in every hvdlite job."""
    if num_proc > sum(h.slots for h in alloc.hosts):
        raise HostError(too_few_slots_message(num_proc, alloc.hosts)
                        + f" (SLURM allocation {alloc.job_id})")
    used: list[str] = []
    for slot in assign_slots(alloc.hosts, num_proc):
        if slot.hostname not in used:
            used.append(slot.hostname)
    return [srun, f"--ntasks={num_proc}", f"--nodes={len(used)}", f"--nodelist={','.join(used)}",
            "--distribution=block", sys.executable, "-m", "hvdlite.runner.mpi_rank", *command]


def srun_env(alloc: Allocation, base: Mapping[str, str], start_timeout: int) -> dict:
    """The environment srun hands every task: the job secret (never on a command line) and where
    rank 0 serves the rendezvous; the port stays derived from the step's id in each task."""
    env = {k: v for k, v in base.items() if not _RANK_ONLY.match(k)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[SECRET_ENV] = make_key().hex()
    env["HVDLITE_START_TIMEOUT"] = env["HOROVOD_START_TIMEOUT"] = str(start_timeout)
    first = alloc.hosts[0].name
    try:
        env.setdefault("HVDLITE_STORE_ADDR", slurm_first_node_address(first, base))
    except DetectionError:
        pass   # each rank tries again, and says why where it fails
    return env


def run_srun(argv: list, env: Mapping[str, str], verbose: bool = False) -> int:
    """Run the srun line; SIGINT/SIGTERM/SIGUSR1 reach srun (which passes them to the tasks).
    Returns srun's exit status (128 + signal where srun itself was killed)."""
    if verbose:
        print(f"hvdlite-run: {' '.join(shlex.quote(a) for a in argv)}", file=sys.stderr,
              flush=True)
    try:
        proc = subprocess.Popen(argv, env=dict(env))
    except OSError as exc:
        print(f"hvdlite-run: cannot start {argv[0]}: {exc}", file=sys.stderr, flush=True)
        return 127

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM,
                                                       signal.SIGUSR1)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code if code >= 0 else 128 - code
