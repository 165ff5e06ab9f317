"""Which environment started this process, and what it says about the job: one table.

`hvd.init()` (through `rendezvous.identify`) and `hvdlite-run --dry-run` read the job from here
and nowhere else. Each row of `TABLE` is one way a process gets started; the first row that
applies gives rank, size, the local coordinates where the environment knows them, the node's
name (ranks with the same name form a host for local/cross ranks) and where the job meets.

The order is the precedence. A process's own *launcher* comes before the scheduler task that
launcher runs in, because the launcher's variables describe this process and the scheduler's
describe the launcher: torchrun started by `srun` sees SLURM's task variables of the torchrun
process, and mpirun inside an allocation starts its daemons with srun, so its ranks inherit the
daemons' SLURM step. So, first to last:

1. hvdlite-run's elastic worker (the driver assigns rank and size at every init);
2. hvdlite-run and hvdlite.ray (HVDLITE_RANK ...);
3. Horovod's variables (HOROVOD_RANK ..., from horovodrun or set by hand);
4. Open MPI, MPICH/Hydra (PMI), MVAPICH, PMIx: ranks meet over MPI;
5. torchrun / TorchElastic (TORCHELASTIC_RUN_ID with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*);
6. a SLURM task started by srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS, ...): rank 0 serves the
   rendezvous on the first node of the step, on a port derived from the job and step ids;
7. RANK/WORLD_SIZE/MASTER_* set without torchrun (torch's env://, Kubeflow's PyTorchJob);
8. Kubeflow Trainer's PET_* without torchrun (one process per node);
9. a Ray worker that hvdlite.ray did not start (one rank);
10. none of them: one rank, as `python train.py` is under Horovod.

Where rows that describe this process itself (not a launcher above it) disagree, `detect` fails
with one line naming both. Where an environment says there is more than one task but the job's
rendezvous cannot be found, it fails naming the variables it saw: a job never silently runs as
many jobs of one rank. Standard library only: hvdlite-run imports it.
"""
from __future__ import annotations

import os
import socket
import subprocess
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .hostlist import HostlistError, expand_counts, expand_hostlist

Env = Mapping[str, str]

# The port a SLURM job's rank 0 serves its rendezvous on, unless HVDLITE_STORE_PORT says: derived
# from the job and step ids so that every task computes the same one without talking.
SLURM_PORT_BASE = 29600
SLURM_PORT_SPAN = 20000


class DetectionError(ValueError):
    """The environment cannot start this job as it stands; the message names the variables."""


@dataclass(frozen=True)
class Detected:
    """What one row of the table read from the environment."""

    source: str                       # the row's name, for messages and the debug log
    rank: int | None                  # None: assigned later (elastic) or by MPI
    size: int | None
    local_rank: int | None = None
    local_size: int | None = None
    node: str | None = None           # the node's name, where the environment gives one
    store_host: str | None = None     # where the job meets; None with size 1 or over MPI
    store_port: int | None = None
    store_is_master: bool = False     # this process serves the store (rank 0, no launcher)
    store_fd: int | None = None
    over_mpi: bool = False            # ranks meet over MPI (MPI_COMM_WORLD)
    elastic: bool = False
    launcher: bool = False            # a launcher started this process (see the module doc)
    variables: tuple = field(default=(), compare=False)  # "NAME=value" it read, for messages

    def describe(self) -> str:
        where = f", rendezvous {self.store_host}:{self.store_port}" if self.store_host else ""
        who = "rank assigned by the driver" if self.rank is None and self.elastic else \
            f"rank {self.rank} of {self.size}"
        return f"{self.source}: {who}{where}"


@dataclass(frozen=True)
class Row:
    """One way a process gets started: `applies` looks, `read` interprets."""

    name: str
    markers: tuple                   # variables whose presence makes the row apply
    read: Callable[[Env], Detected]
    doc: str
    applies: Callable[[Env], bool] | None = None

    def matches(self, env: Env) -> bool:
        if self.applies is not None:
            return self.applies(env)
        return any(env.get(m) not in (None, "") for m in self.markers)


# ---------------------------------------------------------------------- reading values
def _int(env: Env, name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise DetectionError(f"environment variable {name}={value!r} is not an integer") \
            from None


def _seen(env: Env, *names: str) -> tuple:
    return tuple(f"{n}={env[n]}" for n in names if n in env)


def _need(env: Env, row: str, names: tuple, why: str) -> None:
    missing = [n for n in names if env.get(n) in (None, "")]
    if missing:
        raise DetectionError(f"{row}: {', '.join(n for n in names if n not in missing)} "
                             f"set but {', '.join(missing)} not; {why}")


# ---------------------------------------------------------------------- rows
def _hvdlite_elastic(env: Env) -> Detected:
    return Detected("hvdlite-run (elastic)", None, None, node=env.get("HVDLITE_HOSTNAME"),
                    elastic=True, launcher=True,
                    variables=_seen(env, "HVDLITE_ELASTIC_WORKER", "HVDLITE_DRIVER_ADDR"))


def _hvdlite(env: Env) -> Detected:
    _need(env, "hvdlite-run", ("HVDLITE_RANK", "HVDLITE_SIZE", "HVDLITE_STORE_ADDR",
                               "HVDLITE_STORE_PORT"), "start the job with hvdlite-run.")
    rank = _int(env, "HVDLITE_RANK")
    source = "hvdlite.ray" if env.get("RAY_RAYLET_PID") else "hvdlite-run"
    fd = _int(env, "HVDLITE_STORE_FD") if rank == 0 else None
    return Detected(source, rank, _int(env, "HVDLITE_SIZE"), _int(env, "HVDLITE_LOCAL_RANK"),
                    _int(env, "HVDLITE_LOCAL_SIZE"), env.get("HVDLITE_HOSTNAME"),
                    env["HVDLITE_STORE_ADDR"], _int(env, "HVDLITE_STORE_PORT"),
                    store_is_master=fd is not None, store_fd=fd, launcher=True,
                    variables=_seen(env, "HVDLITE_RANK", "HVDLITE_SIZE", "HVDLITE_STORE_ADDR",
                                    "HVDLITE_STORE_PORT"))


def _horovod(env: Env) -> Detected:
    _need(env, "Horovod's variables", ("HOROVOD_RANK", "HOROVOD_SIZE"),
          "set both on every rank.")
    rank, size = _int(env, "HOROVOD_RANK"), _int(env, "HOROVOD_SIZE")
    host, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), _int(env,
                                                               "HOROVOD_GLOO_RENDEZVOUS_PORT")
    if size > 1 and (not host or port is None):
        raise DetectionError(
            "HOROVOD_RANK/HOROVOD_SIZE are set but HOROVOD_GLOO_RENDEZVOUS_ADDR/"
            "HOROVOD_GLOO_RENDEZVOUS_PORT are not: set them to rank 0's address and a free port "
            "(rank 0 serves the rendezvous there).")
    # horovodrun sets every coordinate; a hand-set HOROVOD_RANK describes this process only.
    by_horovodrun = env.get("HOROVOD_LOCAL_RANK") not in (None, "")
    return Detected("Horovod's variables", rank, size, _int(env, "HOROVOD_LOCAL_RANK"),
                    _int(env, "HOROVOD_LOCAL_SIZE"), env.get("HOROVOD_HOSTNAME"), host, port,
                    store_is_master=rank == 0, launcher=by_horovodrun,
                    variables=_seen(env, "HOROVOD_RANK", "HOROVOD_SIZE",
                                    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                                    "HOROVOD_GLOO_RENDEZVOUS_PORT"))


def _in_srun_step(env: Env, rank_var: str, size_var: str | None) -> bool:
    """srun's PMI plugins (--mpi=pmi2/pmix) set PMI_RANK/PMIX_RANK in every task: then the task
    is SLURM's, described by the SLURM row, whatever MPI the job uses. An mpiexec run inside a
    task gives its ranks other numbers (and sizes) than the step's."""
    if env.get("SLURM_STEP_ID") in (None, "") or env.get(rank_var) != env.get("SLURM_PROCID"):
        return False
    if size_var and env.get(size_var) not in (None, ""):
        return env.get(size_var) == env.get("SLURM_STEP_NUM_TASKS")
    return env.get("SLURM_MPI_TYPE", "").startswith("pmi")   # PMIx exports no size


def _mpi_row(name: str, rank_var: str, size_var: str | None, local_rank_var: str | None,
             local_size_var: str | None, srun_may_set: bool) -> Row:
    def read(env: Env) -> Detected:
        size = _int(env, size_var) if size_var else None
        return Detected(name, _int(env, rank_var), size,
                        _int(env, local_rank_var) if local_rank_var else None,
                        _int(env, local_size_var) if local_size_var else None,
                        over_mpi=True, launcher=True,
                        variables=_seen(env, *(v for v in (rank_var, size_var) if v)))

    def applies(env: Env) -> bool:
        if env.get(rank_var) in (None, ""):
            return False
        return not (srun_may_set and _in_srun_step(env, rank_var, size_var))

    return Row(name, (rank_var,), read, f"{rank_var}: ranks meet over MPI", applies)


def _torchrun(env: Env) -> Detected:
    _need(env, "torchrun", ("RANK", "WORLD_SIZE"), "torchrun sets both; was this process "
          "started by torchrun?")
    return _torch_env(env, "torchrun", launcher=True)


def _torch_env(env: Env, source: str, launcher: bool) -> Detected:
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    host, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT")
    if size is not None and size > 1 and (not host or port is None):
        raise DetectionError(f"{source}: RANK/WORLD_SIZE are set ({rank} of {size}) but "
                             f"MASTER_ADDR/MASTER_PORT are not: set them to rank 0's address "
                             f"and a free port.")
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return Detected(source, rank, size, _int(env, "LOCAL_RANK"),
                    _int(env, "LOCAL_WORLD_SIZE"), None, host, port,
                    store_is_master=rank == 0 and not agent, launcher=launcher,
                    variables=_seen(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                    "MASTER_PORT", "TORCHELASTIC_RUN_ID"))


def _torch_env_by_hand(env: Env) -> Detected:
    _need(env, "RANK/WORLD_SIZE", ("RANK", "WORLD_SIZE"), "set both (or start with torchrun).")
    found = _torch_env(env, "RANK/WORLD_SIZE (torch env://)", launcher=False)
    nproc = env.get("PET_NPROC_PER_NODE", "")
    if nproc.isdigit() and int(nproc) > 1:
        # Kubeflow's PyTorchJob gives each pod RANK = pod index and WORLD_SIZE = pods: right
        # for torchrun's nodes, wrong for ranks when one pod should run several processes.
        raise DetectionError(
            f"RANK={env['RANK']} WORLD_SIZE={env['WORLD_SIZE']} describe nodes, not processes: "
            f"PET_NPROC_PER_NODE={nproc} asks for {nproc} processes per node, and this process "
            f"was not started by torchrun (no TORCHELASTIC_RUN_ID). Start the command with "
            f"torchrun, or set PET_NPROC_PER_NODE=1.")
    return found


def _slurm_task(env: Env) -> Detected:
    seen = _seen(env, "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    if env.get("SLURM_STEP_ID") in (None, ""):
        ntasks = _int(env, "SLURM_NTASKS") or 1
        if ntasks > 1:
            raise DetectionError(
                f"this process runs in SLURM job {job} of {ntasks} tasks but was not started by "
                f"srun (no SLURM_STEP_ID; saw {' '.join(seen)}), so no other rank will join it. "
                f"Start it with `srun python ...`, or `hvdlite-run -np {ntasks} python ...` "
                f"inside the allocation; to run it alone, `srun -n 1 python ...`.")
        return Detected("SLURM allocation (no srun step)", 0, 1, 0, 1,
                        env.get("SLURMD_NODENAME"), variables=seen)
    _need(env, "SLURM (srun)", ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
          "srun sets both in every task.")
    rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
    node_id = _int(env, "SLURM_NODEID")
    local_size = None
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node and node_id is not None:
        try:
            counts = expand_counts(per_node)
            local_size = counts[node_id] if node_id < len(counts) else None
        except HostlistError:
            local_size = None
    host = port = None
    if size > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or \
            env.get("SLURM_NODELIST")
        if not nodelist:
            raise DetectionError(f"SLURM (srun): task {rank} of {size} but no "
                                 f"SLURM_STEP_NODELIST/SLURM_JOB_NODELIST to find rank 0's node "
                                 f"(saw {' '.join(seen)})")
        first = expand_hostlist(nodelist)[0]
        node = env.get("SLURMD_NODENAME")
        if rank == 0 and node and node != first and not env.get("HVDLITE_STORE_ADDR"):
            # The other tasks look for rank 0 on the step's first node: they would wait there.
            raise DetectionError(
                f"SLURM (srun): task 0 runs on {node}, not on the step's first node {first} "
                f"(SLURM_STEP_NODELIST={nodelist}; an arbitrary distribution?), where the other "
                f"tasks look for it; set HVDLITE_STORE_ADDR to {node}'s address in every task")
        host = env.get("HVDLITE_STORE_ADDR") or first
        port = _int(env, "HVDLITE_STORE_PORT") or slurm_port(job, env.get("SLURM_STEP_ID", "0"))
    return Detected("SLURM (srun)", rank, size, _int(env, "SLURM_LOCALID"), local_size,
                    env.get("SLURMD_NODENAME"), host, port, store_is_master=rank == 0,
                    variables=seen)


def slurm_port(job_id: str, step_id: str) -> int:
    """The rendezvous port of a SLURM job step: the same in every task, different for the steps
    of one job that run at once. HVDLITE_STORE_PORT overrides it."""
    digest = zlib.crc32(f"{job_id}.{step_id}".encode())
    return SLURM_PORT_BASE + digest % SLURM_PORT_SPAN


def _kubeflow_pet(env: Env) -> Detected:
    _need(env, "Kubeflow Trainer (PET_*)", ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR",
                                            "PET_MASTER_PORT"),
          "the torch runtime sets all four.")
    seen = _seen(env, "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                 "PET_MASTER_PORT")
    nproc = env.get("PET_NPROC_PER_NODE", "1")
    nnodes_text = env["PET_NNODES"].split(":")[-1]    # torchrun's "min:max" form
    if not nnodes_text.isdigit():
        raise DetectionError(f"Kubeflow Trainer (PET_*): PET_NNODES={env['PET_NNODES']!r} is not "
                             f"a node count")
    if nproc != "1":
        raise DetectionError(
            f"Kubeflow Trainer (PET_*): PET_NPROC_PER_NODE={nproc} asks torchrun to start "
            f"processes, but this process was not started by torchrun (no TORCHELASTIC_RUN_ID; "
            f"saw {' '.join(seen)}). Make the TrainJob's command `torchrun train.py` (the "
            f"runtime passes PET_* to it), or set numProcPerNode: 1.")
    rank = _int(env, "PET_NODE_RANK")
    return Detected("Kubeflow Trainer (PET_*)", rank, int(nnodes_text), 0, 1, None,
                    env["PET_MASTER_ADDR"], _int(env, "PET_MASTER_PORT"),
                    store_is_master=rank == 0, variables=seen)


def _ray_worker(env: Env) -> Detected:
    return Detected("Ray worker (not started by hvdlite.ray)", 0, 1, 0, 1,
                    variables=_seen(env, "RAY_RAYLET_PID"))


def _slurm_applies(env: Env) -> bool:
    return env.get("SLURM_JOB_ID") not in (None, "") or env.get("SLURM_JOBID") not in (None, "")


def _torchrun_applies(env: Env) -> bool:
    return env.get("TORCHELASTIC_RUN_ID") not in (None, "")


def _torch_env_applies(env: Env) -> bool:
    return not _torchrun_applies(env) and any(env.get(n) not in (None, "")
                                              for n in ("RANK", "WORLD_SIZE"))


def _pet_applies(env: Env) -> bool:
    return not _torchrun_applies(env) and env.get("PET_NNODES") not in (None, "")


TABLE: tuple = (
    Row("hvdlite-run (elastic)", ("HVDLITE_ELASTIC_WORKER",), _hvdlite_elastic,
        "an elastic worker: the driver assigns rank and size at every init()"),
    Row("hvdlite-run", ("HVDLITE_RANK",), _hvdlite,
        "HVDLITE_RANK, _SIZE, _LOCAL_RANK, _HOSTNAME, _STORE_ADDR/_PORT (also hvdlite.ray)"),
    Row("Horovod's variables", ("HOROVOD_RANK",), _horovod,
        "HOROVOD_RANK, _SIZE, HOROVOD_GLOO_RENDEZVOUS_ADDR/_PORT (rank 0 serves)"),
    _mpi_row("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", srun_may_set=False),
    _mpi_row("MPICH/Hydra (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
             srun_may_set=True),
    _mpi_row("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
             "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", srun_may_set=False),
    _mpi_row("PMIx", "PMIX_RANK", None, None, None, srun_may_set=True),
    Row("torchrun", ("TORCHELASTIC_RUN_ID",), _torchrun,
        "TORCHELASTIC_RUN_ID with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/_PORT",
        _torchrun_applies),
    Row("SLURM (srun)", ("SLURM_JOB_ID",), _slurm_task,
        "SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURMD_NODENAME; rank 0 serves on "
        "the step's first node (or HVDLITE_STORE_ADDR), port from the job/step id (or "
        "HVDLITE_STORE_PORT)", _slurm_applies),
    Row("RANK/WORLD_SIZE (torch env://)", ("RANK", "WORLD_SIZE"), _torch_env_by_hand,
        "RANK, WORLD_SIZE, MASTER_ADDR/_PORT without torchrun (rank 0 serves)",
        _torch_env_applies),
    Row("Kubeflow Trainer (PET_*)", ("PET_NNODES",), _kubeflow_pet,
        "PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/_PORT with PET_NPROC_PER_NODE=1",
        _pet_applies),
    Row("Ray worker", ("RAY_RAYLET_PID",), _ray_worker, "a Ray actor without hvdlite.ray: one rank"),
)

SINGLE = Detected("single process", 0, 1, 0, 1)


def applicable(env: Env | None = None) -> list:
    """The rows that apply to `env` (default: this process's environment), in precedence order."""
    env = os.environ if env is None else env
    return [row for row in TABLE if row.matches(env)]


def detect(env: Env | None = None) -> Detected:
    """The job as the first applicable row describes it; raises DetectionError where the
    environment cannot start it (a row's own message) or two rows describing this process
    disagree (one line naming both)."""
    env = os.environ if env is None else env
    rows = applicable(env)
    if not rows:
        return SINGLE
    found = rows[0].read(env)
    if found.launcher:
        # The rows below describe the launcher's own process (module doc): not compared.
        return found
    for row in rows[1:]:
        try:
            other = row.read(env)
        except DetectionError as exc:
            raise DetectionError(f"{found.describe()}, but {exc}") from None
        if other.launcher:
            continue
        if (other.rank, other.size) != (found.rank, found.size):
            raise DetectionError(
                f"two environments disagree: {found.source} says rank {found.rank} of "
                f"{found.size} ({' '.join(found.variables)}) but {other.source} says rank "
                f"{other.rank} of {other.size} ({' '.join(other.variables)}); unset the one that "
                f"does not describe this process")
    return found


def mpi_launcher_rank(env: Env | None = None) -> int | None:
    """This process's rank as an MPI launcher exported it, readable before MPI_Init (the
    per-rank output wrapper of `hvdlite-run --mpi` prefixes lines with it); None outside one."""
    env = os.environ if env is None else env
    for row in applicable(env):
        try:
            found = row.read(env)
        except DetectionError:
            continue
        if found.over_mpi:
            return found.rank
    return None


def launcher_rank(env: Env | None = None) -> int | None:
    """This process's rank as the first row that knows one says, without the checks `detect`
    makes (per-rank output wrappers use it before init)."""
    env = os.environ if env is None else env
    for row in applicable(env):
        try:
            found = row.read(env)
        except DetectionError:
            continue
        if found.rank is not None:
            return found.rank
    return None


def slurm_first_node_address(node: str, env: Env | None = None) -> str:
    """An address of SLURM node `node`: its name where DNS knows it, else the NodeAddr that
    `scontrol show node` reports (clusters whose NodeName is not a host name)."""
    try:
        socket.getaddrinfo(node, None, socket.AF_INET)
        return node
    except (OSError, UnicodeError):
        pass
    try:
        out = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True,
                             text=True, timeout=20, env=dict(os.environ if env is None else env),
                             check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise DetectionError(f"SLURM (srun): rank 0's node {node!r} has no address in DNS and "
                             f"scontrol could not say its NodeAddr ({exc}); make "
                             f"the node name resolvable or set HVDLITE_STORE_ADDR") from None
    for word in out.stdout.split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1]
    raise DetectionError(f"SLURM (srun): rank 0's node {node!r} has no address in DNS and "
                         f"`scontrol show node {node}` gives none ({out.stderr.strip()}); set "
                         f"HVDLITE_STORE_ADDR")
