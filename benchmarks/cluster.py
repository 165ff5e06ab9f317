"""Cross-host figures on a namespaced cluster with 1 Gbit/s links (tests/cluster.py; needs root).

    sudo .venv/bin/python benchmarks/cluster.py [--json out.json] [--rate 1gbit] [--rounds 5]

Builds login + 2 hosts (network namespaces, own eth0 on a bridge, tbf-shaped to --rate in both
directions, sshd each), then runs, from the login host over real ssh:
  1. benchmarks/allreduce.py on 2 hosts x 1 rank, 1-64 MiB: hvdlite against the raw torch gloo
     process group in the same processes (alternating rounds; bus bandwidth, ratio and spread);
  2. benchmarks/hierarchical.py on 2 hosts x 2 ranks, 4-64 MiB: hierarchical against flat
     allreduce in the same processes (alternating rounds), hier/flat time and spread.
What these do not model: latency and loss (this kernel has no netem), and compute: every host
shares this machine's cores, so any figure that needs CPU (the reductions, hierarchical's local
steps, compression) is bounded by that, not by the link; pure link transfers are not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import cluster as cl  # noqa: E402  (the test suite's cluster fixture)

PY = sys.executable
BENCH = ROOT / "benchmarks"


def run_bench(c: cl.Cluster, args: list, env: dict | None = None, timeout: float = 900) -> None:
    out = c.hvdlite_run(args, env={"PYTHONPATH": f"{BENCH}{os.pathsep}{ROOT}", **(env or {})},
                        timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"benchmark failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvdlite-cluster-bench-"))
    result: dict = {"rate": a.rate}
    with cl.Cluster(2, workdir=work / "cluster") as c:
        c.rate_all(a.rate)
        ar = work / "allreduce.json"
        run_bench(c, ["-np", 2, "-H", c.hosts_arg(1), PY, BENCH / "allreduce.py",
                      "--min-bytes", 1 << 20, "--max-bytes", 64 << 20, "--rounds", a.rounds,
                      "--json", ar], env={"HVDLITE_SHM": "0"})
        result["allreduce"] = json.loads(ar.read_text())
        hier = work / "hierarchical.json"
        run_bench(c, ["-np", 4, "-H", c.hosts_arg(2), PY, BENCH / "hierarchical.py",
                      "--sizes", f"{4 << 20},{16 << 20},{64 << 20}", "--rounds", a.rounds,
                      "--json", hier], env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"})
        result["hierarchical"] = json.loads(hier.read_text())
    report(result, a.rounds)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


def report(result: dict, rounds: int) -> None:
    a = argparse.Namespace(rate=result["rate"], rounds=rounds)
    print(f"\n== cross-host allreduce, 2 hosts x 1 rank, {a.rate} links (medians of "
          f"{a.rounds} alternating rounds; spread min-max)")
    print(f"{'size':>8} {'hvdlite GB/s':>22} {'raw gloo GB/s':>22} {'hvdlite/raw':>20}")
    for row in result["allreduce"]["sizes"]:
        if row["bytes"] < 1 << 20:
            continue
        print(f"{row['bytes'] >> 20:>5} MiB "
              f"{row['hvdlite_busbw_GBs']:>7.3f} [{row['hvdlite_busbw_min']:.3f}-"
              f"{row['hvdlite_busbw_max']:.3f}] "
              f"{row['raw_busbw_GBs']:>7.3f} [{row['raw_busbw_min']:.3f}-"
              f"{row['raw_busbw_max']:.3f}] "
              f"{row['ratio_bw']:>6.3f} [{row['ratio_bw_min']:.3f}-{row['ratio_bw_max']:.3f}]")
    print(f"\n== hierarchical against flat allreduce, 2 hosts x 2 ranks, {a.rate} links")
    print(f"{'size':>8} {'hierarchical ms':>24} {'flat ms':>24} {'flat/hier (speed-up)':>21}")
    for row in result["hierarchical"]["rows"]:
        print(f"{row['bytes'] >> 20:>5} MiB {row['hier_ms']:>9.1f} "
              f"[{row['hier_spread_ms'][0]:.1f}-{row['hier_spread_ms'][1]:.1f}] "
              f"{row['flat_ms']:>9.1f} [{row['flat_spread_ms'][0]:.1f}-"
              f"{row['flat_spread_ms'][1]:.1f}] {1 / row['ratio']:>10.2f}")
    print("\nBounded by the shared cores: hierarchical's local reduce/broadcast steps (all four "
          "ranks on this machine's cores); the link-bound figures are the 2 x 1 allreduce rows.")


if __name__ == "__main__":
    main()
