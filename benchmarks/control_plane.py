"""Control-plane scaling: per-cycle work and latency at the busiest rank, N = 2 ... 512 ranks.

    python benchmarks/control_plane.py [--ranks 2,8,32,128,512] [--tensors 20] [--json out.json]

Two cores cannot host 512 processes, so the ranks are simulated in one process, but every step
runs hvdlite's real code with real message framing (pickle + HMAC, wire.Channel, over in-memory
pipes instead of TCP):

- coordinator ("star", HVDLITE_STEADY_STATE=0): the real controller.Coordinator; every simulated
  rank sends its cache-hit bits for one step of T cached tensors (one "Q" frame), the coordinator
  handles them and sends each rank its ordered responses. The busiest rank is rank 0, whose
  coordinator handles N frames in and N frames out per cycle.
- steady (the default): every simulated rank runs the engine's steady-state code (steady.py:
  SteadySet, the recursive-doubling Round, build_responses from a real RankCache) for the same
  step. Every rank handles ceil(log2 N) frames in and out per cycle.

Work is CPU time measured per simulated rank (time.thread_time around that rank's handling,
frame encode/decode included). Latency is the critical path of a discrete-event replay of the
cycle: each handling costs its measured CPU time on its rank, and each frame one network hop,
the median one-way latency of a real loopback TCP frame measured here (printed). Medians over
rounds, with the spread (min-max).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import heapq
import json
import math
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvdlite.common.config import Settings  # noqa: E402
from hvdlite.common.controller import Coordinator, Peer, SetState  # noqa: E402
from hvdlite.common.messages import ALLREDUCE, SUM, Request  # noqa: E402
from hvdlite.common.response_cache import CoordinatorCache, RankCache  # noqa: E402
from hvdlite.common.protocol import Msg  # noqa: E402
from hvdlite.common.steady import SteadySet, build_responses  # noqa: E402
from hvdlite.common.wire import Channel  # noqa: E402

KEY = hashlib.sha256(b"control-plane-benchmark").digest()


class Pipe:
    """The sending half of a socket, in memory: Channel.send writes here, feed() reads."""

    def __init__(self):
        self.data = bytearray()

    def setsockopt(self, *a):
        pass

    def sendall(self, b):
        self.data += b

    def recv(self, n):
        out = bytes(self.data[:n])
        del self.data[:n]
        return out


def link() -> tuple[Channel, Channel]:
    """A one-way authenticated link: (sender, receiver) sharing one in-memory pipe."""
    pipe = Pipe()
    return Channel(pipe, KEY), Channel(pipe, KEY)


def loopback_hop_s(samples: int = 400) -> float:
    """Median one-way latency of a small Channel frame over real loopback TCP (ping-pong / 2)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    a, b = Channel(cli, KEY), Channel(conn, KEY)

    def echo():
        for _ in range(samples):
            msg = b.recv_blocking(10)
            b.send(msg)

    t = threading.Thread(target=echo)
    t.start()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        a.send((Msg.ROUND, 0, 1, 0, 0, (1 << 20) - 1, False))
        a.recv_blocking(10)
        times.append((time.perf_counter() - t0) / 2)
    t.join()
    for s in (cli, conn, srv):
        s.close()
    return statistics.median(times)


def requests(n_tensors: int, rank: int) -> list[Request]:
    return [Request(rank=rank, name=f"grad.{i}", type=ALLREDUCE, dtype="float32",
                    shape=(1024 * (i + 1),), reduce_op=SUM) for i in range(n_tensors)]


# ---------------------------------------------------------------------- the coordinator (star)
def star_cycle(n: int, n_tensors: int, rounds: int, hop: float) -> dict:
    settings = Settings()
    settings.steady_state = False
    coord = Coordinator(n, KEY, settings)
    up = [link() for _ in range(n)]      # rank -> coordinator
    down = [link() for _ in range(n)]    # coordinator -> rank
    for r in range(n):
        coord.peers[r] = Peer(down[r][0], rank=r)
    coord.sets[0] = SetState(0, list(range(n)), CoordinatorCache(settings.cache_capacity))
    caches = [RankCache() for _ in range(n)]

    def cycle(first: bool):
        work = [0.0] * n
        # Every rank sends its step at t=0 (its own encode time counts to it).
        arrivals = []
        for r in range(n):
            t0 = time.thread_time()
            if first:
                up[r][0].send(("Q", requests(n_tensors, r), [], {0: 0}))
            else:
                mask = 0
                for req in requests(n_tensors, r):
                    mask |= 1 << caches[r].hit(req)
                up[r][0].send(("Q", [], [(0, mask)], {0: 0}))
            work[r] += time.thread_time() - t0
            arrivals.append((work[r] + hop, r))
        # Rank 0's coordinator handles the frames in arrival order, serially.
        clock = 0.0
        handled = 0
        for arrive, r in sorted(arrivals):
            t0 = time.thread_time()
            up[r][1].feed()
            out: dict = {}
            for msg in up[r][1].messages():
                coord._handle(r, msg, out)
            coord._flush(out)
            cost = time.thread_time() - t0
            work[0] += cost
            handled += 1
            clock = max(clock, arrive) + cost
        # Every rank decodes its responses (one hop after the coordinator sent them).
        finish = 0.0
        for r in range(n):
            t0 = time.thread_time()
            down[r][1].feed()
            for msg in down[r][1].messages():
                for item in msg[1]:
                    if item[0] == "R":
                        reqs = {q.name: q for q in requests(n_tensors, r)}
                        caches[r].learn(item[1], reqs)
                    elif item[0] == "C":
                        caches[r].expand(0, item[2], item[3])
            cost = time.thread_time() - t0
            work[r] += cost
            finish = max(finish, clock + hop + cost)
        return work, finish, 2 * n

    cycle(first=True)
    works, lats = [], []
    for _ in range(rounds):
        work, lat, frames = cycle(first=False)
        works.append(max(work))
        lats.append(lat)
    coord.listener.close()
    coord._wake_r.close()
    coord._wake_w.close()
    return {"busiest_frames": frames, "work_us": [w * 1e6 for w in works],
            "latency_us": [x * 1e6 for x in lats]}


# ---------------------------------------------------------------------- the steady state
def steady_cycle(n: int, n_tensors: int, rounds: int, hop: float) -> dict:
    settings = Settings()
    # Every rank's cache learns the step's bits from one full response, as after negotiation.
    caches = []
    for r in range(n):
        c = RankCache()
        for i, req in enumerate(requests(n_tensors, r)):
            from hvdlite.common.messages import Response
            c.learn(Response(type=ALLREDUCE, names=[req.name], shapes=[req.shape],
                             cache_bits=[i]), {req.name: req})
        caches.append(c)
    links = {}

    def channel(src: int, dst: int):
        if (src, dst) not in links:
            links[(src, dst)] = link()
        return links[(src, dst)]

    def cycle(epoch_round: int):
        sets = [SteadySet(0, 1, list(range(n)), r) for r in range(n)]
        for st in sets:
            st.round_no = epoch_round
        work = [0.0] * n
        frames = [0] * n
        clock = [0.0] * n
        events: list = []          # (arrival time, seq, dst, src)
        seq = [0]
        done_at = [0.0] * n

        def make_send(r):
            def send(idx, k, tag, value):
                channel(r, idx)[0].send((Msg.ROUND, 0, 1, k, tag, value[0], value[1]))
                frames[r] += 1
                seq[0] += 1
                heapq.heappush(events, (clock[r] + hop, seq[0], idx, r))
            return send

        def finish(r, result):
            released = sets[r].finish_round(result[0] & sets[r].round_bits)
            build_responses(caches[r], 0, [b for b, _ in released], settings.fusion_threshold,
                            True)

        for r in range(n):
            t0 = time.thread_time()
            st = sets[r]
            for req in requests(n_tensors, r):
                st.pending[caches[r].hit(req)] = req
            rnd = st.start_round(make_send(r), 0.0)
            result = rnd.advance()
            if result is not None:
                finish(r, result)
            cost = time.thread_time() - t0
            work[r] += cost
            clock[r] += cost
            done_at[r] = clock[r]
        while events:
            arrive, _, dst, src = heapq.heappop(events)
            clock[dst] = max(clock[dst], arrive)
            t0 = time.thread_time()
            ch = channel(src, dst)[1]
            ch.feed()
            for msg in ch.messages():
                _, sid, epoch, k, tag, bits, flag = msg
                st = sets[dst]
                st.offer(k, tag, (bits, flag))
                if st.round is not None:
                    result = st.round.advance()
                    if result is not None:
                        finish(dst, result)
            cost = time.thread_time() - t0
            work[dst] += cost
            frames[dst] += 1
            clock[dst] += cost
            done_at[dst] = clock[dst]
        assert all(not st.pending for st in sets), "a simulated round did not release the step"
        return work, max(done_at), max(frames)

    works, lats = [], []
    for k in range(rounds + 1):
        work, lat, frames = cycle(k)
        if k:
            works.append(max(work))
            lats.append(lat)
    return {"busiest_frames": frames, "work_us": [w * 1e6 for w in works],
            "latency_us": [x * 1e6 for x in lats]}


def summary(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,8,32,128,512")
    p.add_argument("--tensors", type=int, default=20, help="cached tensors per step")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    hop = loopback_hop_s()
    ranks = [int(x) for x in args.ranks.split(",")]
    rows = []
    for n in ranks:
        # Alternate the two so machine noise hits both alike.
        star = {"work_us": [], "latency_us": []}
        steady = {"work_us": [], "latency_us": []}
        for _ in range(args.rounds):
            # The collector would charge its pauses to whichever rank runs when it fires.
            gc.collect()
            gc.disable()
            a = star_cycle(n, args.tensors, 1, hop)
            gc.collect()
            b = steady_cycle(n, args.tensors, 1, hop)
            gc.enable()
            for key in ("work_us", "latency_us"):
                star[key] += a[key]
                steady[key] += b[key]
            star["busiest_frames"] = a["busiest_frames"]
            steady["busiest_frames"] = b["busiest_frames"]
        rows.append({"ranks": n, "coordinator": {"frames": star["busiest_frames"],
                                                  "work_us": summary(star["work_us"]),
                                                  "latency_us": summary(star["latency_us"])},
                     "steady": {"frames": steady["busiest_frames"],
                                "work_us": summary(steady["work_us"]),
                                "latency_us": summary(steady["latency_us"])}})
    base = rows[0]
    print(f"control plane, one step of {args.tensors} cached tensors per cycle, simulated ranks, "
          f"median of {args.rounds} alternating rounds (min-max); one hop = measured loopback "
          f"frame latency {hop * 1e6:.1f} us")
    print(f"{'ranks':>5} | {'coordinator: frames':>19} {'work us':>20} {'latency us':>20} | "
          f"{'steady: frames':>14} {'work us':>18} {'latency us':>18} | "
          f"{'steady work/N=2':>15} {'log2 N':>6}")
    for r in rows:
        c, s = r["coordinator"], r["steady"]

        def fmt(d):
            return f"{d['median']:.0f} ({d['min']:.0f}-{d['max']:.0f})"
        growth = s["work_us"]["median"] / base["steady"]["work_us"]["median"]
        print(f"{r['ranks']:>5} | {c['frames']:>19} {fmt(c['work_us']):>20} "
              f"{fmt(c['latency_us']):>20} | {s['frames']:>14} {fmt(s['work_us']):>18} "
              f"{fmt(s['latency_us']):>18} | {growth:>15.2f} {math.log2(r['ranks']):>6.0f}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        n_ratio = last["ranks"] / first["ranks"]
        log_ratio = math.log2(last["ranks"]) / math.log2(first["ranks"])
        cw = last["coordinator"]["work_us"]["median"] / first["coordinator"]["work_us"]["median"]
        sw = last["steady"]["work_us"]["median"] / first["steady"]["work_us"]["median"]
        sl = last["steady"]["latency_us"]["median"] / first["steady"]["latency_us"]["median"]
        print(f"from {first['ranks']} to {last['ranks']} ranks (x{n_ratio:.0f} ranks, "
              f"x{log_ratio:.0f} log2 N): busiest-rank work grows x{cw:.1f} on the coordinator, "
              f"x{sw:.1f} in the steady state; steady latency x{sl:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": args.tensors, "hop_us": hop * 1e6, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
