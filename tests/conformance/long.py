"""The conformance suite's long mode: many seeds under every lane configuration.

    scripts/conformance.sh --seeds 0-499                 # every configuration, 2-4 ranks
    scripts/conformance.sh --config tcp --np 3 --seeds 17     # replay one seed

Seeds run in jobs of --per-job (start-up costs more than a program); the rank counts are
dealt out to the jobs in turn, so each seed runs on one of them, and the configurations in
turn too unless --every-config is given. Prints each failing seed with its replay command as
it happens, and a summary at the end; exits 1 if any seed failed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from configs import CONFIGS, have_mpi, lane_problems, replay_command, run_job


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            seeds.extend(range(int(a), int(b) + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="0-99", help="seeds: 5,7,10-20")
    p.add_argument("--config", default="all", help=f"comma-separated, or all: {', '.join(CONFIGS)}")
    p.add_argument("--np", default="2,3,4", help="rank counts, dealt out to the jobs in turn")
    p.add_argument("--per-job", type=int, default=8, help="seeds per job")
    p.add_argument("--every-config", action="store_true",
                   help="run every seed under every configuration (default: configurations in "
                        "turn, one per job)")
    p.add_argument("--op-timeout", type=float, default=60.0,
                   help="seconds one call may take before it counts as a hang")
    p.add_argument("--frontend", default="torch", choices=["torch", "tensorflow"],
                   help="tensorflow: the blocking part of each program through "
                        "hvdlite.tensorflow (tests/workers/conformance_tf.py)")
    p.add_argument("--trace", action="store_true", help="ranks log every call (for a replay; "
                   "torch)")
    p.add_argument("--verbose", action="store_true", help="print every job's whole output")
    a = p.parse_args(argv)
    seeds = parse_seeds(a.seeds)
    names = list(CONFIGS) if a.config == "all" else a.config.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    if not have_mpi():
        skipped = [n for n in names if CONFIGS[n].mpi]
        if skipped:
            print(f"no mpi4py/mpiexec: leaving out {skipped}", flush=True)
        names = [n for n in names if not CONFIGS[n].mpi]
    nps = [int(x) for x in a.np.split(",")]
    chunks = [seeds[k:k + a.per_job] for k in range(0, len(seeds), a.per_job)]
    jobs = []
    for j, chunk in enumerate(chunks):
        np = nps[j % len(nps)]
        for name in (names if a.every_config else [names[j % len(names)]]):
            jobs.append((name, np, chunk))
    extra = ["--trace"] if a.trace else []
    t0 = time.monotonic()
    failures, runs, lane_notes = [], 0, []
    totals: dict = {name: {} for name in names}
    for k, (name, np, chunk) in enumerate(jobs):
        t = time.monotonic()
        res = run_job(CONFIGS[name], np, chunk, timeout=120 + 60 * len(chunk),
                      op_timeout=a.op_timeout, extra_args=extra, frontend=a.frontend)
        runs += len(chunk)
        took = time.monotonic() - t
        print(f"[{k + 1}/{len(jobs)}] {name} np={np} seeds {chunk[0]}..{chunk[-1]}: "
              f"{len(res.ok)} ok, {len(res.failed)} failed ({took:.1f}s)", flush=True)
        if a.verbose:
            print(res.output, flush=True)
        for s, per_rank in res.failed.items():
            failures.append((name, np, s))
            print(f"  FAILED seed {s} under {name} on {np} ranks; replay:\n"
                  f"    {replay_command(name, np, [s], a.frontend)}\n"
                  f"    (the whole job: {replay_command(name, np, chunk, a.frontend)})",
                  flush=True)
            for r, lines in per_rank.items():
                for line in lines[:12]:
                    print(f"    [{r}] {line}", flush=True)
            if not any(per_rank.values()):
                print("    no verdict from the ranks; the job's last output:\n"
                      + res.output[-3000:], flush=True)
        for key, v in res.lanes.items():
            totals[name][key] = totals[name].get(key, 0) + v
        for prob in res.lane_problems:
            lane_notes.append(f"{name} np={np}: {prob}")
            print(f"  LANE {prob}", flush=True)
    for name in names:
        for prob in lane_problems(CONFIGS[name], totals[name], want_on=True):
            lane_notes.append(f"{name}, all its jobs: {prob}")
    took = time.monotonic() - t0
    print(f"\nconformance: {runs} seed runs ({len(seeds)} seeds) in {len(jobs)} jobs under "
          f"{', '.join(names)}; {len(failures)} failed; {took:.0f}s", flush=True)
    for name, np, s in failures:
        print(f"  {replay_command(name, np, [s], a.frontend)}")
    for note in lane_notes:
        print(f"  lane wrong: {note}")
    return 1 if failures or lane_notes else 0


if __name__ == "__main__":
    sys.exit(main())
