"""Calls that used to leave the steady state, against their peers, in the same processes.

    hvdlite-run -np 2 python benchmarks/steady_paths.py [--rounds 7] [--json out.json]
    mpiexec -n 2 python benchmarks/steady_paths.py       # MPI transport against raw mpi4py

Each of these once sent its process set back to the coordinator on rank 0 on every call, and
with it every collective until the set was steady again. Rounds alternate A B A B; the table
gives medians and the spread of the per-round ratios.
- grouped: one blocking `grouped_allreduce_` of 27 small tensors (a model's gradients as one
  group) against the raw transport reducing them one by one;
- metrics: one blocking `grouped_allreduce` of two one-element metrics (a loss and an
  accuracy, summed) against the raw transport reducing them one by one: the steady state's
  round carries both (engine.Engine._carry);
- barrier: `hvd.barrier()` against the raw transport's barrier;
- unnamed: a step of ten async gradient allreduces and a blocking loss allreduce without a
  name against the same step with the loss named (the peer: the steady state's own speed);
- unnamed_metrics: the same ten allreduces, then two metrics averaged by one blocking
  `grouped_allreduce` and the predictions gathered by `allgather`, both without names, against
  the same step with them named.
"""
from __future__ import annotations


import torch

import hvdlite.torch as hvd
from allreduce import RawGloo, RawMPI
from bench_util import alternate, paired_args, report_paired


def main():
    args = paired_args(__doc__, rounds=7, calls=50)
    hvd.init()
    torch.set_num_threads(1)
    raw = RawMPI() if hvd.mpi_enabled() else RawGloo()

    grads = [torch.ones(1000 + 37 * i) for i in range(27)]

    def grouped():
        hvd.grouped_allreduce_(grads, name="paths.grouped", op=hvd.Sum)

    def raw_one_by_one():
        for t in grads:
            raw.allreduce(t)

    pair = [torch.ones(1), torch.ones(1)]

    def metrics_pair():
        hvd.grouped_allreduce(pair, name="paths.pair", op=hvd.Sum)

    def raw_pair():
        for t in pair:
            raw.allreduce(t)

    step_grads = [torch.ones(20000) for _ in range(10)]
    loss = torch.ones(1)

    def gradients():
        handles = [hvd.allreduce_async_(g, name=f"paths.g{i}") for i, g in enumerate(step_grads)]
        for h in handles:
            hvd.synchronize(h)

    def step(named: bool):
        gradients()
        if named:
            hvd.allreduce(loss, name="paths.loss")
        else:
            hvd.allreduce(loss)

    metrics = [torch.ones(1), torch.ones(1)]
    preds = torch.ones(64, 10)

    def metrics_step(named: bool):
        gradients()
        if named:
            hvd.grouped_allreduce(metrics, name="paths.metrics")
            hvd.allgather(preds, name="paths.preds")
        else:
            hvd.grouped_allreduce(metrics)
            hvd.allgather(preds)

    rows = {
        "grouped": ("grouped_allreduce_ of 27 tensors (4-18 KiB)", "raw, one by one",
                    alternate(grouped, raw_one_by_one, args.calls, args.rounds)),
        "metrics": ("grouped_allreduce of 2 metrics", "raw, one by one",
                    alternate(metrics_pair, raw_pair, args.calls, args.rounds)),
        "barrier": ("hvd.barrier()", f"raw {raw.name} barrier",
                    alternate(hvd.barrier, raw.barrier, args.calls, args.rounds)),
        "unnamed": ("step with an unnamed loss allreduce", "the same step, loss named",
                    alternate(lambda: step(False), lambda: step(True), args.calls,
                              args.rounds)),
        "unnamed_metrics": ("step, unnamed grouped_allreduce + allgather",
                            "the same step, both named",
                            alternate(lambda: metrics_step(False), lambda: metrics_step(True),
                                      args.calls, args.rounds)),
    }
    if hvd.rank() == 0:
        report_paired(f"steady-state paths, {hvd.size()} ranks, {raw.name}, medians of "
                      f"{args.rounds} alternating rounds of {args.calls} calls (spread: min-max "
                      f"of per-round ratios)", rows, args.json,
                      {"ranks": hvd.size(), "transport": raw.name})
    hvd.shutdown()


if __name__ == "__main__":
    main()
