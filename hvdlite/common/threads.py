"""How many threads torch's CPU kernels may use in a rank: the cores divided among the ranks
that share this host.

Why: torch starts one intra-op thread per core in every process, so N ranks on a host run N
times as many kernel threads as there are cores. The engine's own work (copying gradients into
shared memory, reducing them, fusion buffers) is torch kernels too, and with OpenMP's threads
spinning against the other ranks' threads, a 10 MB shared-memory allreduce ran at ~0.2 GB/s
instead of ~3 GB/s. A TensorFlow/Keras job suffers most: torch is only hvdlite's buffer
library there, nobody sets its threads, and the Keras benchmark's MLP took 88 ms per step on 2
ranks against 36 ms with one torch thread per rank. torchrun sets OMP_NUM_THREADS=1 for the same
reason; hvdlite does it at init() so that every launcher (hvdlite-run, mpirun, torchrun, Ray)
gets it.

Rule: only when OMP_NUM_THREADS is unset and torch still uses its default (at least one thread
per usable core). A script that set OMP_NUM_THREADS, or called torch.set_num_threads() with
fewer threads than the host's cores before hvd.init(), keeps its choice.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_ranks(default: int) -> int:
    """How many ranks of this job run on this host, from the launcher's environment
    (hvdlite-run/horovodrun, MPICH, Open MPI, MVAPICH); `default` when none says."""
    for var in ("HOROVOD_LOCAL_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                "MV2_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return default


def fair_share(local_size: int, cores: int | None = None) -> int:
    """Cores per rank on this host, at least 1."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, local_size))


def fit_torch_threads(local_size: int) -> int | None:
    """Set torch's intra-op threads to this rank's share of the cores (see the module
    docstring); returns the new count, or None when it left torch alone."""
    if os.environ.get("OMP_NUM_THREADS") or local_size <= 1:
        return None
    import torch
    cores = usable_cores()
    current = torch.get_num_threads()
    share = fair_share(local_size, cores)
    if current < cores or current <= share:
        return None                      # chosen by the script, or already fair
    torch.set_num_threads(share)
    log.info("%d ranks share %d cores on this host: torch's CPU kernels use %d thread(s) per "
             "rank (was %d); set OMP_NUM_THREADS to choose", local_size, cores, share, current)
    return share
