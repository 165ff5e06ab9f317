"""Random programs of collectives for the cross-rank conformance suite, a pure function of
(seed, size).

Why a pure function: every rank generates the same program from the same seed, and every
rank's inputs come from (seed, op index, tensor, rank), so any one process can compute the whole
reference (tests/conformance/reference.py) and no rank has to trust another's result.

A program is a list of ops (plain dicts, printable as JSON). Each op has `i` (its index, which
failure messages name), `kind`, and for a collective `set` (a key into the sets the program has
registered so far: "global", "static<k>", "dyn<k>"), `call` (sync, async, inplace, async_inplace)
and `name` (None: named by call site). The blocks they come in:

- single: one blocking collective;
- flight: several asynchronous ones in flight at once, waited for in an order each rank draws
  for itself (`wait_order`);
- steady: a step of named collectives repeated until the set is steady (cache hits, the steady
  state, the express lane for blocking calls), then one member's shape changes and the step
  repeats;
- join: uneven inputs, each rank running its own number of steps before hvd.join();
- add/remove of dynamic process sets, barriers, the object helpers.

Per-rank delays are not part of the program (it is the same on every rank): the worker draws
them from (seed, rank) with `delays`.
"""
from __future__ import annotations

import itertools
import json
import random
from typing import Any

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64"]
FLOATS = ["float16", "float32", "float64"]          # Adasum's (NumPy has no bfloat16)
REDUCE_OPS = ["Average", "Sum", "Min", "Max", "Product"]
COLLECTIVES = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
               "alltoall", "reducescatter", "grouped_reducescatter"]
OTHER_KINDS = ["broadcast_object", "allgather_object", "barrier", "add_set", "remove_set",
               "join"]
ALL_KINDS = COLLECTIVES + OTHER_KINDS

Op = dict[str, Any]


def static_sets(size: int) -> list[list[int]]:
    """The process sets every job of `size` ranks registers at init (so they are the same for
    every seed a job runs); a one-member set among them, whose calls never leave the caller."""
    return {1: [], 2: [[0]], 3: [[0, 2], [1]], 4: [[0, 1], [2, 3], [1, 2, 3]]}[size]


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


class _Gen:
    def __init__(self, seed: int, size: int):
        self.seed, self.size = seed, size
        self.rng = random.Random(seed * 1009 + size)
        self.ops: list[Op] = []
        self.sets: dict[str, list[int]] = {"global": list(range(size))}
        for k, ranks in enumerate(static_sets(size)):
            self.sets[f"static{k}"] = ranks
        self.dynamic: list[str] = []
        self.n_dyn = 0
        self.names = 0

    # ------------------------------------------------------------------ helpers
    def emit(self, op: Op) -> Op:
        op["i"] = len(self.ops)
        self.ops.append(op)
        return op

    def new_name(self, tag: str) -> str:
        self.names += 1
        return f"c{self.seed}.{tag}{self.names}"

    def pick_set(self) -> str:
        r = self.rng.random()
        if r < 0.55 or len(self.sets) == 1:
            return "global"
        return self.rng.choice(sorted(k for k in self.sets if k != "global"))

    def shape(self, min_dims: int = 0, big: float = 0.04) -> list[int]:
        """Mostly a few elements; now and then ~100-300 KB, so the large-tensor paths (shared
        memory chunks, MPI's in-place fused members) run too."""
        if self.rng.random() < big:
            return [self.rng.randint(25000, 70000)]
        dims = self.rng.randint(min_dims, 3)
        return [self.rng.randint(1, 6) for _ in range(dims)]

    def reduce(self, op: Op, allow_adasum: bool, n_members: int) -> None:
        """Choose op, dtypes and scale factors whose results stay exact (small integers,
        power-of-two or small-integer factors) and in range."""
        rng = self.rng
        adasum_ok = allow_adasum and op["set"] == "global" and _power_of_two(self.size) \
            and self.size > 1
        if adasum_ok and rng.random() < 0.12:
            op["op"] = "Adasum"
            op["dtypes"] = [rng.choice(FLOATS) for _ in range(n_members)]
        else:
            op["op"] = rng.choice(REDUCE_OPS)
            op["dtypes"] = [rng.choice(DTYPES) for _ in range(n_members)]
        floats = all(d.startswith(("float", "bfloat")) for d in op["dtypes"])
        if op["op"] == "Product":
            op["pre"], op["post"] = 1.0, rng.choice([1.0, 1.0, 3.0])
        elif rng.random() < 0.3:
            op["pre"], op["post"] = rng.choice([(0.5, 0.25), (2.0, 3.0), (1.0, 0.5)]) if floats \
                else rng.choice([(2.0, 3.0), (1.0, 2.0)])
        else:
            op["pre"], op["post"] = 1.0, 1.0

    def collective(self, kind: str, set_key: str, call: str, named: bool) -> Op:
        rng = self.rng
        n = len(self.sets[set_key])
        op: Op = {"kind": kind, "set": set_key, "call": call,
                  "name": self.new_name(kind[:3] + ".") if named else None}
        if kind in ("allreduce", "grouped_allreduce"):
            members = 1 if kind == "allreduce" else rng.randint(1, 4)
            self.reduce(op, allow_adasum=True, n_members=members)
            op["shapes"] = [self.shape() for _ in range(members)]
        elif kind in ("allgather", "grouped_allgather"):
            members = 1 if kind == "allgather" else rng.randint(1, 3)
            op["dtypes"] = [rng.choice(DTYPES) for _ in range(members)]
            # Each member's first dim per set rank: uneven, now and then zero rows.
            op["rows"] = [[rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(n)]
                          for _ in range(members)]
            op["tails"] = [self.shape(0, big=0.0)[:2] for _ in range(members)]
        elif kind == "broadcast":
            op["root"] = rng.choice(self.sets[set_key])
            op["dtypes"] = [rng.choice(DTYPES)]
            op["shapes"] = [self.shape()]
        elif kind == "alltoall":
            op["dtypes"] = [rng.choice(DTYPES)]
            op["tails"] = [self.shape(0, big=0.0)[:2]]
            if rng.random() < 0.3:
                op["splits"] = None               # even: each rank sends `per` rows to each
                op["per"] = rng.randint(0, 3)
            else:
                op["splits"] = [[rng.randint(0, 3) for _ in range(n)] for _ in range(n)]
                op["splits_type"] = rng.choice(["list", "tensor"])
        elif kind in ("reducescatter", "grouped_reducescatter"):
            members = 1 if kind == "reducescatter" else rng.randint(1, 3)
            self.reduce(op, allow_adasum=False, n_members=members)
            op["shapes"] = [[rng.randint(n, 3 * n + 2)] + self.shape(0, big=0.0)[:2]
                            for _ in range(members)]
        else:
            raise ValueError(kind)
        if call.endswith("inplace") and kind not in ("allreduce", "grouped_allreduce",
                                                      "broadcast"):
            op["call"] = call.replace("inplace", "").rstrip("_") or "sync"
        return op

    def any_collective(self, set_key: str, call: str, named: bool) -> Op:
        kind = self.rng.choices(COLLECTIVES, weights=[6, 3, 3, 2, 3, 2, 3, 2])[0]
        return self.collective(kind, set_key, call, named)

    # ------------------------------------------------------------------ blocks
    def single(self) -> None:
        rng = self.rng
        call = rng.choice(["sync", "sync", "inplace"])
        self.emit(self.any_collective(self.pick_set(), call, named=rng.random() < 0.6))

    def flight(self) -> None:
        """Several asynchronous calls in flight, on one or more sets, then waited for in a
        per-rank random order (names unique among them; unnamed ones get call-site names)."""
        rng = self.rng
        members = []
        for _ in range(rng.randint(2, 7)):
            call = rng.choice(["async", "async", "async_inplace"])
            members.append(self.any_collective(self.pick_set(), call, rng.random() < 0.7))
        self.emit({"kind": "flight", "members": members,
                   "poll": rng.random() < 0.3})

    def steady(self) -> None:
        """A step of 1-5 named collectives on one set, repeated until cached (and steady), then
        one member's shape changes (a cache miss after the steady state) and it repeats."""
        rng = self.rng
        set_key = self.pick_set()
        blocking = rng.random() < 0.5          # blocking calls of cached tensors: express lane
        # A training step's shape: small float32 allreduces only (gradients, metrics), which
        # the steady state's rounds carry in their own messages instead of a transport call.
        training = rng.random() < 0.4
        template = []
        for _ in range(rng.randint(1, 5)):
            kind = rng.choices(["allreduce", "grouped_allreduce", "allgather", "broadcast",
                                "reducescatter"], weights=[8, 2, 1, 1, 1])[0]
            call = rng.choice(["sync", "inplace"]) if blocking else \
                rng.choice(["async", "async_inplace"])
            if training:
                kind = rng.choice(["allreduce", "allreduce", "grouped_allreduce"])
            op = self.collective(kind, set_key, call, named=True)
            if training:
                op["op"] = rng.choice(["Sum", "Average", "Average"])
                op["dtypes"] = ["float32"] * len(op["dtypes"])
                op["shapes"] = [self.shape(big=0.0) for _ in op["dtypes"]]
                if rng.random() < 0.7:
                    op["pre"], op["post"] = 1.0, 1.0
            elif op.get("op") == "Adasum" and rng.random() < 0.7:
                op["op"], op["dtypes"] = "Sum", ["float32"] * len(op["dtypes"])
            template.append(op)
        reps = rng.randint(3, 7)
        change = rng.randrange(len(template))
        changed = dict(template[change])
        if "shapes" in changed:
            changed["shapes"] = [s + [2] if len(s) < 3 else s[:-1] for s in changed["shapes"]]
        elif "rows" in changed:
            changed["rows"] = [[r + 1 for r in rows] for rows in changed["rows"]]
        after = template[:change] + [changed] + template[change + 1:]
        self.emit({"kind": "steady", "set": set_key, "template": template, "reps": reps,
                   "after": after, "reps_after": rng.randint(2, 4), "blocking": blocking,
                   "training": training})

    def add_set(self) -> None:
        taken = {tuple(r) for r in self.sets.values()}
        free = [list(c) for k in range(1, self.size)
                for c in itertools.combinations(range(self.size), k) if c not in taken]
        if not free:
            return self.remove_set()
        key = f"dyn{self.n_dyn}"
        self.n_dyn += 1
        self.sets[key] = self.rng.choice(free)
        self.dynamic.append(key)
        self.emit({"kind": "add_set", "set": key, "ranks": self.sets[key]})

    def remove_set(self) -> None:
        if not self.dynamic:
            return self.add_set() if self.size > 1 else None
        key = self.dynamic.pop(self.rng.randrange(len(self.dynamic)))
        self.emit({"kind": "remove_set", "set": key, "ranks": self.sets.pop(key)})

    def join(self) -> None:
        """Rank r runs `steps[r]` steps (all different, so the last to join is known: the rank
        with the most), each an async allreduce, a blocking one and a grouped one, Sum or
        Average (a joined rank counts as zeros, and Average still divides by the set's size)."""
        rng = self.rng
        order = list(range(self.size))
        rng.shuffle(order)
        base = rng.randint(0, 2)
        steps = [base + order.index(r) for r in range(self.size)]
        step = []
        for call in ("async", "sync", "grouped"):
            op = {"kind": "allreduce" if call != "grouped" else "grouped_allreduce",
                  "set": "global", "call": "async" if call == "async" else "sync",
                  "name": self.new_name("join."), "op": rng.choice(["Sum", "Average"])}
            members = 1 if call != "grouped" else rng.randint(2, 3)
            op["dtypes"] = [rng.choice(["int32", "int64", "float32", "float64"])
                            for _ in range(members)]
            op["shapes"] = [self.shape(big=0.1) for _ in range(members)]
            op["pre"], op["post"] = 1.0, rng.choice([1.0, 2.0])
            step.append(op)
        self.emit({"kind": "join", "steps": steps, "step": step,
                   "last": max(range(self.size), key=lambda r: steps[r])})

    def objects(self) -> None:
        rng = self.rng
        kind = rng.choice(["broadcast_object", "allgather_object"])
        set_key = self.pick_set()
        op = {"kind": kind, "set": set_key, "name": self.new_name("obj.")
              if rng.random() < 0.5 else None}
        if kind == "broadcast_object":
            op["root"] = rng.choice(self.sets[set_key])
        self.emit(op)

    def barrier(self) -> None:
        self.emit({"kind": "barrier", "set": self.pick_set()})

    def build(self) -> list[Op]:
        rng = self.rng
        blocks = [(self.single, 5), (self.flight, 4), (self.steady, 3), (self.add_set, 1),
                  (self.remove_set, 1), (self.objects, 1), (self.barrier, 1)]
        joins = 1 if self.size > 1 and rng.random() < 0.5 else 0
        count = rng.randint(8, 14)
        join_at = rng.randrange(count) if joins else -1
        for b in range(count):
            if b == join_at:
                self.join()
            fn = rng.choices([f for f, _ in blocks], weights=[w for _, w in blocks])[0]
            fn()
        while self.dynamic:                     # a program leaves the job as it found it
            self.remove_set()
        return self.ops


def generate(seed: int, size: int) -> list[Op]:
    """The program for `seed` on `size` ranks: the same list on every rank, every time."""
    return _Gen(seed, size).build()


def delays(seed: int, rank: int) -> random.Random:
    """Rank `rank`'s own delays for program `seed` (each rank differs, so submissions
    interleave differently; the same on a replay)."""
    return random.Random(seed * 7919 + 104729 * (rank + 1))


def pause_s(draw: random.Random) -> float:
    """One delay: mostly none, some a few ms, now and then 30 ms (a straggler)."""
    r = draw.random()
    if r < 0.8:
        return 0.0
    if r < 0.98:
        return draw.random() * 0.003
    return 0.03


def kinds(program: list[Op]) -> set[str]:
    """Every op kind, call mode and reduce op a program uses (for coverage checks)."""
    seen: set[str] = set()

    def visit(op: Op) -> None:
        seen.add(op["kind"])
        if op.get("training"):
            seen.add("training")
        if "call" in op:
            seen.add("call:" + op["call"])
        if "op" in op:
            seen.add("op:" + op["op"])
        if op.get("pre", 1.0) != 1.0 or op.get("post", 1.0) != 1.0:
            seen.add("scaled")
        for d in op.get("dtypes", []):
            seen.add("dtype:" + d)
        for m in op.get("members", []) + op.get("template", []) + op.get("step", []):
            visit(m)
        if op["set"] != "global" if "set" in op else False:
            seen.add("set:" + op["set"].rstrip("0123456789"))

    for op in program:
        visit(op)
    return seen


if __name__ == "__main__":                      # print a program: python program.py SEED SIZE
    import sys
    print(json.dumps(generate(int(sys.argv[1]), int(sys.argv[2])), indent=1))
