"""Training-step time: hvdlite's DistributedOptimizer against torch DDP (gloo), same run.

    hvdlite-run -np 2 python benchmarks/train_step.py [--models mlp,cnn,transformer]

hvdlite, DDP, a plain local step (the same model with no communication at all: the
one-process floor) and a serial floor run in the same processes on the same model, data and
thread settings, alternating A B C D over several rounds so machine noise hits all alike; the
table shows the median step time of each and the ratio hvdlite / DDP (below 1.0 means hvdlite
is faster).

The serial floor is the local step followed by one hvdlite allreduce of a flat buffer holding
as many bytes as all the gradients: what a synchronous step cannot avoid, namely waiting for
the slowest rank once per step and reducing every gradient byte once, here in one call on the
fastest data path these processes have and with nothing overlapped. With one core per rank
(this project's 2-core machine), overlapping communication with backpropagation can hide only
waiting, not the CPU work of copying and reducing, so serial / DDP is about the best ratio a
data-parallel library can show here; no comm / DDP is a looser bound.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hvdlite.torch as hvd  # noqa: E402
from hvdlite.common import basics  # noqa: E402
from bench_util import free_port, sgd_step  # noqa: E402
from models import MODELS  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,cnn,transformer")
    p.add_argument("--rounds", type=int, default=5, help="A/B rounds")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round and contender")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help="write results here (rank 0)")
    p.add_argument("--plot", default=None, help="PNG bar chart (rank 0, needs matplotlib)")
    return p.parse_args()



def time_steps(step, n: int) -> float:
    # Every contender starts with the ranks in step. The no-communication contender never
    # synchronises, so the ranks drift apart during it; without this barrier the next
    # contender's first step (hvdlite's, in A B C order) absorbed that drift.
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(free_port() if rank == 0 else None, root_rank=0)
    addr = os.environ.get("HVDLITE_STORE_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=size)
    results = {}
    for name in args.models.split(","):
        torch.manual_seed(0)
        base, x, y = MODELS[name]()
        hv_model = copy.deepcopy(base)
        ddp_model = DDP(copy.deepcopy(base))
        local_model = copy.deepcopy(base)
        local_opt = torch.optim.SGD(local_model.parameters(), lr=0.01)
        hv_opt = hvd.DistributedOptimizer(torch.optim.SGD(hv_model.parameters(), lr=0.01),
                                          named_parameters=hv_model.named_parameters())
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

        hv_step = sgd_step(hv_model, hv_opt, x, y)
        ddp_step = sgd_step(ddp_model, ddp_opt, x, y)
        local_step = sgd_step(local_model, local_opt, x, y)
        params = sum(p.numel() for p in base.parameters())
        flat = torch.zeros(params)
        serial_name = f"serial_floor.{name}"

        def serial_step() -> None:
            local_step()
            hvd.allreduce_(flat, name=serial_name, op=hvd.Average)

        for step in (hv_step, ddp_step, local_step, serial_step):
            time_steps(step, args.warmup)
        hv_times, ddp_times, local_times, serial_times = [], [], [], []
        for _ in range(args.rounds):
            hv_times.append(time_steps(hv_step, args.steps))
            ddp_times.append(time_steps(ddp_step, args.steps))
            local_times.append(time_steps(local_step, args.steps))
            serial_times.append(time_steps(serial_step, args.steps))
        results[name] = {"params": params, "hvdlite_s": hv_times, "ddp_s": ddp_times,
                         "local_s": local_times, "serial_s": serial_times,
                         "hvdlite_median_ms": statistics.median(hv_times) * 1e3,
                         "ddp_median_ms": statistics.median(ddp_times) * 1e3,
                         "local_median_ms": statistics.median(local_times) * 1e3,
                         "serial_median_ms": statistics.median(serial_times) * 1e3}
        results[name]["ratio"] = (results[name]["hvdlite_median_ms"]
                                  / results[name]["ddp_median_ms"])
        # The spread: hvdlite/DDP of each alternating round (both timed back to back).
        per_round = [h / d for h, d in zip(hv_times, ddp_times)]
        results[name]["ratio_min"], results[name]["ratio_max"] = min(per_round), max(per_round)
    if rank == 0:
        transport = "mpi" if hvd.mpi_enabled() else "gloo"
        if transport == "gloo" and basics.engine_counters()["shm_collectives"]:
            transport = "gloo (data through shared memory)"
        print(f"training step, {size} ranks, hvdlite over {transport}, DDP over gloo, "
              f"{args.threads} thread(s) each, {args.rounds} rounds x {args.steps} steps "
              f"(median ms/step; ratio spread = min-max of the per-round ratios)")
        print(f"{'model':<12} {'params':>10} {'hvdlite':>10} {'torch DDP':>10} {'no comm':>10} "
              f"{'serial':>10} {'hvdlite/DDP':>12} {'spread':>12} {'serial/DDP':>11}")
        for name, r in results.items():
            print(f"{name:<12} {r['params']:>10,} {r['hvdlite_median_ms']:>10.2f} "
                  f"{r['ddp_median_ms']:>10.2f} {r['local_median_ms']:>10.2f} "
                  f"{r['serial_median_ms']:>10.2f} "
                  f"{r['ratio']:>12.2f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} "
                  f"{r['serial_median_ms'] / r['ddp_median_ms']:>11.2f}")
        print("serial: the no-comm step, then one allreduce of every gradient byte in one flat "
              "buffer (the floor of a synchronous step; see the module docstring)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "threads": args.threads, "transport": transport,
                           "results": results}, f, indent=1)
        if args.plot:
            plot(results, args.plot, size, transport)
    dist.destroy_process_group()
    hvd.shutdown()


def plot(results: dict, path: str, size: int, transport: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    names = list(results)
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (key, label) in enumerate((("hvdlite_median_ms", f"hvdlite ({transport})"),
                                      ("ddp_median_ms", "torch DDP (gloo)"),
                                      ("local_median_ms", "no communication"),
                                      ("serial_median_ms", "serial floor"))):
        raw = {"hvdlite_median_ms": "hvdlite_s", "ddp_median_ms": "ddp_s",
               "local_median_ms": "local_s", "serial_median_ms": "serial_s"}[key]
        med = [results[n][key] for n in names]
        lo = [m - min(results[n][raw]) * 1e3 for m, n in zip(med, names)]
        hi = [max(results[n][raw]) * 1e3 - m for m, n in zip(med, names)]
        ax.bar([x + (i - 1.5) * 0.2 for x in xs], med, 0.2, label=label, yerr=[lo, hi],
               capsize=3)   # error bars: min-max over the rounds
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms per training step (median, bars: min-max)")
    ax.set_title(f"training step, {size} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
