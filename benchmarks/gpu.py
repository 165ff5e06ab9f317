"""GPU benchmark (started by benchmarks/gpu.sh): hvdlite against torch.distributed NCCL.

    hvdlite-run -np N python benchmarks/gpu.py [--json out.json] [--cpu-fallback]

1. Training step: hvdlite's DistributedOptimizer against DDP on NCCL, a ResNet-style CNN and a
   transformer encoder, synthetic data, alternating A B A B over >= 5 rounds.
2. Allreduce bus bandwidth, 1 MiB - 1 GiB: hvd.allreduce_ against raw torch.distributed NCCL
   all_reduce of the same CUDA tensor, in the same processes, alternating.
Each row: medians, hvdlite / peer ratio, and the spread (min-max of per-round ratios).

--cpu-fallback runs the same code on CPU tensors over gloo, with smaller models and sizes (1 -
16 MiB), so the script itself is exercised on machines without a GPU.

Ranks sharing one GPU (more ranks on a host than GPUs): NCCL refuses them ("Duplicate GPU
detected"), so hvdlite moves their CUDA tensors through host memory, and the peer is DDP and
torch.distributed on gloo with the same CUDA tensors (sizes up to 256 MiB). With one rank there is
no bus to measure: the bandwidth part is skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hvdlite.torch as hvd  # noqa: E402
from bench_util import free_port, sgd_step  # noqa: E402


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def resnet(width: int, blocks: int, classes: int = 100) -> nn.Module:
    """A ResNet-style CNN: stem, residual blocks with BatchNorm, pooled head."""
    layers = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    for i in range(blocks):
        layers.append(Block(width))
        if i % 2 == 1:
            layers += [nn.Conv2d(width, width * 2, 1, stride=2, bias=False),
                       nn.BatchNorm2d(width * 2)]
            width *= 2
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)]
    return nn.Sequential(*layers)


class Transformer(nn.Module):
    def __init__(self, vocab, d, layers, heads):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(1))


def models(cpu: bool, device):
    if cpu:
        return {"resnet": (resnet(16, 2), torch.randn(8, 3, 32, 32), torch.randint(0, 100, (8,))),
                "transformer": (Transformer(1000, 128, 2, 4), torch.randint(0, 1000, (8, 32)),
                                torch.randint(0, 10, (8,)))}
    return {"resnet": (resnet(64, 8), torch.randn(64, 3, 64, 64), torch.randint(0, 100, (64,))),
            "transformer": (Transformer(32000, 768, 6, 12), torch.randint(0, 32000, (16, 256)),
                            torch.randint(0, 10, (16,)))}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, n: int, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / n


def spread(a: list, b: list) -> tuple[float, float, float]:
    """Median of a / median of b, and min-max of the per-round a/b."""
    per = [x / y for x, y in zip(a, b)]
    return statistics.median(a) / statistics.median(b), min(per), max(per)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-fallback", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cpu = args.cpu_fallback
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        backend, shared = "gloo", False
    else:
        gpus = torch.cuda.device_count()
        local = hvd.local_rank() % gpus
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        shared = hvd.local_size() > gpus
        backend = "gloo" if shared else "nccl"
    port = hvd.broadcast_object(free_port() if rank == 0 else None, root_rank=0)
    addr = os.environ.get("HVDLITE_STORE_ADDR", "127.0.0.1")
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=size)
    out = {"device": str(device), "ranks": size, "peer": f"torch.distributed {backend}",
           "gpu": None if cpu else torch.cuda.get_device_name(device),
           "torch": torch.__version__, "shared_gpu": not cpu and shared,
           "train": {}, "busbw": []}
    if not cpu:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))

    # 1. Training step.
    for name, (base, x, y) in models(cpu, device).items():
        torch.manual_seed(0)
        x, y = x.to(device), y.to(device)
        hv_model = base.to(device)
        ddp_model = DDP(_clone(base).to(device), device_ids=None if cpu else [device.index])
        hv_opt = hvd.DistributedOptimizer(torch.optim.SGD(hv_model.parameters(), lr=0.01),
                                          named_parameters=hv_model.named_parameters())
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

        # The floor: the same step with no wrapper and no communication at all. No
        # data-parallel step can beat it; at one rank it is what both contenders approach.
        plain_model = _clone(base).to(device)
        plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)

        hv_step = sgd_step(hv_model, hv_opt, x, y)
        ddp_step = sgd_step(ddp_model, ddp_opt, x, y)
        plain_step = sgd_step(plain_model, plain_opt, x, y)

        timed(hv_step, 3, device)
        timed(ddp_step, 3, device)
        timed(plain_step, 3, device)
        a, b, c = [], [], []
        for _ in range(args.rounds):
            a.append(timed(hv_step, args.steps, device))
            b.append(timed(ddp_step, args.steps, device))
            c.append(timed(plain_step, args.steps, device))
        ratio, lo, hi = spread(a, b)
        floor, _, _ = spread(c, b)
        out["train"][name] = {"hvdlite_ms": statistics.median(a) * 1e3,
                              "ddp_ms": statistics.median(b) * 1e3, "ratio": ratio,
                              "ratio_min": lo, "ratio_max": hi,
                              "no_comm_ms": statistics.median(c) * 1e3, "floor": floor}

    # 2. Allreduce bus bandwidth.
    bus = 2 * (size - 1) / size
    top = (16 << 20) if cpu else (256 << 20) if shared else (1 << 30)
    nbytes = 1 << 20
    while size > 1 and nbytes <= top:
        t = torch.ones(nbytes // 4, device=device)
        n = max(3, min(50, (256 << 20) // nbytes))

        def hv():
            hvd.allreduce_(t, name=f"bw.{nbytes}", op=hvd.Sum)

        def raw():
            dist.all_reduce(t)

        hv()
        raw()
        a, b = [], []
        for _ in range(args.rounds):
            a.append(timed(hv, n, device))
            b.append(timed(raw, n, device))
        ratio, lo, hi = spread(b, a)     # bandwidth ratio = raw time / hvdlite time
        out["busbw"].append({"bytes": nbytes,
                             "hvdlite_GBs": bus * nbytes / statistics.median(a) / 1e9,
                             "raw_GBs": bus * nbytes / statistics.median(b) / 1e9,
                             "ratio": ratio, "ratio_min": lo, "ratio_max": hi})
        del t
        nbytes *= 4

    if rank == 0:
        what = "CPU fallback (gloo)" if cpu else f"GPU ({out['gpu']}, NCCL {out['nccl']})"
        note = " sharing it (NCCL refuses: hvdlite stages through host memory)" if shared else ""
        print(f"== {what}: {size} rank(s) on {device}{note}, hvdlite against {out['peer']}, median of {args.rounds} alternating "
              f"rounds (spread = min-max of per-round ratios)")
        print(f"{'model':<12} {'hvdlite ms':>11} {'DDP ms':>9} {'hvdlite/DDP':>12} {'spread':>12}"
              f" {'no-comm ms':>11} {'floor':>6}")
        for name, r in out["train"].items():
            print(f"{name:<12} {r['hvdlite_ms']:>11.2f} {r['ddp_ms']:>9.2f} {r['ratio']:>12.2f} "
                  f"{r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} {r['no_comm_ms']:>11.2f} "
                  f"{r['floor']:>6.2f}")
        print("(no-comm: the same step without a wrapper or any communication; floor = "
              "no-comm / DDP, the least hvdlite/DDP can be)")
        print(f"{'bytes':>11} {'hvdlite GB/s':>13} {'raw GB/s':>9} {'hvdlite/raw':>12} "
              f"{'spread':>12}")
        if size == 1:
            print("(one rank: no bus bandwidth to measure)")
        for r in out["busbw"]:
            print(f"{r['bytes']:>11} {r['hvdlite_GBs']:>13.3f} {r['raw_GBs']:>9.3f} "
                  f"{r['ratio']:>12.2f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
    hvd.shutdown()


def _clone(m: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(m)


if __name__ == "__main__":
    main()
