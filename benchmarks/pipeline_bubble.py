"""Pipeline bubble: hvdlite's Pipeline against torch.distributed.pipelining (gloo), same run.

    hvdlite-run -np 2 python benchmarks/pipeline_bubble.py [--chunks 1,2,4,8]
                [--schedules gpipe,1f1b] [--hidden 512] [--layers 4] [--micro-batch 32]

Every rank is one stage of the same MLP (`--layers` Linear+Tanh blocks of width `--hidden` per
stage); a step pushes `chunks` micro-batches of `--micro-batch` rows through it, so the work per
micro-batch stays fixed while m grows. For each schedule and m, hvdlite and torch's
PipelineStage + ScheduleGPipe / Schedule1F1B run in the same processes, alternating A B A B over
`--rounds` rounds. Reported, per configuration:

* formula: GPipe's idle fraction (p-1)/(m+p-1), for equal stage times and free communication;
* simulated: hvdlite's schedule simulator fed with each stage's forward/backward time measured
  alone (no communication), re-measured in every round;
* hvdlite bubble (measured): mean over stages of 1 - (time this stage spent computing during
  the step) / (step time), from the pipeline's own per-action timings;
* hvdlite / torch bubble (vs solo): 1 - m * (t_f + t_b measured on the stage alone, no
  communication) / step time, the same yardstick for both;
* median step times and their ratio (below 1.0: hvdlite is faster).
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hvdlite.torch as hvd  # noqa: E402
from bench_util import free_port  # noqa: E402
from hvdlite.torch import parallel as P  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", default="1,2,4,8", help="micro-batch counts m")
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="Linear+Tanh blocks per stage")
    p.add_argument("--micro-batch", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round and contender")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    p.add_argument("--json", default=None, help="write results here (rank 0)")
    return p.parse_args()


def stage_layers(hidden: int, layers: int) -> list:
    out = []
    for _ in range(layers):
        out += [nn.Linear(hidden, hidden), nn.Tanh()]
    return out


def solo_times(module: nn.Module, hidden: int, rows: int, reps: int = 5) -> tuple[float, float]:
    """Forward and backward seconds of one micro-batch on this stage alone."""
    x = torch.randn(rows, hidden, requires_grad=True)
    tf, tb = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        y = module(x)
        t1 = time.perf_counter()
        torch.autograd.grad(y, [x] + list(module.parameters()), torch.ones_like(y))
        t2 = time.perf_counter()
        tf.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(tf[1:]), statistics.median(tb[1:])



def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    hvd.init(process_sets="dynamic")
    rank, p = hvd.rank(), hvd.size()
    use_torch = not args.no_torch
    if use_torch:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        port = hvd.broadcast_object(free_port() if rank == 0 else None, root_rank=0)
        addr = os.environ.get("HVDLITE_STORE_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=p)
        torch_sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    mesh = P.mesh(pp=p)
    h, rows = args.hidden, args.micro_batch
    torch.manual_seed(0)
    all_layers = stage_layers(h, args.layers * p)
    lo, hi = 2 * args.layers * rank, 2 * args.layers * (rank + 1)
    t_f, t_b = solo_times(nn.Sequential(*all_layers[lo:hi]), h, rows)
    tfs = hvd.allgather_object((t_f, t_b), name="bench.solo")
    results = []
    if rank == 0:
        print(f"pipeline bubble: {p} stages, {args.layers} x Linear({h},{h})+Tanh per stage, "
              f"{rows} rows per micro-batch, torch threads {args.threads}", flush=True)
        print("solo t_f / t_b per stage (ms): "
              + ", ".join(f"{a * 1e3:.1f}/{b * 1e3:.1f}" for a, b in tfs), flush=True)
        head = (f"{'schedule':>8} {'m':>3} {'formula':>8} {'simulated':>9} {'hvd meas':>9} "
                f"{'hvd solo':>9} {'hvd ms':>8}")
        if use_torch:
            head += f" {'torch solo':>10} {'torch ms':>9} {'hvd/torch':>9}"
        print(head, flush=True)
    for sched in args.schedules.split(","):
        for m in [int(c) for c in args.chunks.split(",")]:
            x = torch.randn(m * rows, h)
            y = torch.randn(m * rows, h)
            torch.manual_seed(1)
            layers = stage_layers(h, args.layers * p)
            pipe = P.Pipeline(layers, chunks=m, schedule=sched, process_set=mesh.pp)

            def hv_step():
                pipe.zero_grad(set_to_none=True)
                hvd.barrier()
                pipe.train_step(x, y, F.mse_loss)
                st = pipe.last_stats
                return st.wall, st.compute

            run_torch = use_torch
            if use_torch:
                torch.manual_seed(1)
                tl = stage_layers(h, args.layers * p)
                tmod = nn.Sequential(*tl[lo:hi])
                stage = PipelineStage(tmod, rank, p, torch.device("cpu"))
                try:
                    tsched = torch_sched[sched](stage, n_microbatches=m,
                                                loss_fn=lambda o, t: F.mse_loss(o, t))
                except ValueError:                 # e.g. Schedule1F1B refuses m < p
                    run_torch = False

                def torch_step():
                    tmod.zero_grad(set_to_none=True)
                    hvd.barrier()
                    t0 = time.perf_counter()
                    if rank == 0:
                        tsched.step(x)
                    elif rank == p - 1:
                        tsched.step(target=y, losses=[])
                    else:
                        tsched.step()
                    return time.perf_counter() - t0

                if run_torch:
                    torch_step()                   # shape inference, warm-up
            hv_step()
            hv_walls, hv_busy, th_walls, solo = [], [], [], []
            local = nn.Sequential(*[pipe.layers[k] for k in pipe.layers])
            for _ in range(args.rounds):
                # Re-measured every round: on a shared machine the solo time drifts too.
                solo.append(solo_times(local, h, rows, reps=3))
                for _ in range(args.steps):
                    wall, busy = hv_step()
                    hv_walls.append(wall)
                    hv_busy.append(busy)
                if run_torch:
                    for _ in range(args.steps):
                        th_walls.append(torch_step())
            mine = {"t_f": statistics.median(a for a, _ in solo),
                    "t_b": statistics.median(b for _, b in solo),
                    "hv_wall": statistics.median(hv_walls),
                    "hv_idle": statistics.median(1 - b / w for b, w in zip(hv_busy, hv_walls)),
                    "th_wall": statistics.median(th_walls) if th_walls else None}
            every = hvd.allgather_object(mine, name=f"bench.{sched}.{m}")
            if rank == 0:
                hv_ms = max(e["hv_wall"] for e in every)
                solo = [m * (e["t_f"] + e["t_b"]) for e in every]
                sim = pipe.simulate([e["t_f"] for e in every], [e["t_b"] for e in every]).bubble
                row = {"schedule": sched, "m": m, "formula": P.bubble_formula(p, m),
                       "t_f_ms": [e["t_f"] * 1e3 for e in every],
                       "t_b_ms": [e["t_b"] * 1e3 for e in every],
                       "simulated": sim,
                       "hvd_measured": statistics.mean(e["hv_idle"] for e in every),
                       "hvd_vs_solo": statistics.mean(1 - s / hv_ms for s in solo),
                       "hvd_ms": hv_ms * 1e3}
                line = (f"{sched:>8} {m:>3} {row['formula']:>8.1%} {sim:>9.1%} "
                        f"{row['hvd_measured']:>9.1%} {row['hvd_vs_solo']:>9.1%} "
                        f"{row['hvd_ms']:>8.1f}")
                if use_torch and not run_torch:
                    line += f" {'refused m<p':>10}"
                elif use_torch:
                    th_ms = max(e["th_wall"] for e in every)
                    row.update({"torch_vs_solo": statistics.mean(1 - s / th_ms for s in solo),
                                "torch_ms": th_ms * 1e3, "ratio": hv_ms / th_ms})
                    line += (f" {row['torch_vs_solo']:>10.1%} {row['torch_ms']:>9.1f} "
                             f"{row['ratio']:>9.2f}")
                print(line, flush=True)
                results.append(row)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"stages": p, "args": vars(args), "solo": tfs, "results": results}, f,
                      indent=1)
    if use_torch:
        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
