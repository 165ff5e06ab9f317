"""Small pieces the benchmark scripts share (run as `python benchmarks/<name>.py`, so this
directory is on sys.path)."""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def free_port() -> int:
    """A TCP port free on this host now, for the peer's torch.distributed store (rank 0 picks
    it and broadcasts it with hvd.broadcast_object)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_with_torch_gloo(hvd, threads: int) -> tuple[int, int]:
    """hvd.init(), then torch.distributed's gloo group over the same ranks, for the peer that
    runs in the same processes (DDP, torch's fully_shard, ZeroRedundancyOptimizer). Returns
    (rank, size)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(free_port() if rank == 0 else None, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    return rank, size


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
             y: torch.Tensor) -> Callable[[], None]:
    """One classification training step, the same work for every contender."""
    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def timed(fn: Callable[[], None], n: int) -> float:
    """Mean seconds per call of `fn` over `n` back-to-back calls (one round of a benchmark)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def paired_args(doc: str, rounds: int, calls: int) -> argparse.Namespace:
    """The command line of a benchmark whose rows `alternate` times: --rounds, --calls (per
    round) and --json (where to write the rows)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--calls", type=int, default=calls, help="calls per round")
    p.add_argument("--json", default=None)
    return p.parse_args()


def report_paired(title: str, rows: dict, path: Optional[str], extra: dict,
                  label: str = "hvdlite us") -> None:
    """Print rows that `alternate` timed (key -> (what, peer, its result)) as a table under
    `title`, and write them with `extra` to `path` as JSON (report.py reads the rows)."""
    w = max(len(what) for what, _, _ in rows.values()) + 2
    pw = max(len(peer) for _, peer, _ in rows.values()) + 2
    n = len(label)
    print(title)
    print(f"{'call':<{w}} {label:>{n}} {'peer':<{pw}} {'peer us':>9} {'ratio':>6} {'spread':>11}")
    for what, peer, r in rows.values():
        print(f"{what:<{w}} {r['hvdlite_us']:>{n}.1f} {peer:<{pw}} {r['peer_us']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f}")
    if path:
        with open(path, "w") as f:
            json.dump(dict(extra, rows={k: dict(r, what=what, peer=peer)
                                        for k, (what, peer, r) in rows.items()}), f, indent=1)


def alternate(hv: Callable[[], None], peer: Callable[[], None], n: int, rounds: int) -> dict:
    """hvdlite's call against its peer: one warm-up each, then `rounds` alternating rounds of
    `n` calls. Median µs per call of each, their ratio, and the min-max of the per-round
    ratios."""
    hv()
    peer()
    a, b = [], []
    for _ in range(rounds):
        a.append(timed(hv, n))
        b.append(timed(peer, n))
    per_round = [x / y for x, y in zip(a, b)]
    return {"hvdlite_us": statistics.median(a) * 1e6, "peer_us": statistics.median(b) * 1e6,
            "ratio": statistics.median(a) / statistics.median(b),
            "ratio_min": min(per_round), "ratio_max": max(per_round)}


def many_small_tensors(n: int = 100, seed: int = 0) -> list[torch.Tensor]:
    """The fusion benchmarks' tensors: n float32 tensors of 4-256 KiB, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(1 << 10, 64 << 10, (n,), generator=g)]
    return [torch.ones(s) for s in sizes]


def hvdlite_async_all(hvd, tensors: list[torch.Tensor], prefix: str) -> Callable[[], None]:
    """Submit an in-place Sum allreduce of every tensor, then wait for them all: how an
    optimizer's hooks use hvdlite, and what fusion batches."""
    def run() -> None:
        handles = [hvd.allreduce_async_(t, name=f"{prefix}.{i}", op=hvd.Sum)
                   for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)
    return run
