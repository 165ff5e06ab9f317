"""Allreduce through hvdlite's API against the raw transport it runs on, in the same processes.

    hvdlite-run -np 2 python benchmarks/allreduce.py [--json out.json] [--plot out.png]
    mpiexec -n 2 python benchmarks/allreduce.py            # MPI transport against raw mpi4py

For each size from 4 KiB to 64 MiB: median latency and bus bandwidth (2(n-1)/n x bytes / time)
of hvdlite.torch.allreduce (named, steady state: the response cache path) and of the raw gloo
process group, alternating A B C A B C, with C the floor of any collective the ranks agree on
before sending it (a raw 16-byte allreduce, then the data), which hvdlite's steady state and
Horovod's cycle both are. Then 100 tensors of 4-256 KiB: hvdlite (async, fused)
against the raw transport reducing them one by one.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
import torch.distributed as dist

import hvdlite.torch as hvd
from bench_util import alternate, hvdlite_async_all, many_small_tensors, timed
from hvdlite.common import basics, rendezvous


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", type=int, default=4 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG plot (needs matplotlib)")
    return p.parse_args()


def iters_for(nbytes: int) -> int:
    return max(5, min(200, (64 << 20) // max(nbytes, 1) // 4))


class RawGloo:
    """A gloo process group straight on the job's store: the transport without hvdlite."""

    name = "gloo"

    def __init__(self):
        ident = rendezvous.identify()
        store = rendezvous.connect_store(ident, 60)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("bench/raw/", store), hvd.rank(),
                                        hvd.size(), datetime.timedelta(seconds=60))

    def allreduce(self, t: torch.Tensor) -> None:
        self.pg.allreduce([t]).wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()


class RawMPI:
    """mpi4py on COMM_WORLD: the transport without hvdlite."""

    name = "mpi"

    def __init__(self):
        from mpi4py import MPI
        self.mpi = MPI
        self.comm = MPI.COMM_WORLD.Dup()

    def allreduce(self, t: torch.Tensor) -> None:
        self.comm.Allreduce(self.mpi.IN_PLACE, t.numpy(), self.mpi.SUM)

    def barrier(self) -> None:
        self.comm.Barrier()


def main():
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    size = hvd.size()
    raw = RawMPI() if hvd.mpi_enabled() else RawGloo()
    bus = 2 * (size - 1) / size
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        x = torch.ones(nbytes // 4)
        name = f"bench.{nbytes}"
        n = iters_for(nbytes)

        def hv():
            hvd.allreduce_(x, name=name, op=hvd.Sum)

        def rw():
            raw.allreduce(x)

        # The floor of any collective that the ranks agree on before they send it (hvdlite's
        # steady state, Horovod's cycle): one raw allreduce of 16 bytes of ready bits, then the
        # data. For small sizes it is the latency of two calls; for large ones the agreement
        # is a barrier between one transfer and the next, so a rank that finishes a transfer
        # first waits for the other before its next one starts, where back-to-back raw calls
        # overlap the end of one with the start of the next.
        bits = torch.zeros(4, dtype=torch.int32)

        def agreed():
            raw.allreduce(bits)
            raw.allreduce(x)

        hv()
        rw()
        agreed()
        a, b, c = [], [], []
        for _ in range(args.rounds):
            a.append(timed(hv, n))
            b.append(timed(rw, n))
            c.append(timed(agreed, n))
        ta, tb = statistics.median(a), statistics.median(b)
        # Spread: raw/hvdlite time of each alternating round (timed back to back).
        per_round = [y / x for x, y in zip(a, b)]
        rows.append({"bytes": nbytes, "hvdlite_us": ta * 1e6, "raw_us": tb * 1e6,
                     "hvdlite_busbw_GBs": bus * nbytes / ta / 1e9,
                     "raw_busbw_GBs": bus * nbytes / tb / 1e9, "ratio_bw": tb / ta,
                     "ratio_bw_min": min(per_round), "ratio_bw_max": max(per_round),
                     "hvdlite_busbw_min": bus * nbytes / max(a) / 1e9,
                     "hvdlite_busbw_max": bus * nbytes / min(a) / 1e9,
                     "raw_busbw_min": bus * nbytes / max(b) / 1e9,
                     "raw_busbw_max": bus * nbytes / min(b) / 1e9})
        # hvdlite against that floor: agreed time / hvdlite time per round (its bandwidth
        # ratio), as ratio_bw is against the raw calls.
        per_agreed = [y / x for x, y in zip(a, c)]
        rows[-1].update({"raw_agreed_us": statistics.median(c) * 1e6,
                         "ratio_agreed": statistics.median(c) / ta,
                         "ratio_agreed_min": min(per_agreed),
                         "ratio_agreed_max": max(per_agreed)})
        nbytes *= 4

    # The smallest size again as an average, hvd.allreduce_'s default op, against what a user
    # of the raw transport writes for one: the sum, then a division by the number of ranks.
    x = torch.ones(args.min_bytes // 4)
    n = iters_for(args.min_bytes)

    def hv_avg():
        hvd.allreduce_(x, name="bench.average")

    def rw_avg():
        raw.allreduce(x)
        x.div_(size)

    average = {"bytes": args.min_bytes, **alternate(hv_avg, rw_avg, n, args.rounds)}

    # Many small tensors: fusion against one-by-one on the raw transport.
    tensors = many_small_tensors()
    sizes = [t.numel() for t in tensors]
    total = sum(sizes) * 4
    hv_many = hvdlite_async_all(hvd, tensors, "many")

    def hv_grouped():
        # One grouped call (hvd.grouped_allreduce_, DistributedOptimizer(groups=...)): the same
        # tensors, released together.
        hvd.grouped_allreduce_(tensors, name="many.grouped", op=hvd.Sum)

    def raw_many():
        for t in tensors:
            raw.allreduce(t)

    # The most any fusion can reach: one raw allreduce of one buffer holding the same bytes,
    # without even the copies into and out of it. Fused / one-by-one cannot exceed
    # one-by-one / this.
    one_buffer = torch.ones(sum(sizes))

    def raw_one():
        raw.allreduce(one_buffer)

    # The same with the copies a fusion buffer needs (in, and out to each tensor): what fusion
    # through a buffer can reach. On a transport whose per-call cost is tiny next to these
    # copies (MPI through shared memory), it is below one by one.
    pieces = list(one_buffer.split(sizes))

    def raw_one_copies():
        torch.cat(tensors, out=one_buffer)
        raw.allreduce(one_buffer)
        torch._foreach_copy_(tensors, pieces)

    hv_many()
    hv_grouped()
    raw_many()
    raw_one()
    raw_one_copies()
    a, b, c, d, g = [], [], [], [], []
    for _ in range(args.rounds):
        a.append(timed(hv_many, 3))
        b.append(timed(raw_many, 3))
        g.append(timed(hv_grouped, 3))
        c.append(timed(raw_one, 3))
        d.append(timed(raw_one_copies, 3))
    many = {"tensors": len(tensors), "bytes": total, "hvdlite_ms": statistics.median(a) * 1e3,
            "raw_one_by_one_ms": statistics.median(b) * 1e3,
            "raw_one_buffer_ms": statistics.median(c) * 1e3,
            "raw_one_buffer_copies_ms": statistics.median(d) * 1e3,
            "speedup_min": min(y / x for x, y in zip(a, b)),
            "speedup_max": max(y / x for x, y in zip(a, b)),
            "hvdlite_grouped_ms": statistics.median(g) * 1e3,
            "grouped_speedup_min": min(y / x for x, y in zip(g, b)),
            "grouped_speedup_max": max(y / x for x, y in zip(g, b))}
    many["speedup"] = many["raw_one_by_one_ms"] / many["hvdlite_ms"]
    many["grouped_speedup"] = many["raw_one_by_one_ms"] / many["hvdlite_grouped_ms"]
    many["limit"] = many["raw_one_by_one_ms"] / many["raw_one_buffer_ms"]
    many["limit_copies"] = many["raw_one_by_one_ms"] / many["raw_one_buffer_copies_ms"]

    shm = basics.engine_counters()["shm_collectives"] > 0
    # Under MPI with a core per rank the channel carries only the large collectives.
    from_bytes = max((getattr(c, "shm_min_bytes", 0) for c in basics.engine().comms.values()
                      if getattr(c, "shm", None) is not None), default=0)
    chunk = max((c.shm.chunk for c in basics.engine().comms.values()
                 if getattr(c, "shm", None) is not None), default=0)
    where = (f"shared memory from {from_bytes / 2**20:g} MiB (HVDLITE_MPI_SHM_MIN_MB), "
             f"{raw.name} below" if from_bytes else "shared memory, HVDLITE_SHM")
    where += f"; in chunks of {chunk / 2**20:g} MiB (HVDLITE_SHM_CHUNK_MB)"
    if hvd.rank() == 0:
        print(f"allreduce, {size} ranks, {raw.name}, median of {args.rounds} rounds"
              + (f" (hvdlite's data: {where})" if shm else ""))
        print("(ratios: median over alternating rounds; spread = min-max of the per-round "
              "ratios; latency ratio = hvdlite time / raw time)")
        print(f"{'bytes':>10} {'hvdlite us':>11} {'raw us':>10} {'hvdlite GB/s':>13} "
              f"{'raw GB/s':>9} {'hvdlite/raw bw':>15} {'spread':>11} {'latency x':>9} "
              f"{'raw agreed+data us':>19} {'hvdlite/agreed bw':>18} {'spread':>11}")
        for r in rows:
            print(f"{r['bytes']:>10} {r['hvdlite_us']:>11.1f} {r['raw_us']:>10.1f} "
                  f"{r['hvdlite_busbw_GBs']:>13.3f} {r['raw_busbw_GBs']:>9.3f} "
                  f"{r['ratio_bw']:>15.2f} {r['ratio_bw_min']:>5.2f}-{r['ratio_bw_max']:<5.2f} "
                  f"{r['hvdlite_us'] / r['raw_us']:>9.2f} {r['raw_agreed_us']:>19.1f} "
                  f"{r['ratio_agreed']:>18.2f} "
                  f"{r['ratio_agreed_min']:>5.2f}-{r['ratio_agreed_max']:<5.2f}")
        print("raw agreed+data: a raw 16-byte allreduce (the ready bits), then the data: the "
              "floor of a collective the ranks agree on before sending it")
        print(f"{average['bytes']} bytes averaged (op=Average, the default): hvdlite "
              f"{average['hvdlite_us']:.1f} us, raw sum then div_ {average['peer_us']:.1f} us, "
              f"latency x {average['ratio']:.2f} (spread {average['ratio_min']:.2f}-"
              f"{average['ratio_max']:.2f})")
        print(f"{many['tensors']} tensors of 4-256 KiB ({total / 2**20:.1f} MiB): hvdlite fused "
              f"{many['hvdlite_ms']:.1f} ms, raw one by one {many['raw_one_by_one_ms']:.1f} ms, "
              f"speedup {many['speedup']:.2f}x (spread {many['speedup_min']:.2f}-"
              f"{many['speedup_max']:.2f}); limit: raw one buffer of the same bytes "
              f"{many['raw_one_buffer_ms']:.1f} ms, so no fusion beats {many['limit']:.2f}x; "
              f"with the copies into and out of it {many['raw_one_buffer_copies_ms']:.1f} ms, "
              f"{many['limit_copies']:.2f}x")
        print(f"the same {many['tensors']} tensors as one grouped_allreduce_: "
              f"{many['hvdlite_grouped_ms']:.1f} ms, speedup {many['grouped_speedup']:.2f}x "
              f"(spread {many['grouped_speedup_min']:.2f}-{many['grouped_speedup_max']:.2f})")
        result = {"ranks": size, "transport": raw.name, "shared_memory": shm,
                  "shared_memory_from_bytes": from_bytes, "shared_memory_chunk_bytes": chunk,
                  "sizes": rows, "average": average,
                  "many_small": many}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.plot:
            plot(rows, args.plot, size, raw.name)
    hvd.shutdown()


def plot(rows, path: str, size: int, transport: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    x = [r["bytes"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["hvdlite_busbw_GBs"] for r in rows], "o-", label="hvdlite (median)")
    ax.fill_between(x, [r["hvdlite_busbw_min"] for r in rows],
                    [r["hvdlite_busbw_max"] for r in rows], alpha=0.2)
    ax.plot(x, [r["raw_busbw_GBs"] for r in rows], "s--", label=f"raw {transport} (median)")
    ax.fill_between(x, [r["raw_busbw_min"] for r in rows], [r["raw_busbw_max"] for r in rows],
                    alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes")
    ax.set_ylabel("bus bandwidth, GB/s (band: min-max of rounds)")
    ax.set_title(f"allreduce, {size} ranks, {transport}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
