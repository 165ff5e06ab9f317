"""What a large transfer does to the Python around a collective: one small allreduce timed with
warm caches and right after the process has streamed a large buffer through memory.

    mpiexec -n 2 python benchmarks/cold_cache.py [--stream-mib 64] [--json out.json]
    hvdlite-run -np 2 python benchmarks/cold_cache.py          # gloo

Why: hvdlite's 16 MiB allreduce on MPI runs the transport call at raw speed, yet the whole call
falls short of raw mpi4py by a few hundred microseconds. The extra is the Python that names,
validates, agrees on and completes the collective, and that Python runs several times slower
right after 16 MiB have gone through the caches than in a loop of small calls. This benchmark
shows that effect on its own: the same 4 KiB allreduce (hvdlite and the raw transport), each
call after a barrier, either directly ("warm") or after copying `--stream-mib` MiB ("after
streaming"), alternating over rounds. It prints the medians, the spread over rounds, and how
much slower each gets.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hvdlite.torch as hvd
from allreduce import RawGloo, RawMPI


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=4 << 10, help="size of the timed allreduce")
    p.add_argument("--stream-mib", type=int, default=64,
                   help="MiB copied through memory before each cold call")
    p.add_argument("--calls", type=int, default=40, help="timed calls per round and mode")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    raw = RawMPI() if hvd.mpi_enabled() else RawGloo()
    x = torch.ones(args.bytes // 4)
    half = args.stream_mib * (1 << 20) // 8          # float32 elements in each of two halves
    src, dst = torch.ones(half), torch.zeros(half)
    barrier = torch.zeros(1)

    def sync() -> None:
        raw.allreduce(barrier)                       # the ranks start each call together

    def hv() -> None:
        hvd.allreduce_(x, name="cold_cache", op=hvd.Sum)

    def rw() -> None:
        raw.allreduce(x)

    def one_round(fn, stream: bool) -> float:
        times = []
        for _ in range(args.calls):
            if stream:
                dst.copy_(src)                       # read and write stream_mib MiB in all
            sync()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    cases = [("hvdlite", hv, False), ("hvdlite", hv, True), ("raw", rw, False), ("raw", rw, True)]
    for _, fn, stream in cases:                      # warm-up: caches, steady state
        one_round(fn, stream)
    got: dict = {(who, stream): [] for who, _, stream in cases}
    for _ in range(args.rounds):
        for who, fn, stream in cases:
            got[(who, stream)].append(one_round(fn, stream))
    med = {k: statistics.median(v) for k, v in got.items()}
    if hvd.rank() == 0:
        print(f"{args.bytes} B allreduce, {hvd.size()} ranks, {raw.name}: median us per call "
              f"(min-max over {args.rounds} rounds of {args.calls} calls)")
        print(f"{'':>8} {'warm':>22} {'after streaming ' + str(args.stream_mib) + ' MiB':>28} "
              f"{'slower by':>10}")
        for who in ("hvdlite", "raw"):
            w, c = got[(who, False)], got[(who, True)]
            print(f"{who:>8} {med[(who, False)]:>9.1f} ({min(w):.1f}-{max(w):.1f}) "
                  f"{med[(who, True)]:>15.1f} ({min(c):.1f}-{max(c):.1f}) "
                  f"{med[(who, True)] / med[(who, False)]:>9.2f}x")
        extra_w = med[("hvdlite", False)] - med[("raw", False)]
        extra_c = med[("hvdlite", True)] - med[("raw", True)]
        print(f"hvdlite's cost above the raw call: {extra_w:.1f} us warm, {extra_c:.1f} us after "
              f"streaming ({extra_c / extra_w:.2f}x)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": args.bytes, "stream_mib": args.stream_mib,
                           "transport": raw.name, "ranks": hvd.size(),
                           "rounds": {f"{who}_{'cold' if s else 'warm'}": v
                                      for (who, s), v in got.items()},
                           "median_us": {f"{who}_{'cold' if s else 'warm'}": v
                                         for (who, s), v in med.items()}}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
