"""What the flight recorder costs: allreduce latency with it on and off, in the same processes.

    hvdlite-run -np 2 python benchmarks/flight_recorder.py [--rounds 7] [--iters 300]

Each round times `--iters` named 4 KiB allreduces (steady state: the response cache path) with
the recorder on (64 records, the default), then the same with it off (capacity 0), alternating
A B A B; every rank switches at the same round. Prints the median per-call latency of each, the
spread over rounds, and the ratio on/off. Also the recorder's own cost per collective, timed
in-process without any communication.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common.flight_recorder import RECORDER, Recorder
from hvdlite.common.messages import ALLREDUCE, Request


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args()
    hvd.init()
    t = torch.ones(1024)
    for _ in range(50):
        hvd.allreduce(t, name="bench.fr")
    on, off = [], []
    capacity = RECORDER.capacity or 64
    for _ in range(args.rounds):
        for label, cap, sink in (("on", capacity, on), ("off", 0, off)):
            RECORDER.capacity = cap
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                hvd.allreduce(t, name="bench.fr")
            sink.append((time.perf_counter() - start) / args.iters * 1e6)
    RECORDER.capacity = capacity
    # The recorder alone: enqueue + start + finish of one record.
    rec = Recorder(64)
    req = Request(rank=0, name="x", type=ALLREDUCE, dtype="float32", shape=(1024,),
                  process_set_id=0)
    n = 100000
    start = time.perf_counter()
    for _ in range(n):
        r = rec.enqueued(req)
        rec.started(r)
        rec.finished(r)
    alone_us = (time.perf_counter() - start) / n * 1e6
    if hvd.rank() == 0:
        mon, moff = statistics.median(on), statistics.median(off)
        print(f"4 KiB allreduce, {hvd.size()} ranks, {args.rounds} alternating rounds of "
              f"{args.iters} calls")
        print(f"  recorder on : median {mon:8.1f} us/call  (rounds {min(on):.1f} - {max(on):.1f})")
        print(f"  recorder off: median {moff:8.1f} us/call  (rounds {min(off):.1f} - "
              f"{max(off):.1f})")
        print(f"  ratio on/off: {mon / moff:.3f}")
        print(f"  the recorder alone: {alone_us:.2f} us per collective (enqueue+start+finish)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
