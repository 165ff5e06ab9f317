"""hvdlite on Ray against hvdlite-run's Python API, same function, same machine.

    python benchmarks/ray_executor.py [--rounds 5] [--workers 2]

Each round (A B A B ...) runs the same job once under `hvdlite.runner.run(fn, np=N)` and once
under `RayExecutor(num_workers=N)` on a local Ray started once (`ray.init(num_cpus=N)`, no
dashboard). Two figures per launcher:

- job time: from the call to the results on the driver (for Ray: start() + run() + shutdown());
- in-worker allreduce time: median of 50 allreduces of 1 MiB measured inside the workers after
  a warm-up, i.e. the engine's steady state. Ray only places and starts the processes, so this
  should match; the job time shows what Ray's actors and placement cost per job.

Prints medians over the rounds, the spread (min-max) and the ratio Ray / hvdlite-run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def job(iters: int = 50) -> float:
    import torch

    import hvdlite.torch as hvd

    hvd.init()
    t = torch.ones(256 * 1024)  # 1 MiB of float32
    for _ in range(10):
        hvd.allreduce(t, name="warm")
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        hvd.allreduce(t, name="bench")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()

    import ray

    from hvdlite.ray import RayExecutor
    from hvdlite.runner import api

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    results: dict[str, dict[str, list[float]]] = {"hvdlite-run": {"job": [], "allreduce": []},
                                                  "ray": {"job": [], "allreduce": []}}
    for r in range(args.rounds):
        t0 = time.perf_counter()
        got = api.run(job, np=args.workers)
        results["hvdlite-run"]["job"].append(time.perf_counter() - t0)
        results["hvdlite-run"]["allreduce"].append(statistics.median(got))

        t0 = time.perf_counter()
        ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=args.workers)
        ex.start()
        got = ex.run(job)
        ex.shutdown()
        results["ray"]["job"].append(time.perf_counter() - t0)
        results["ray"]["allreduce"].append(statistics.median(got))
        print(f"round {r}: hvdlite-run job {results['hvdlite-run']['job'][-1]:.2f} s, "
              f"allreduce {results['hvdlite-run']['allreduce'][-1] * 1e3:.2f} ms | ray job "
              f"{results['ray']['job'][-1]:.2f} s, allreduce "
              f"{results['ray']['allreduce'][-1] * 1e3:.2f} ms", flush=True)
    ray.shutdown()
    print(f"\n{args.workers} workers, {args.rounds} alternating rounds (median, min-max)")
    for what, unit, scale in (("job", "s", 1.0), ("allreduce", "ms", 1e3)):
        a, b = results["hvdlite-run"][what], results["ray"][what]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{what:10s} hvdlite-run {ma * scale:8.2f} {unit} ({min(a) * scale:.2f}-"
              f"{max(a) * scale:.2f})   ray {mb * scale:8.2f} {unit} ({min(b) * scale:.2f}-"
              f"{max(b) * scale:.2f})   ray/hvdlite-run {mb / ma:.2f}")


if __name__ == "__main__":
    main()
