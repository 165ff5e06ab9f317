"""Cross-host figures on a namespaced cluster with 1 Gbit/s links (tests/cluster.py; needs root).

    sudo .venv/bin/python benchmarks/cluster.py [--json out.json] [--rate 1gbit] [--rounds 5]

Builds login + 2 hosts (network namespaces, own eth0 on a bridge, tbf-shaped to --rate in both
directions, sshd each), then runs, from the login host over real ssh:
  1. benchmarks/allreduce.py on 2 hosts x 1 rank, 1-64 MiB: hvdlite against the raw torch gloo
     process group in the same processes (alternating rounds; bus bandwidth, ratio and spread);
  2. benchmarks/hierarchical.py on 2 hosts x 2 ranks, 4-64 MiB: hierarchical against flat
     allreduce in the same processes (alternating rounds), hier/flat time and spread;
  3. partition recovery: an elastic job (tests/workers/elastic_train.py, a commit every step) on
     3 hosts; a worker host's link, then rank 0's host's link, is cut (alternating, --partitions
     times each) and healed once the job is back at size 3: the time from the cut to the
     driver naming the host, and to the next committed step at size 2 (median, spread).
What these do not model: latency and loss (this kernel has no netem), and compute: every host
shares this machine's cores, so any figure that needs CPU (the reductions, hierarchical's local
steps, compression) is bounded by that, not by the link; pure link transfers are not.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import cluster as cl

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
    p.add_argument("--partitions", type=int, default=5, help="cuts of each kind (0: none)")
    p.add_argument("--parts", default="allreduce,hierarchical,partition")
    p.add_argument("--stall", type=int, default=6, help="stall shutdown time, seconds")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvdlite-cluster-bench-"))
    result: dict = {"rate": a.rate}
    parts = a.parts.split(",")
    with cl.Cluster(2, workdir=work / "cluster") as c:
        c.rate_all(a.rate)
        if "allreduce" in parts:
            ar = work / "allreduce.json"
            run_bench(c, ["-np", 2, "-H", c.hosts_arg(1), PY, BENCH / "allreduce.py",
                          "--min-bytes", 1 << 20, "--max-bytes", 64 << 20,
                          "--rounds", a.rounds, "--json", ar], env={"HVDLITE_SHM": "0"})
            result["allreduce"] = json.loads(ar.read_text())
        if "hierarchical" in parts:
            hier = work / "hierarchical.json"
            run_bench(c, ["-np", 4, "-H", c.hosts_arg(2), PY, BENCH / "hierarchical.py",
                          "--sizes", f"{4 << 20},{16 << 20},{64 << 20}", "--rounds", a.rounds,
                          "--json", hier], env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"})
            result["hierarchical"] = json.loads(hier.read_text())
    if "partition" in parts and a.partitions:
        result["partition"] = partition_recovery(work, a.partitions, a.stall)
    report(result, a.rounds)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


def partition_recovery(work: Path, n: int, stall: int) -> dict:
    """Cut a worker host and rank 0's host alternately, n times each; see the module doc."""
    import time

    from test_cluster import ClusterJob
    from test_elastic import worker_env

    env = {**worker_env(10 ** 6, delay=0.05), "ELASTIC_COMMIT_EVERY": "1"}
    times: dict = {"worker": [], "rank0": [], "named_worker": [], "named_rank0": []}
    with cl.Cluster(3, workdir=work / "partition") as c:
        c.rate_all("1gbit")
        nodes = [h.name for h in c.nodes]
        job = ClusterJob(c, work / "partition", [f"{h}:1" for h in nodes],
                         ["-np", 3, "--min-np", 2, "--max-np", 3,
                          "--blacklist-cooldown-range", 2, 3,
                          "--stall-check-warning-time-seconds", max(1, stall // 2),
                          "--stall-check-shutdown-time-seconds", stall], env)
        try:
            for i in range(2 * n):
                kind = "worker" if i % 2 == 0 else "rank0"
                deadline = time.monotonic() + 180
                while not all(job.progress(f"{h}:0")[1] == 3 for h in nodes):
                    if time.monotonic() > deadline:
                        raise SystemExit("the job did not get back to 3 hosts:\n"
                                         + job.err_text()[-3000:])
                    time.sleep(0.1)
                ranks = {h: job.progress(f"{h}:0")[2] for h in nodes}
                victim = min(nodes, key=lambda h: ranks[h]) if kind == "rank0" \
                    else max(nodes, key=lambda h: ranks[h])
                observer = next(h for h in nodes if h != victim)
                seen = len(job.stderr)
                t0 = time.monotonic()
                c.partition(victim)
                named = None
                while job.progress(f"{observer}:0")[1] != 2:
                    if named is None and any(f"worker {victim}:0" in line and "hung" in line
                                             for line in job.stderr[seen:]):
                        named = time.monotonic() - t0
                    if time.monotonic() - t0 > 120:
                        raise SystemExit("no recovery:\n" + job.err_text()[-3000:])
                    time.sleep(0.02)
                times[kind].append(time.monotonic() - t0)
                times[f"named_{kind}"].append(named if named is not None else float("nan"))
                c.heal(victim)
                print(f"partition {i + 1}/{2 * n} ({kind}, {victim}): next committed step "
                      f"after {times[kind][-1]:.2f} s, host named after {named or 0:.2f} s",
                      flush=True)
        finally:
            job.kill()
            (work / "partition" / "driver.log").write_text(job.err_text())
    return {"stall_s": stall, **times}


def report(result: dict, rounds: int) -> None:
    a = argparse.Namespace(rate=result["rate"], rounds=rounds)
    print(f"\n== cross-host allreduce, 2 hosts x 1 rank, {a.rate} links (medians of "
          f"{a.rounds} alternating rounds; spread min-max)")
    print(f"{'size':>8} {'hvdlite GB/s':>22} {'raw gloo GB/s':>22} {'hvdlite/raw':>20}")
    for row in result.get("allreduce", {}).get("sizes", []):
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
    for row in result.get("hierarchical", {}).get("rows", []):
        print(f"{row['bytes'] >> 20:>5} MiB {row['hier_ms']:>9.1f} "
              f"[{row['hier_spread_ms'][0]:.1f}-{row['hier_spread_ms'][1]:.1f}] "
              f"{row['flat_ms']:>9.1f} [{row['flat_spread_ms'][0]:.1f}-"
              f"{row['flat_spread_ms'][1]:.1f}] {1 / row['ratio']:>10.2f}")
    part = result.get("partition")
    if part:
        import statistics
        print(f"\n== partition -> next committed step at size 2, elastic job on 3 hosts, stall "
              f"shutdown time {part['stall_s']} s ({len(part['worker'])} cuts of each kind)")
        for kind, what in (("worker", "a worker host"), ("rank0", "rank 0's host")):
            t = part[kind]
            named = [x for x in part[f"named_{kind}"] if not math.isnan(x)] or [float("nan")]
            print(f"{what:>14}: {statistics.median(t):6.2f} s [{min(t):.2f}-{max(t):.2f}]; "
                  f"named hung after {statistics.median(named):.2f} s")
    print("\nBounded by the shared cores: hierarchical's local reduce/broadcast steps (all four "
          "ranks on this machine's cores); the link-bound figures are the 2 x 1 allreduce rows.")


if __name__ == "__main__":
    main()
