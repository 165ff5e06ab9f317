"""Hierarchical against flat allreduce, through hvdlite's API, in the same processes.

    HOROVOD_HIERARCHICAL_ALLREDUCE=1 hvdlite-run -np 4 -H localhost:2,127.0.0.1:2 \
        python benchmarks/hierarchical.py [--json out.json]

With the variable set, allreduce on the global set takes the hierarchical path (reduce within
each host, allreduce across hosts among local rank 0s, broadcast within each host); a process set
holding every rank keeps the flat path. For each size: median time of A (hierarchical) and
B (flat) over alternating rounds A B A B, each round `iters` calls, and the spread (min-max of the
rounds). On one machine the "hosts" share memory and loopback, so this measures the cost of the
extra steps, not the gain on a real cross-host link.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hvdlite.torch as hvd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,262144,4194304,16777216", help="bytes, comma separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    everyone = hvd.ProcessSet(list(range(int(__import__("os").environ["HOROVOD_SIZE"]))))
    hvd.init(process_sets=[everyone])
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = torch.ones(nbytes // 4)
        iters = max(3, min(100, (16 << 20) // nbytes))
        hier, flat = [], []
        for i in range(args.rounds + 1):  # round 0 warms up (connections, cache)
            for out, ps in ((hier, hvd.global_process_set), (flat, everyone)):
                hvd.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    y = hvd.allreduce(x, op=hvd.Sum, name=f"b{nbytes}", process_set=ps)
                if i:
                    out.append((time.perf_counter() - t0) / iters)
            assert y[0].item() == hvd.size()
        row = {"bytes": nbytes, "hier_ms": statistics.median(hier) * 1e3,
               "flat_ms": statistics.median(flat) * 1e3,
               "hier_spread_ms": [min(hier) * 1e3, max(hier) * 1e3],
               "flat_spread_ms": [min(flat) * 1e3, max(flat) * 1e3]}
        row["ratio"] = row["hier_ms"] / row["flat_ms"]
        rows.append(row)
        if hvd.rank() == 0:
            print(f"{nbytes:>10} B  hierarchical {row['hier_ms']:8.2f} ms "
                  f"[{row['hier_spread_ms'][0]:.2f}-{row['hier_spread_ms'][1]:.2f}]  "
                  f"flat {row['flat_ms']:8.2f} ms "
                  f"[{row['flat_spread_ms'][0]:.2f}-{row['flat_spread_ms'][1]:.2f}]  "
                  f"hier/flat {row['ratio']:.2f}", flush=True)
    if hvd.rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": hvd.size(), "hosts": hvd.cross_size(), "rows": rows}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
