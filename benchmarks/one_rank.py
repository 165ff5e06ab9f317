"""Collectives in a one-rank job (a Horovod script run as `python train.py`) against torch's.

    python benchmarks/one_rank.py [--json out.json]
    HVDLITE_STEADY_STATE=0 python benchmarks/one_rank.py    # every call through the coordinator

A one-rank job still runs every collective through hvdlite's engine, so a script written for
many ranks (metric averaging, broadcast_parameters, an elastic job shrunk to one worker) runs
unchanged. Its peer here is a torch.distributed gloo process group of one rank, the same calls
made on it, in the same process, alternating A B over several rounds: synchronous allreduces of
4 KiB and 1 MiB, then 100 async allreduces of 4-256 KiB waited for together. The floor of any
one-rank allreduce in place is doing nothing; of an out-of-place one, a copy.
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.distributed as dist

import hvdlite.torch as hvd
from bench_util import alternate, hvdlite_async_all, many_small_tensors
from hvdlite.common import basics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    if hvd.size() != 1:
        raise SystemExit("one_rank.py measures a one-rank job: run it with plain python")
    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))

    rows = []
    for nbytes in (4 << 10, 1 << 20):
        x = torch.ones(nbytes // 4)
        name = f"one.{nbytes}"
        n = 2000 if nbytes <= 64 << 10 else 300

        def hv():
            hvd.allreduce_(x, name=name, op=hvd.Sum)

        def raw():
            pg.allreduce([x]).wait()

        rows.append(_rounds(f"allreduce_ {nbytes} B", hv, raw, n, args.rounds))

    tensors = many_small_tensors()
    hv_many = hvdlite_async_all(hvd, tensors, "one.many")

    def raw_many():
        works = [pg.allreduce([t]) for t in tensors]
        for w in works:
            w.wait()

    rows.append(_rounds("100 async allreduce_ 4-256 KiB", hv_many, raw_many, 10, args.rounds))

    steady = basics.engine_counters()["steady_entered"] > 0
    print(f"one-rank job, median of {args.rounds} alternating rounds (spread: min-max of the "
          f"per-round ratios); hvdlite's steady state {'on' if steady else 'off'}")
    print(f"{'what':<34} {'hvdlite us':>11} {'gloo us':>9} {'hvdlite/gloo':>13} {'spread':>11}")
    for r in rows:
        print(f"{r['what']:<34} {r['hvdlite_us']:>11.1f} {r['raw_us']:>9.1f} "
              f"{r['ratio']:>13.2f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steady_state": steady, "rows": rows}, f, indent=1)
    hvd.shutdown()


def _rounds(what: str, hv, raw, n: int, rounds: int) -> dict:
    row = alternate(hv, raw, n, rounds)
    return {"what": what, "hvdlite_us": row["hvdlite_us"], "raw_us": row["peer_us"],
            "ratio": row["ratio"], "ratio_min": row["ratio_min"], "ratio_max": row["ratio_max"]}


if __name__ == "__main__":
    main()
