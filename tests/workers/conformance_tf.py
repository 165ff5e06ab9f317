"""The conformance programs' blocking part through hvdlite.tensorflow, against the same
single-process reference as the torch worker (conformance.py).

Usage: hvdlite-run -np N python conformance_tf.py --seeds 1,2,3 [--config NAME]

TensorFlow's API has no handles and no in-place calls on tensors, so this runs the subset of a
program it can express: single blocking collectives (in-place ones as their out-of-place
form), steady blocks of blocking calls (cache hits, the steady state, the changed shape),
barriers and the process sets' add/remove. Flights, join, asynchronous steady blocks and the
object helpers stay with the torch worker. Each seed is one harness check, `seed<S>`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "conformance"))

import numpy as np
import tensorflow as tf
import torch
from program import delays, generate, pause_s, static_sets
from reference import ADASUM_TOL, expected, tensor_input
from tf_common import FAILURES, check, close, fail, finish, log, same

import hvdlite.tensorflow as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--seeds", required=True)
parser.add_argument("--config", default="default")
ARGS, _ = parser.parse_known_args()
SEEDS = [int(s) for s in ARGS.seeds.split(",") if s]

os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
size_env = int(os.environ.get("HOROVOD_SIZE") or os.environ.get("PMI_SIZE") or 1)
STATIC = [hvd.ProcessSet(r) for r in static_sets(size_env)]
hvd.init(process_sets=STATIC)
rank, size = hvd.rank(), hvd.size()
OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product, "Adasum": hvd.Adasum}


def to_tf(x: torch.Tensor) -> tf.Tensor:
    if x.dtype == torch.bfloat16:          # (NumPy has no bfloat16; small integers: exact)
        return tf.cast(tf.constant(x.to(torch.float32).numpy()), tf.bfloat16)
    return tf.constant(x.numpy())


def to_np(x: torch.Tensor) -> np.ndarray:
    if x.dtype == torch.bfloat16:
        return tf.cast(tf.constant(x.to(torch.float32).numpy()), tf.bfloat16).numpy()
    return x.numpy()


class Runner:
    def __init__(self, seed: int):
        self.seed, self.ops, self.own = seed, generate(seed, size), delays(seed, rank)
        self.calls = 0
        self.ranks = {"global": list(range(size))}
        self.sets = {"global": hvd.global_process_set}
        for k, ps in enumerate(STATIC):
            self.ranks[f"static{k}"], self.sets[f"static{k}"] = list(ps.ranks), ps

    def call(self, op: dict, where: str, salt: tuple) -> None:
        members, ps = self.ranks[op["set"]], self.sets[op["set"]]
        xs = [to_tf(tensor_input(op, salt, m, rank, members)) for m in range(len(op["dtypes"]))]
        name, kind = op["name"], op["kind"]
        red = {"op": OPS[op["op"]], "prescale_factor": op["pre"],
               "postscale_factor": op["post"]} if "op" in op else {}
        s = pause_s(self.own)
        if s:
            time.sleep(s)
        if kind == "allreduce":
            got = [hvd.allreduce(xs[0], name=name, process_set=ps, **red)]
        elif kind == "grouped_allreduce":
            got = hvd.grouped_allreduce(xs, name=name, process_set=ps, **red)
        elif kind == "allgather":
            got = [hvd.allgather(xs[0], name=name, process_set=ps)]
        elif kind == "grouped_allgather":
            got = hvd.grouped_allgather(xs, name=name, process_set=ps)
        elif kind == "broadcast":
            got = [hvd.broadcast(xs[0], op["root"], name=name, process_set=ps)]
        elif kind == "alltoall":
            splits = None if op["splits"] is None else op["splits"][members.index(rank)]
            got = hvd.alltoall(xs[0], splits=splits, name=name, process_set=ps)
            got = list(got) if splits is not None else [got]
        elif kind == "reducescatter":
            got = [hvd.reducescatter(xs[0], name=name, process_set=ps, **red)]
        elif kind == "grouped_reducescatter":
            got = hvd.grouped_reducescatter(xs, name=name, process_set=ps, **red)
        else:
            raise ValueError(kind)
        self.calls += 1
        want = expected(op, salt, rank, members)
        what = f"seed {self.seed} op {where} {kind} (tensorflow, set {op['set']}={members}, " \
               f"name {name})"
        if kind == "alltoall":
            if len(got) == 2 and list(np.asarray(got[1])) != want[1]:
                fail(f"{what}: received splits {list(np.asarray(got[1]))}, expected {want[1]}")
            got, want = got[:1], want[:1]
        if len(got) != len(want):
            return fail(f"{what}: {len(got)} results, expected {len(want)}")
        for m, (g, w) in enumerate(zip(got, want)):
            if op.get("op") == "Adasum":
                rtol, atol = ADASUM_TOL[w.dtype]
                close(g, to_np(w), f"{what} member {m}", rtol=rtol, atol=atol)
            else:
                same(g, to_np(w), f"{what} member {m}")

    def run(self) -> None:
        for op in self.ops:
            i, kind = op["i"], op["kind"]
            try:
                self.step(op, i, kind)
            except Exception as exc:
                raise AssertionError(f"seed {self.seed} op {i} ({kind}) raised "
                                     f"{type(exc).__name__}: {exc}") from exc

    def step(self, op: dict, i: int, kind: str) -> None:
        if kind == "add_set":
            self.sets[op["set"]] = hvd.add_process_set(op["ranks"])
            self.ranks[op["set"]] = list(op["ranks"])
        elif kind == "remove_set":
            hvd.remove_process_set(self.sets.pop(op["set"]))
            del self.ranks[op["set"]]
        elif kind == "barrier":
            if rank in self.ranks[op["set"]]:
                hvd.barrier(process_set=self.sets[op["set"]])
        elif kind == "steady" and op["blocking"]:
            if rank not in self.ranks[op["set"]]:
                return
            for phase, template, reps in (("a", op["template"], op["reps"]),
                                          ("b", op["after"], op["reps_after"])):
                for rep in range(reps):
                    for k, m in enumerate(template):
                        self.call(m, f"{i}.{phase}{rep}.{k}", (self.seed, i, k, phase, rep))
        elif "call" in op and not op["call"].startswith("async") \
                and rank in self.ranks[op["set"]]:
            self.call(op, str(i), (self.seed, i, 0, 0))


def run_seed(seed: int) -> None:
    runner = Runner(seed)
    try:
        runner.run()
    finally:
        log(f"SEED {seed} {runner.calls} calls checked")


for seed in SEEDS:
    check(f"seed{seed}", run_seed, seed)
    if f"seed{seed}" in FAILURES:
        log(f"REPLAY scripts/conformance.sh --config {ARGS.config} --np {size} --seeds {seed} "
            f"--frontend tensorflow")
finish()
hvd.shutdown()
