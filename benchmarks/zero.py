"""ZeRO sharding: per-rank memory and step time, hvdlite zero_stage 0/1/2 against torch's
ZeroRedundancyOptimizer (with DDP for the gradients), Adam on the benchmark transformer.

    hvdlite-run -np N python benchmarks/zero.py        (N = 1, 2, 4)

Memory (after a few steps, per rank): optimizer-state bytes (every tensor in the optimizer's
state), and the training-state bytes a rank holds between backward and the next zero_grad
(parameters + gradients still allocated + optimizer state), which is what ZeRO shards. These
are counted from the tensors, not from the process RSS (torch's own libraries dwarf a small
model in RSS). Step time: the contenders run in the same processes on the same data, alternating
round by round; medians and spread (min-max) over the rounds, and ratios to stage 0.
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
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hvdlite.torch as hvd  # noqa: E402
from bench_util import init_with_torch_gloo  # noqa: E402
from models import MODELS  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="transformer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="timed steps per round and contender")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return p.parse_args()


def tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))


def state_bytes(opt) -> int:
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    return tensor_bytes(v for s in inner.state.values() for v in s.values())


def main():
    args = parse_args()
    rank, size = init_with_torch_gloo(hvd, args.threads)
    torch.manual_seed(0)
    base, x, y = MODELS[args.model]()
    contenders = {}
    for stage in (0, 1, 2):
        m = copy.deepcopy(base)
        opt = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-4),
                                       named_parameters=m.named_parameters(), zero_stage=stage)
        contenders[f"hvdlite zero_stage={stage}"] = (m, opt)
    m = DDP(copy.deepcopy(base))
    contenders["torch DDP + ZeroRedundancyOptimizer"] = (
        m, ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4))

    def make_step(m, opt):
        def step():
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        return step

    steps = {k: make_step(*v) for k, v in contenders.items()}
    memory = {}
    for k, step in steps.items():
        for _ in range(3):
            step()
        m, opt = contenders[k]
        # Held between backward and zero_grad: parameters, gradients, optimizer state.
        contenders[k][1].zero_grad()
        F.cross_entropy(m(x), y).backward()
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        params = list(m.parameters())
        memory[k] = {"state_bytes": state_bytes(opt),
                     "training_state_bytes": tensor_bytes(params)
                     + tensor_bytes(p.grad for p in params if p.grad is not None)
                     + state_bytes(opt)}
        with opt.skip_synchronize() if hasattr(opt, "skip_synchronize") else _Null():
            opt.step()
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            hvd.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[k].append((time.perf_counter() - t0) / args.steps)
    # Same weights after the same steps (stage 1/2 vs 0): a sanity check printed with results.
    ref = contenders["hvdlite zero_stage=0"][0]
    drift = {k: max((p - q).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))
             for k, (m, _) in contenders.items() if k.startswith("hvdlite")}
    all_mem = hvd.allgather_object(memory, name="zero_bench_mem")
    if rank == 0:
        s0 = statistics.median(times["hvdlite zero_stage=0"])
        s0_state = max(mm["hvdlite zero_stage=0"]["state_bytes"] for mm in all_mem)
        print(f"ZeRO benchmark: {args.model}, Adam, {size} rank(s), {args.threads} thread(s) each, "
              f"{args.rounds} alternating rounds x {args.steps} steps")
        print(f"{'contender':<38} {'state B/rank (max)':>18} {'x stage0':>9} "
              f"{'train-state B/rank':>18} {'ms/step med':>11} {'spread':>15} {'x stage0':>9}")
        out = {"ranks": size, "model": args.model, "results": {}}
        for k in steps:
            st = max(mm[k]["state_bytes"] for mm in all_mem)
            tr = max(mm[k]["training_state_bytes"] for mm in all_mem)
            med = statistics.median(times[k])
            print(f"{k:<38} {st:>18,} {st / s0_state:>9.3f} {tr:>18,} {med * 1e3:>11.1f} "
                  f"{min(times[k]) * 1e3:>7.1f}-{max(times[k]) * 1e3:<7.1f} {med / s0:>9.2f}")
            out["results"][k] = {"state_bytes_max": st, "state_ratio": st / s0_state,
                                 "training_state_bytes_max": tr, "times_s": times[k],
                                 "median_ms": med * 1e3, "time_ratio": med / s0}
        print(f"target: state bytes/rank <= 1/{size} + 5% of stage 0 = "
              f"{1 / size + 0.05:.3f}; stage 1 time <= 1.1 x stage 0")
        print("max |weight difference| to stage 0 after identical steps: "
              + ", ".join(f"{k.split()[-1]}: {v:.1e}" for k, v in drift.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
    hvd.shutdown()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False



if __name__ == "__main__":
    main()
