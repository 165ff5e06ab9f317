"""How long an elastic job takes to get past a hung worker: from the SIGSTOP to the next
committed step, against the floor of the stall shutdown time.

    python benchmarks/hang_recovery.py [--rounds 5] [--warning 3] [--shutdown 10]

Runs the scenario of issue 11 through the real hvdlite-run: -np 3 --min-np 2 --max-np 3
--blacklist-cooldown-range 2 4, discovery printing localhost:2 and 127.0.0.1:1, the highest rank
SIGSTOPs itself after step 20 (tests/workers/elastic_train.py). Times come from the workers' step
marks. Prints the median and spread over rounds, and the median over the shutdown time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "elastic_train.py"
RUN = str(Path(sys.executable).parent / "hvdlite-run")


def step_of(marks: Path, wid: str) -> int:
    try:
        return int((marks / f"step.{wid}").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def one_round(warning: int, shutdown: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        marks = tmp / "marks"
        marks.mkdir()
        script = tmp / "discover.sh"
        script.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\n")
        script.chmod(0o755)
        env = dict(os.environ, PYTHONPATH=str(ROOT), ELASTIC_TOTAL_STEPS="30",
                   ELASTIC_SIGSTOP_AT="20", ELASTIC_MARK_DIR=str(marks),
                   HVDLITE_START_TIMEOUT="60")
        proc = subprocess.Popen(
            [RUN, "-np", "3", "--min-np", "2", "--max-np", "3", "--blacklist-cooldown-range",
             "2", "4", "--host-discovery-script", str(script),
             "--stall-check-warning-time-seconds", str(warning),
             "--stall-check-shutdown-time-seconds", str(shutdown), sys.executable, str(WORKER)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while step_of(marks, "127.0.0.1_0") < 20:
                assert time.monotonic() < deadline and proc.poll() is None, "no progress"
                time.sleep(0.02)
            stopped = time.monotonic()
            # The next committed step on a survivor: step 22 (commits every 2 steps, the
            # survivors rolled back to 20).
            while step_of(marks, "localhost_0") < 22:
                assert time.monotonic() < deadline and proc.poll() is None, "no recovery"
                time.sleep(0.02)
            took = time.monotonic() - stopped
            assert proc.wait(300) == 0
            return took
        finally:
            if proc.poll() is None:
                proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warning", type=int, default=3)
    p.add_argument("--shutdown", type=int, default=10)
    args = p.parse_args()
    times = []
    for i in range(args.rounds):
        times.append(one_round(args.warning, args.shutdown))
        print(f"round {i + 1}: {times[-1]:.1f} s from SIGSTOP to the next committed step",
              flush=True)
    med = statistics.median(times)
    print(f"stall shutdown time {args.shutdown} s; from SIGSTOP to the next committed step: "
          f"median {med:.1f} s (rounds {min(times):.1f} - {max(times):.1f}); "
          f"median - shutdown time = {med - args.shutdown:.1f} s; ratio {med / args.shutdown:.2f}")


if __name__ == "__main__":
    main()
