"""How long a job takes to start: launch N ranks, join, run one allreduce, shut down, exit.

    python benchmarks/job_start.py [--np 2] [--rounds 5] [--json out.json]

Run it from a plain Python (not under a launcher): it starts the jobs itself, the way a user
does, and times each whole command. Contenders, alternating round by round:

- `hvdlite-run` as shipped: rank 0 runs on this machine, so it serves the job's store on the
  socket the launcher opened, and the launcher never imports torch;
- `hvdlite-run` with `HVDLITE_STORE_ON_DRIVER=1`: the launcher serves the store itself, as a job
  whose rank 0 runs on another host does; it imports torch in a thread while the ranks start
  (it used to import torch first, before any rank started: ~1.5-2.5 s of every such start here);
- an elastic `hvdlite-run` (`--min-np N --max-np N -H localhost:N`) of the same work inside
  `hvd.elastic.run`: its driver serves the store the same way;
- the peer, `torchrun --standalone`: the same work in plain torch.distributed (gloo);
- the floor: N processes that only `import torch`, started together. No rank of any launcher
  can be ready before its torch is imported, and on a host with fewer cores than ranks the N
  imports share the cores.

It prints each one's median seconds over the rounds, the spread, and hvdlite's ratio to each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

HVDLITE_RANK = ("import torch, hvdlite.torch as hvd; hvd.init(); "
                "hvd.allreduce(torch.ones(1), name='start'); hvd.shutdown()")
HVDLITE_ELASTIC_RANK = ("import torch, hvdlite.torch as hvd; hvd.init()\n"
                        "@hvd.elastic.run\n"
                        "def work(state):\n"
                        "    hvd.allreduce(torch.ones(1), name='start')\n"
                        "work(hvd.elastic.ObjectState())\n"
                        "hvd.shutdown()")
TORCH_RANK = ("import torch, torch.distributed as dist; dist.init_process_group('gloo'); "
              "dist.all_reduce(torch.ones(1)); dist.destroy_process_group()")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="ranks per job")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    return p.parse_args()


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(cmd: list[str], extra: dict[str, str]) -> float:
    """Wall seconds of one whole command; a failure stops the benchmark with its output."""
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(extra))
    took = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-2000:]}\n"
                 f"{out.stderr[-4000:]}")
    return took


def _floor(n: int) -> float:
    """N processes that only import torch, started together: until the last one is done."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch"], env=_env({}))
             for _ in range(n)]
    if any(p.wait(timeout=300) != 0 for p in procs):
        sys.exit("python -c 'import torch' failed")
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    n = str(args.np)
    hvdlite_run = [str(BIN / "hvdlite-run"), "-np", n, sys.executable, "-c", HVDLITE_RANK]
    elastic = [str(BIN / "hvdlite-run"), "-np", n, "--min-np", n, "--max-np", n, "-H",
               f"localhost:{n}", sys.executable, "-c", HVDLITE_ELASTIC_RANK]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", n, "--no-python",
                sys.executable, "-c", TORCH_RANK]
    contenders = {
        "hvdlite": lambda: _run(hvdlite_run, {}),
        "hvdlite_store_on_driver": lambda: _run(hvdlite_run, {"HVDLITE_STORE_ON_DRIVER": "1"}),
        "hvdlite_elastic": lambda: _run(elastic, {}),
        "torchrun": lambda: _run(torchrun, {"OMP_NUM_THREADS": "1"}),
        "floor": lambda: _floor(args.np),
    }
    for fn in contenders.values():  # warm the page cache once
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(fn())
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"np": args.np, "rounds": args.rounds,
              "seconds": {k: {"median": med[k], "min": min(v), "max": max(v)}
                          for k, v in times.items()},
              "ratio_vs_torchrun": med["hvdlite"] / med["torchrun"],
              "ratio_vs_store_on_driver": med["hvdlite"] / med["hvdlite_store_on_driver"],
              "ratio_per_round_vs_torchrun": [a / b for a, b in
                                              zip(times["hvdlite"], times["torchrun"])]}
    print(f"job start, {args.np} ranks: launch, join, one allreduce, shut down "
          f"(median of {args.rounds} alternating rounds, min-max)")
    labels = {"hvdlite": "hvdlite-run (rank 0 serves the store)",
              "hvdlite_store_on_driver": "hvdlite-run, HVDLITE_STORE_ON_DRIVER=1",
              "hvdlite_elastic": "hvdlite-run, elastic (the driver's store)",
              "torchrun": "torchrun --standalone (peer)",
              "floor": f"floor: {args.np} x import torch at once"}
    for k, label in labels.items():
        print(f"  {label:42s} {med[k]:6.2f} s  ({min(times[k]):.2f}-{max(times[k]):.2f})")
    per_round = result["ratio_per_round_vs_torchrun"]
    print(f"  hvdlite / torchrun: {result['ratio_vs_torchrun']:.2f} "
          f"({min(per_round):.2f}-{max(per_round):.2f});  hvdlite / store on driver: "
          f"{result['ratio_vs_store_on_driver']:.2f};  hvdlite - floor: "
          f"{med['hvdlite'] - med['floor']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
