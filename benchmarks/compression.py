"""Gradient compression: bytes on the wire, step time and final loss for hvdlite's
Compression.none / fp16 / int8 / powersgd, with torch DDP (plain and its fp16 hook) as peers.

(DDP's PowerSGD hook is left out: on this torch/gloo build, running it in the same processes as
the other contenders aborted with a gloo size mismatch inside the hook.)

    hvdlite-run -np 2 python benchmarks/compression.py

Step time: the communication-bound MLP of models.py, all contenders in the same processes,
alternating round by round; medians and spread (min-max), ratios to hvdlite none.
Bytes: what one rank sends per step. For none/fp16 the ring-allreduce volume 2(N-1)/N x the
gradient bytes; int8 and PowerSGD count their own collectives the same way (alltoall (N-1)/N,
allgather (N-1) x own part, allreduce 2(N-1)/N), from the compressor's counter.
Loss: a fixed budget of steps on scikit-learn's digits (8x8 images, 10 classes; synthetic data of
the same shape if scikit-learn is missing), each contender from the same initial weights and
batches; the final full-data loss and its ratio to uncompressed training.
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
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hvdlite.torch as hvd  # noqa: E402
from hvdlite.common.stateful_compression import ring_allreduce_bytes  # noqa: E402
from bench_util import init_with_torch_gloo  # noqa: E402
from models import MODELS  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and contender")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    p.add_argument("--loss-steps", type=int, default=200, help="step budget on digits")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return p.parse_args()


def compressions(rank: int) -> dict:
    return {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
            "int8": hvd.Compression.int8(), "powersgd": hvd.Compression.powersgd(rank=rank)}


def digits():
    try:
        from sklearn.datasets import load_digits
        d = load_digits()
        return (torch.tensor(d.data, dtype=torch.float32) / 16.0,
                torch.tensor(d.target, dtype=torch.long), "scikit-learn digits")
    except ImportError:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1797, 64, generator=g)
        return x, (x[:, :10] @ torch.randn(10, 10, generator=g)).argmax(1), "synthetic"


def final_loss(comp, steps: int, rank: int, size: int) -> float:
    x, y, _ = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5),
                                   named_parameters=model.named_parameters(), compression=comp)
    # Full-batch steps (each rank its slice of the data set): a smooth trajectory, so the final
    # loss compares the compressors rather than the luck of a noisy minibatch path.
    xs, ys = x[rank::size], y[rank::size]
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def main():
    args = parse_args()
    rank, size = init_with_torch_gloo(hvd, args.threads)
    torch.manual_seed(0)
    base, x, y = MODELS["mlp"]()
    grad_bytes = sum(p.numel() * 4 for p in base.parameters())
    contenders, comps = {}, compressions(args.rank)
    for name, comp in comps.items():
        m = copy.deepcopy(base)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),
                                       named_parameters=m.named_parameters(), compression=comp)
        contenders[f"hvdlite {name}"] = (m, opt)
    m = DDP(copy.deepcopy(base))
    contenders["torch DDP"] = (m, torch.optim.SGD(m.parameters(), lr=0.01))
    m = DDP(copy.deepcopy(base))
    m.register_comm_hook(None, default_hooks.fp16_compress_hook)
    contenders["torch DDP fp16 hook"] = (m, torch.optim.SGD(m.parameters(), lr=0.01))

    def make_step(m, opt):
        def step():
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        return step

    steps = {k: make_step(*v) for k, v in contenders.items()}
    for step in steps.values():
        for _ in range(3):
            step()
    wire = {}
    for k, (m, opt) in contenders.items():
        comp = getattr(opt, "_compression", None)
        if comp is not None and getattr(comp, "stateful", False):
            before = comp.wire_bytes
            steps[k]()
            wire[k] = comp.wire_bytes - before
        elif k == "hvdlite fp16":
            wire[k] = ring_allreduce_bytes(grad_bytes // 2, size)
        elif k == "torch DDP fp16 hook":
            wire[k] = ring_allreduce_bytes(grad_bytes // 2, size)
        elif k.startswith("hvdlite") or k == "torch DDP":
            wire[k] = ring_allreduce_bytes(grad_bytes, size)
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            hvd.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[k].append((time.perf_counter() - t0) / args.steps)
    losses = {name: final_loss(comp if not getattr(comp, "stateful", False)
                               else type(comp)(**({"rank": args.rank} if name == "powersgd"
                                                  else {})),
                               args.loss_steps, rank, size)
              for name, comp in comps.items()}
    if rank == 0:
        t0 = statistics.median(times["hvdlite none"])
        print(f"compression benchmark: MLP ({grad_bytes // 4:,} params), {size} ranks, "
              f"{args.threads} thread(s) each, {args.rounds} alternating rounds x {args.steps} "
              f"steps")
        print(f"{'contender':<34} {'bytes sent/rank/step':>20} {'x fewer':>8} {'ms/step med':>11} "
              f"{'spread':>15} {'x none':>7}")
        out = {"ranks": size, "results": {}, "loss": {}}
        for k in steps:
            med = statistics.median(times[k])
            w = wire.get(k)
            ws = f"{w:>20,.0f}" if w is not None else f"{'(not counted)':>20}"
            fewer = f"{wire['hvdlite none'] / w:>8.1f}" if w else f"{'':>8}"
            print(f"{k:<34} {ws} {fewer} {med * 1e3:>11.2f} "
                  f"{min(times[k]) * 1e3:>7.2f}-{max(times[k]) * 1e3:<7.2f} {med / t0:>7.2f}")
            out["results"][k] = {"wire_bytes": w, "times_s": times[k], "median_ms": med * 1e3,
                                 "time_ratio": med / t0}
        _, _, source = digits()
        print(f"final loss after {args.loss_steps} full-batch steps on {source} "
              f"(SGD lr 0.2 momentum 0.5, each rank its 1/{size} of the data):")
        for name, v in losses.items():
            print(f"  {name:<9} {v:.4f}  ({(v / losses['none'] - 1) * 100:+.2f} % vs none)")
        print("targets: int8 within 1 % of none's final loss; PowerSGD >= 10 x fewer bytes")
        out["loss"] = losses
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
    hvd.shutdown()



if __name__ == "__main__":
    main()
