"""Parameter sharding: per-rank memory and step time, hvdlite's fully_shard against torch's
fully_shard (FSDP2) on gloo and DDP, Adam on the benchmark transformer.

    hvdlite-run -np N python benchmarks/fsdp.py        (N = 2, 4)

Every contender shards (or replicates) the same model in the same processes: each encoder layer
and then the root for the two fully_shard contenders, the whole model for DDP. Memory per rank:
parameters + gradients + optimizer state held between backward and the optimizer step, counted
from the tensors (a DTensor by its local shard); the gathered parameters of the one or two blocks
in flight during forward and backward are not counted, for either fully_shard. Step time: the
contenders alternate round by round on the same data; medians over the rounds with the spread
(min-max), and ratios to torch's fully_shard.
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
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hvdlite.torch as hvd  # noqa: E402
from bench_util import init_with_torch_gloo, sgd_step  # noqa: E402
from models import MODELS  # noqa: E402

FSDP2 = "torch fully_shard (FSDP2, gloo)"
HVD = "hvdlite fully_shard"
DDP_NAME = "torch DDP (gloo)"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="transformer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="timed steps per round and contender")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return p.parse_args()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(ts) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in ts if torch.is_tensor(t))


def training_state_bytes(model, opt) -> int:
    params = list(model.parameters())
    return (tensor_bytes(params) + tensor_bytes(p.grad for p in params if p.grad is not None)
            + tensor_bytes(v for s in opt.state.values() for v in s.values()))


def blocks(model):
    return list(model.enc.layers)


def build(base, size):
    contenders = {}
    m = copy.deepcopy(base)
    for b in blocks(m):
        hvd.fully_shard(b)
    hvd.fully_shard(m)
    contenders[HVD] = (m, torch.optim.Adam(m.parameters(), lr=1e-4))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        mesh = init_device_mesh("cpu", (size,))
        m = copy.deepcopy(base)
        for b in blocks(m):
            torch_fully_shard(b, mesh=mesh)
        torch_fully_shard(m, mesh=mesh)
        contenders[FSDP2] = (m, torch.optim.Adam(m.parameters(), lr=1e-4))
    except Exception as exc:  # noqa: BLE001 (reported; the targets then compare against DDP)
        print(f"torch fully_shard cannot run here: {type(exc).__name__}: {exc}", flush=True)
    m = DDP(copy.deepcopy(base))
    contenders[DDP_NAME] = (m, torch.optim.Adam(m.parameters(), lr=1e-4))
    return contenders


def main():
    args = parse_args()
    rank, size = init_with_torch_gloo(hvd, args.threads)
    torch.manual_seed(0)
    base, x, y = MODELS[args.model]()
    contenders = build(base, size)

    steps = {k: sgd_step(m, opt, x, y) for k, (m, opt) in contenders.items()}
    memory, losses = {}, {}
    for k, step in steps.items():
        for _ in range(2):
            step()
        m, opt = contenders[k]
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        memory[k] = training_state_bytes(m, opt)
        losses[k] = float(loss.detach())
        opt.step()
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            hvd.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[k].append((time.perf_counter() - t0) / args.steps)
    all_mem = hvd.allgather_object(memory, name="fsdp_bench_mem")
    all_times = hvd.allgather_object(times, name="fsdp_bench_times")
    if rank == 0:
        # A step ends when the slowest rank's does: each round's time is the ranks' maximum.
        rounds = {k: [max(t[k][i] for t in all_times) for i in range(args.rounds)]
                  for k in steps}
        peer = FSDP2 if FSDP2 in steps else DDP_NAME
        med = {k: statistics.median(v) for k, v in rounds.items()}
        mem = {k: max(mm[k] for mm in all_mem) for k in steps}
        print(f"fully_shard benchmark: {args.model}, Adam, {size} ranks, {args.threads} "
              f"thread(s) each, {args.rounds} alternating rounds x {args.steps} steps")
        print(f"{'contender':<34} {'train-state B/rank':>18} {'x DDP':>7} {'x peer':>7} "
              f"{'ms/step med':>11} {'spread':>15} {'x peer':>7}")
        out = {"ranks": size, "model": args.model, "peer": peer, "results": {}}
        for k in steps:
            print(f"{k:<34} {mem[k]:>18,} {mem[k] / mem[DDP_NAME]:>7.3f} "
                  f"{mem[k] / mem[peer]:>7.3f} {med[k] * 1e3:>11.1f} "
                  f"{min(rounds[k]) * 1e3:>7.1f}-{max(rounds[k]) * 1e3:<7.1f} "
                  f"{med[k] / med[peer]:>7.2f}")
            out["results"][k] = {"training_state_bytes_max": mem[k], "times_s": rounds[k],
                                 "median_ms": med[k] * 1e3, "loss_after_warmup": losses[k]}
        print(f"targets: hvdlite memory <= 1/{size} of DDP's + 10% = {1 / size + 0.1:.3f} x DDP"
              f" (measured {mem[HVD] / mem[DDP_NAME]:.3f}), <= 1.05 x {peer}'s (measured "
              f"{mem[HVD] / mem[peer]:.3f}); step <= 1.1 x {peer}'s (measured "
              f"{med[HVD] / med[peer]:.2f})")
        print("loss after the same warm-up steps: " +
              ", ".join(f"{k}: {v:.6f}" for k, v in losses.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
