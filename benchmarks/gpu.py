"""GPU benchmark (started by benchmarks/gpu.sh): hvdlite against torch.distributed NCCL.

    hvdlite-run -np N python benchmarks/gpu.py [--json out.json] [--cpu-fallback]

1. Training step: hvdlite's DistributedOptimizer against DDP on NCCL, a ResNet-style CNN and a
   transformer encoder, synthetic data, alternating A B A B over >= 5 rounds.
2. Allreduce bus bandwidth, 1 MiB - 1 GiB: hvd.allreduce_ against raw torch.distributed NCCL
   all_reduce of the same CUDA tensor, in the same processes, alternating: raw calls queued back
   to back (one wait at the end), and raw calls each waited for, as hvd.allreduce_ is.
Each row: medians, hvdlite / peer ratio, and the spread (min-max of per-round ratios). On a GPU,
hvdlite also runs with HOROVOD_ENABLE_ASYNC_COMPLETION=1 in rounds of its own, alternating with
the others in the same processes.

--cpu-fallback runs the same code on CPU tensors over gloo, with smaller models and sizes (1 -
16 MiB), so the script itself is exercised on machines without a GPU.

Ranks sharing one GPU (more ranks on a host than GPUs): NCCL refuses them ("Duplicate GPU
detected"), so hvdlite moves their CUDA tensors through host memory, and the peer is DDP and
torch.distributed on gloo with the same CUDA tensors (sizes up to 256 MiB). With one rank there is
no bus to measure: the bandwidth part is skipped.

Ranks sharing one GPU that each have their own NCCL_HOSTID: NCCL takes them for ranks of
different hosts and connects them through its socket transport on loopback, so hvdlite and the
peer (DDP, torch.distributed) both run on a real two-rank NCCL communicator. The GPU is
time-sliced between the processes and the bytes cross host sockets, so absolute figures say
nothing of NVLink; the ratio says what hvdlite adds on top of the same NCCL calls.
"""
from __future__ import annotations

import argparse
import contextlib
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
    p.add_argument("--top-mib", type=int, default=0,
                   help="largest allreduce of the bandwidth part (default: 16 MiB on the CPU, "
                        "256 MiB for ranks sharing a GPU, else 1 GiB)")
    args = p.parse_args()
    cpu = args.cpu_fallback
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        backend, shared, hostids = "gloo", False, False
    else:
        gpus = torch.cuda.device_count()
        local = hvd.local_rank() % gpus
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        shared = hvd.local_size() > gpus
        # Ranks sharing a GPU under their own NCCL_HOSTIDs: NCCL serves them (module doc).
        hosts = hvd.allgather_object(os.environ.get("NCCL_HOSTID"))
        hostids = shared and all(hosts) and len(set(hosts)) == size
        backend = "gloo" if shared and not hostids else "nccl"
    port = hvd.broadcast_object(free_port() if rank == 0 else None, root_rank=0)
    addr = os.environ.get("HVDLITE_STORE_ADDR", "127.0.0.1")
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=size)
    out = {"device": str(device), "ranks": size, "peer": f"torch.distributed {backend}",
           "gpu": None if cpu else torch.cuda.get_device_name(device),
           "torch": torch.__version__, "shared_gpu": not cpu and shared,
           "nccl_hostid": not cpu and hostids,
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
        a, b, c, d = [], [], [], []
        for _ in range(args.rounds):
            a.append(timed(hv_step, args.steps, device))
            b.append(timed(ddp_step, args.steps, device))
            c.append(timed(plain_step, args.steps, device))
            if not cpu:
                with async_completion():
                    d.append(timed(hv_step, args.steps, device))
        ratio, lo, hi = spread(a, b)
        floor, _, _ = spread(c, b)
        row = {"hvdlite_ms": statistics.median(a) * 1e3,
               "ddp_ms": statistics.median(b) * 1e3, "ratio": ratio,
               "ratio_min": lo, "ratio_max": hi,
               "no_comm_ms": statistics.median(c) * 1e3, "floor": floor}
        if d:
            aratio, alo, ahi = spread(d, b)
            row.update({"hvdlite_async_ms": statistics.median(d) * 1e3,
                        "ratio_async": aratio, "ratio_async_min": alo, "ratio_async_max": ahi})
        out["train"][name] = row

    # 2. Allreduce bus bandwidth.
    bus = 2 * (size - 1) / size
    top = (args.top_mib << 20) if args.top_mib else \
        (16 << 20) if cpu else (256 << 20) if shared else (1 << 30)
    nbytes = 1 << 20
    while size > 1 and nbytes <= top:
        t = torch.ones(nbytes // 4, device=device)
        n = max(3, min(50, (256 << 20) // nbytes))

        def hv():
            hvd.allreduce_(t, name=f"bw.{nbytes}", op=hvd.Sum)

        def raw():
            dist.all_reduce(t)

        def raw_waited():
            # What hvd.allreduce_ promises: the call returns with the result there. The raw
            # loop above queues its calls and waits once, so small sizes pipeline there.
            dist.all_reduce(t)
            sync(device)

        hv()
        raw()
        a, b, c, d = [], [], [], []
        for _ in range(args.rounds):
            a.append(timed(hv, n, device))
            b.append(timed(raw, n, device))
            c.append(timed(raw_waited, n, device))
            if not cpu:
                with async_completion():      # returns once queued, as raw's calls do
                    d.append(timed(hv, n, device))
        ratio, lo, hi = spread(b, a)     # bandwidth ratio = raw time / hvdlite time
        wratio, wlo, whi = spread(c, a)
        row = {"bytes": nbytes,
               "hvdlite_GBs": bus * nbytes / statistics.median(a) / 1e9,
               "raw_GBs": bus * nbytes / statistics.median(b) / 1e9,
               "ratio": ratio, "ratio_min": lo, "ratio_max": hi,
               "raw_waited_GBs": bus * nbytes / statistics.median(c) / 1e9,
               "ratio_waited": wratio, "ratio_waited_min": wlo, "ratio_waited_max": whi}
        if d:
            aratio, alo, ahi = spread(b, d)
            row.update({"hvdlite_async_GBs": bus * nbytes / statistics.median(d) / 1e9,
                        "ratio_async": aratio, "ratio_async_min": alo,
                        "ratio_async_max": ahi})
        out["busbw"].append(row)
        del t
        nbytes *= 4

    if rank == 0:
        what = "CPU fallback (gloo)" if cpu else f"GPU ({out['gpu']}, NCCL {out['nccl']})"
        note = (" sharing it, each its own NCCL_HOSTID (NCCL over loopback sockets, the GPU "
                "time-sliced)" if hostids else
                " sharing it (NCCL refuses: hvdlite stages through host memory)" if shared else "")
        print(f"== {what}: {size} rank(s) on {device}{note}, hvdlite against {out['peer']}, median of {args.rounds} alternating "
              f"rounds (spread = min-max of per-round ratios)")
        print(f"{'model':<12} {'hvdlite ms':>11} {'DDP ms':>9} {'hvdlite/DDP':>12} {'spread':>12}"
              f" {'no-comm ms':>11} {'floor':>6}")
        for name, r in out["train"].items():
            print(f"{name:<12} {r['hvdlite_ms']:>11.2f} {r['ddp_ms']:>9.2f} {r['ratio']:>12.2f} "
                  f"{r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} {r['no_comm_ms']:>11.2f} "
                  f"{r['floor']:>6.2f}")
        for name, r in out["train"].items():
            if "ratio_async" in r:
                print(f"{name:<12} with HOROVOD_ENABLE_ASYNC_COMPLETION=1: "
                      f"{r['hvdlite_async_ms']:.2f} ms, {r['ratio_async']:.2f} x DDP "
                      f"({r['ratio_async_min']:.2f}-{r['ratio_async_max']:.2f})")
        print("(no-comm: the same step without a wrapper or any communication; floor = "
              "no-comm / DDP, the least hvdlite/DDP can be)")
        print(f"{'bytes':>11} {'hvdlite GB/s':>13} {'raw GB/s':>9} {'hvdlite/raw':>12} "
              f"{'spread':>12} {'raw waited':>11} {'hvdlite/waited':>15} {'spread':>12}")
        if size == 1:
            print("(one rank: no bus bandwidth to measure)")
        for r in out["busbw"]:
            print(f"{r['bytes']:>11} {r['hvdlite_GBs']:>13.3f} {r['raw_GBs']:>9.3f} "
                  f"{r['ratio']:>12.2f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} "
                  f"{r['raw_waited_GBs']:>11.3f} {r['ratio_waited']:>15.2f} "
                  f"{r['ratio_waited_min']:>5.2f}-{r['ratio_waited_max']:<5.2f}")
        for r in out["busbw"]:
            if "ratio_async" in r:
                print(f"{r['bytes']:>11} with HOROVOD_ENABLE_ASYNC_COMPLETION=1 (calls queued, "
                      f"as raw's): {r['hvdlite_async_GBs']:.3f} GB/s, {r['ratio_async']:.2f} x "
                      f"raw ({r['ratio_async_min']:.2f}-{r['ratio_async_max']:.2f})")
        if out["busbw"]:
            print("(raw: torch.distributed calls queued back to back, one wait at the end; raw "
                  "waited: each call waited for, as hvd.allreduce_ returns with the result)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
    hvd.shutdown()


@contextlib.contextmanager
def async_completion():
    """hvdlite with HOROVOD_ENABLE_ASYNC_COMPLETION=1 (GPU collectives complete once queued),
    in the same processes as the default, so that the two alternate round by round: the
    setting is read at init(), and this switches the running engine's copy of it between
    timed rounds, when nothing is in flight."""
    from hvdlite.common import basics
    executor = basics._require().engine.executor
    executor.async_completion = True
    try:
        yield
    finally:
        executor.async_completion = False


def _clone(m: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(m)


if __name__ == "__main__":
    main()
