"""Rank FAIL_RANK fails after a moment (exit CODE, or `kill` = SIGKILL itself); the others
announce their pid and sleep until stopped."""
import os
import signal
import sys
import time

fail_rank, how = int(sys.argv[1]), sys.argv[2]
rank = int(os.environ["HVDLITE_RANK"])
if rank == fail_rank:
    time.sleep(1.0)
    print(f"rank {rank} failing", file=sys.stderr, flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
print(f"sleeper pid={os.getpid()}", flush=True)
time.sleep(60)
