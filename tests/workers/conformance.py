"""Run conformance programs (tests/conformance/program.py) through hvdlite.torch and check
every result against the single-process reference (tests/conformance/reference.py).

Usage: hvdlite-run -np N python conformance.py --seeds 1,2,3 [--config NAME] [--op-timeout S]

One init for all the seeds of a job (start-up costs more than a program): the static process
sets are registered then, and dynamic ones are allowed too. Each seed is one harness check,
`seed<S>`. A mismatch names the seed and the op index; a call that does not return within
--op-timeout seconds prints HANG with the seed and op and ends this rank (exit 5), so the
launcher ends the job instead of waiting. Every failure prints the command that replays it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "conformance"))

import torch
from ops_common import FAILURES, check, fail, finish, log, no_threads_left, same
from program import delays, generate, pause_s, static_sets
from reference import ADASUM_TOL, OPS, expected, object_input, tensor_input

import hvdlite.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--seeds", required=True, help="comma-separated seeds")
parser.add_argument("--config", default="default", help="the lane configuration's name (for "
                    "the replay command only)")
parser.add_argument("--op-timeout", type=float, default=60.0)
parser.add_argument("--trace", action="store_true", help="log each call's start and end")
parser.add_argument("--ops", default="", help="to narrow a replay down: run only these op "
                    "indices (comma-separated; the sets the others add are still added)")
ARGS = parser.parse_args()
SEEDS = [int(s) for s in ARGS.seeds.split(",") if s]

# Static sets at init and dynamic ones later, in one job (Horovod's variable allows both).
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
size_env = int(os.environ.get("HOROVOD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE")
               or os.environ.get("PMI_SIZE") or 1)
STATIC = [hvd.ProcessSet(r) for r in static_sets(size_env)]
hvd.init(process_sets=STATIC)
rank, size = hvd.rank(), hvd.size()
assert size == size_env, f"size {size} != {size_env} from the environment"


def replay(seeds) -> str:
    return (f"scripts/conformance.sh --config {ARGS.config} --np {size} "
            f"--seeds {','.join(str(s) for s in seeds)}")


# ---------------------------------------------------------------------- hang watchdog
# (seed, op, kind, since), replaced whole so the watchdog never pairs one op with another's
# start time; None between programs.
_current: list = [None]


def _watch() -> None:
    while True:
        time.sleep(0.5)
        what = _current[0]
        if what is not None and time.monotonic() - what[3] > ARGS.op_timeout:
            seed = what[0]
            log(f"HANG rank {rank}: seed {seed} op {what[1]} ({what[2]}) did not return within "
                f"{ARGS.op_timeout:.0f} s")
            log(f"REPLAY {replay([seed])}   (this job: {replay(SEEDS)})")
            os._exit(5)


threading.Thread(target=_watch, name="conformance-watchdog", daemon=True).start()


def doing(seed: int, where: str, kind: str) -> None:
    if ARGS.trace:
        log(f"TRACE {time.monotonic():.4f} seed {seed} op {where} {kind}")
    _current[0] = (seed, where, kind, time.monotonic())


# ---------------------------------------------------------------------- one collective
class Call:
    """One collective of a program on this rank: its inputs, the call, its result."""

    def __init__(self, prog: Program, op: dict, where: str, salt: tuple,
                 joined: frozenset = frozenset()):
        self.prog, self.op, self.where, self.salt, self.joined = prog, op, where, salt, joined
        self.members = prog.ranks[op["set"]]
        self.ps = prog.sets[op["set"]]
        count = len(op["dtypes"])
        self.inputs = [tensor_input(op, salt, m, rank, self.members) for m in range(count)]
        self.kept = [x.clone() for x in self.inputs]
        self.handle = None
        self.result = None

    def _splits(self):
        s = self.op["splits"]
        if s is None:
            return None
        mine = s[self.members.index(rank)]
        return torch.tensor(mine, dtype=torch.int32) if self.op["splits_type"] == "tensor" \
            else mine

    def start(self) -> None:
        op, ps, name, call = self.op, self.ps, self.op["name"], self.op["call"]
        kind, xs = op["kind"], self.inputs
        red = {"op": OPS[op["op"]], "prescale_factor": op["pre"],
               "postscale_factor": op["post"]} if "op" in op else {}
        asynchronous = call.startswith("async")
        inplace = call.endswith("inplace")
        if kind == "allreduce":
            fn = {"sync": hvd.allreduce, "inplace": hvd.allreduce_,
                  "async": hvd.allreduce_async, "async_inplace": hvd.allreduce_async_}[call]
            got = fn(xs[0], name=name, process_set=ps, **red)
        elif kind == "grouped_allreduce":
            fn = {"sync": hvd.grouped_allreduce, "inplace": hvd.grouped_allreduce_,
                  "async": hvd.grouped_allreduce_async,
                  "async_inplace": hvd.grouped_allreduce_async_}[call]
            got = fn(xs, name=name, process_set=ps, **red)
        elif kind == "allgather":
            fn = hvd.allgather_async if asynchronous else hvd.allgather
            got = fn(xs[0], name=name, process_set=ps)
        elif kind == "grouped_allgather":
            fn = hvd.grouped_allgather_async if asynchronous else hvd.grouped_allgather
            got = fn(xs, name=name, process_set=ps)
        elif kind == "broadcast":
            fn = {"sync": hvd.broadcast, "inplace": hvd.broadcast_,
                  "async": hvd.broadcast_async, "async_inplace": hvd.broadcast_async_}[call]
            got = fn(xs[0], op["root"], name=name, process_set=ps)
        elif kind == "alltoall":
            fn = hvd.alltoall_async if asynchronous else hvd.alltoall
            got = fn(xs[0], splits=self._splits(), name=name, process_set=ps)
        elif kind == "reducescatter":
            fn = hvd.reducescatter_async if asynchronous else hvd.reducescatter
            got = fn(xs[0], name=name, process_set=ps, **red)
        elif kind == "grouped_reducescatter":
            fn = hvd.grouped_reducescatter_async if asynchronous else hvd.grouped_reducescatter
            got = fn(xs, name=name, process_set=ps, **red)
        else:
            raise ValueError(kind)
        if asynchronous:
            self.handle = got
        else:
            self.result = got
        self.inplace = inplace

    def poll(self) -> None:
        if self.handle is not None:
            hvd.poll(self.handle)

    def finish(self) -> None:
        if self.handle is not None:
            self.result = hvd.synchronize(self.handle)
            self.handle = None
        self.check()

    def _outputs(self) -> list:
        op, got = self.op, self.result
        kind = op["kind"]
        if kind == "alltoall":
            if isinstance(got, tuple):
                out, recv = got
                return [out, recv.tolist() if isinstance(recv, torch.Tensor) else list(recv)]
            return [got, None]
        if kind.startswith("grouped"):
            return list(got)
        return [got]

    def check(self) -> None:
        op = self.op
        what = f"seed {self.salt[0]} op {self.where} {op['kind']} ({op['call']}, set " \
               f"{op['set']}={self.members}, name {op['name']})"
        want = expected(op, self.salt, rank, self.members, self.joined)
        got = self._outputs()
        if len(got) != len(want):
            return fail(f"{what}: {len(got)} results, expected {len(want)}")
        if op["kind"] == "alltoall":
            same(got[0], want[0], what)
            if got[1] is not None and got[1] != want[1]:
                fail(f"{what}: received splits {got[1]}, expected {want[1]}")
            want_splits_back = op["splits"] is not None or op["call"].startswith("async")
            if want_splits_back != (got[1] is not None):
                fail(f"{what}: received splits returned: {got[1] is not None}")
            got, want = got[:1], want[:1]
        for m, (g, w) in enumerate(zip(got, want)):
            label = f"{what} member {m}"
            if op.get("op") == "Adasum":
                if not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.shape != w.shape:
                    fail(f"{label}: got {getattr(g, 'dtype', type(g))} "
                         f"{tuple(getattr(g, 'shape', ()))}, expected {w.dtype} {tuple(w.shape)}")
                else:
                    # (torch.allclose: torch.testing.assert_close's first call imports for
                    # seconds, which a hang watchdog would count against the call)
                    rtol, atol = ADASUM_TOL[w.dtype]
                    if not torch.allclose(g.double(), w.double(), rtol=rtol, atol=atol):
                        diff = (g.double() - w.double()).abs().max().item()
                        fail(f"{label}: beyond rtol={rtol} atol={atol} (max abs diff {diff}) "
                             f"actual={g.flatten()[:6].tolist()} "
                             f"expected={w.flatten()[:6].tolist()}")
            else:
                same(g, w, label)
            if self.inplace and op["kind"] in ("allreduce", "grouped_allreduce", "broadcast") \
                    and isinstance(g, torch.Tensor) and g.data_ptr() != self.inputs[m].data_ptr() \
                    and g.numel():
                fail(f"{label}: an in-place call returned another tensor")
            if not self.inplace:
                same(self.inputs[m], self.kept[m], label + " (the input was modified)")


# ---------------------------------------------------------------------- one program
class Program:
    def __init__(self, seed: int):
        self.seed = seed
        self.ops = generate(seed, size)
        self.own = delays(seed, rank)
        self.ranks = {"global": list(range(size))}
        self.sets = {"global": hvd.global_process_set}
        for k, ps in enumerate(STATIC):
            self.ranks[f"static{k}"] = list(ps.ranks)
            self.sets[f"static{k}"] = ps

    def pause(self) -> None:
        s = pause_s(self.own)
        if s:
            time.sleep(s)

    def mine(self, op: dict) -> bool:
        return rank in self.ranks[op["set"]]

    def run_calls(self, calls: list, blocking: bool, poll: bool = False) -> None:
        """Blocking: start and finish each in turn. Else start all, then finish them in this
        rank's own random order."""
        if blocking:
            for c in calls:
                self.pause()
                doing(self.seed, c.where, c.op["kind"])
                c.start()
                c.finish()
            return
        for c in calls:
            self.pause()
            doing(self.seed, c.where, c.op["kind"])
            c.start()
        if poll:
            for c in calls:
                c.poll()
        order = list(calls)
        self.own.shuffle(order)
        for c in order:
            doing(self.seed, c.where, c.op["kind"] + " (waiting)")
            c.finish()

    def run(self) -> None:
        only = {int(k) for k in ARGS.ops.split(",") if k}
        for op in self.ops:
            i, kind = op["i"], op["kind"]
            if only and i not in only and kind not in ("add_set", "remove_set"):
                continue
            doing(self.seed, str(i), kind)
            t0 = time.monotonic()
            try:
                self.step(op, i, kind)
            except Exception as exc:
                raise AssertionError(f"seed {self.seed} op {i} ({kind}) raised "
                                     f"{type(exc).__name__}: {exc}") from exc
            took = time.monotonic() - t0
            if took > 1.0:                  # (not a failure: the machine may be loaded)
                log(f"SLOW seed {self.seed} op {i} ({kind}) took {took:.2f}s")
        _current[0] = None

    def step(self, op: dict, i: int, kind: str) -> None:
        seed = self.seed
        if kind == "flight":
            calls = [Call(self, m, f"{i}.{k}", (seed, i, k, 0))
                     for k, m in enumerate(op["members"]) if self.mine(m)]
            self.run_calls(calls, blocking=False, poll=op["poll"])
        elif kind == "steady":
            if not self.mine(op):
                return
            for phase, template, reps in (("a", op["template"], op["reps"]),
                                          ("b", op["after"], op["reps_after"])):
                for rep in range(reps):
                    calls = [Call(self, m, f"{i}.{phase}{rep}.{k}", (seed, i, k, phase, rep))
                             for k, m in enumerate(template)]
                    self.run_calls(calls, blocking=op["blocking"])
        elif kind == "join":
            self.join(op, i)
        elif kind == "add_set":
            self.pause()
            ps = hvd.add_process_set(op["ranks"])
            self.sets[op["set"]], self.ranks[op["set"]] = ps, list(op["ranks"])
            if ps.ranks != op["ranks"] or ps.size() != len(op["ranks"]):
                fail(f"seed {seed} op {i}: add_process_set({op['ranks']}) gave {ps.ranks}")
        elif kind == "remove_set":
            self.pause()
            hvd.remove_process_set(self.sets.pop(op["set"]))
            del self.ranks[op["set"]]
        elif kind == "barrier":
            if self.mine(op):
                self.pause()
                hvd.barrier(process_set=self.sets[op["set"]])
        elif kind in ("broadcast_object", "allgather_object"):
            if not self.mine(op):
                return
            self.pause()
            members, ps = self.ranks[op["set"]], self.sets[op["set"]]
            obj = object_input(seed, i, rank)
            if kind == "broadcast_object":
                got = hvd.broadcast_object(obj, root_rank=op["root"], name=op["name"],
                                           process_set=ps)
                want = object_input(seed, i, op["root"])
            else:
                got = hvd.allgather_object(obj, name=op["name"], process_set=ps)
                want = [object_input(seed, i, r) for r in members]
            if got != want:
                fail(f"seed {seed} op {i} {kind} on {members}: got {got!r}, expected {want!r}")
        else:                               # a single blocking collective
            if self.mine(op):
                self.run_calls([Call(self, op, str(i), (seed, i, 0, 0))], blocking=True)

    def join(self, op: dict, i: int) -> None:
        """Uneven inputs: this rank runs its own number of steps, then joins."""
        steps = op["steps"]
        for k in range(steps[rank]):
            joined = frozenset(r for r in range(size) if steps[r] <= k)
            calls = [Call(self, m, f"{i}.s{k}.{p}", (self.seed, i, p, k), joined)
                     for p, m in enumerate(op["step"])]
            pending = []
            for c in calls:
                self.pause()
                doing(self.seed, c.where, c.op["kind"])
                c.start()
                if c.handle is None:
                    c.finish()
                else:
                    pending.append(c)
            for c in pending:
                c.finish()
        doing(self.seed, f"{i}", "join")
        last = hvd.join()
        if last != op["last"]:
            fail(f"seed {self.seed} op {i}: join() returned {last}, expected {op['last']} "
                 f"(the rank with the most steps, {steps})")


def run_seed(seed: int) -> None:
    t0 = time.monotonic()
    prog = Program(seed)
    try:
        prog.run()
    finally:
        log(f"SEED {seed} {len(prog.ops)} ops {time.monotonic() - t0:.2f}s")


for seed in SEEDS:
    check(f"seed{seed}", run_seed, seed)
    if f"seed{seed}" in FAILURES:
        log(f"REPLAY {replay([seed])}   (this job: {replay(SEEDS)})")
try:
    from hvdlite.common.basics import engine_counters
    log("COUNTERS " + json.dumps(engine_counters()))
except (ImportError, AttributeError):
    pass
finish()
hvd.shutdown()
no_threads_left()
