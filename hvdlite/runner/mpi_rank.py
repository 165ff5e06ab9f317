"""Per-rank wrapper under `hvdlite-run --mpi` and inside a SLURM allocation (srun): runs the
command and prefixes each line of its output with `[rank]<stdout>:` / `[rank]<stderr>:`, whole
lines at a time, like the gloo launcher.

mpiexec's own prefixing works per write, not per line, so lines from different ranks could be
spliced together; srun's --label cuts lines longer than about 1 KiB into labelled pieces. The child keeps the MPI launcher's file descriptors (close_fds=False), so
MPI_Init in it reaches the process manager as if mpiexec had started it directly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from hvdlite.common.environment import launcher_rank


def mpi_rank_from_env(default: str = "?") -> str:
    """This process's rank as its launcher exported it (MPICH's Hydra, Open MPI, PMIx, MVAPICH,
    srun: the environment table's rows), before MPI_Init."""
    rank = launcher_rank()
    return default if rank is None else str(rank)


def _pump(src, fd: int, prefix: bytes) -> None:
    for line in iter(src.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        os.write(fd, prefix + line)


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python -m hvdlite.runner.mpi_rank COMMAND [ARGS...]", file=sys.stderr)
        return 2
    rank = mpi_rank_from_env()
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            close_fds=False)
    # SIGUSR1 too: SLURM's warning before a time limit, which must reach the rank, not end this.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, 1, f"[{rank}]<stdout>:".encode())),
             threading.Thread(target=_pump, args=(proc.stderr, 2, f"[{rank}]<stderr>:".encode()))]
    for t in pumps:
        t.start()
    code = proc.wait()
    for t in pumps:
        t.join()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
