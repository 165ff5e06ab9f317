"""Cost of Horovod's TF error classes in graph mode: a tf.function allreduce step with
hvdlite's error guard (tensorflow/errors.py: the node also returns a status handle, read once
per output) against the same step with the guard switched off, in the same processes.

    hvdlite-run -np 2 python benchmarks/tf_error_guard.py [--tensors 8] [--steps 200]

Prints, on rank 0, medians of alternating rounds and their spread, and the ratio guard/no guard.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
from hvdlite.tensorflow import errors as _errors  # noqa: E402


def _no_guard():
    """Patch the guard out (what the frontend did before): the node's own outputs only."""
    saved = (_errors.guard_graph_fn, _errors.check_graph_outputs, _errors.status_dtype)

    def guard(fn, tout, shapes):
        return lambda *xs: list(fn(*xs)) + [tf.constant(0)]

    _errors.guard_graph_fn = guard
    _errors.check_graph_outputs = lambda what, outs: outs[:-1]
    _errors.status_dtype = lambda: tf.int32
    return saved


def _restore(saved):
    _errors.guard_graph_fn, _errors.check_graph_outputs, _errors.status_dtype = saved


def make_step(n, tag):
    @tf.function
    def step(xs):
        return [hvd.allreduce(x, name=f"{tag}.{i}") for i, x in enumerate(xs)]
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    hvd.init()
    xs = [tf.ones([1024]) for _ in range(args.tensors)]
    guarded = make_step(args.tensors, "guard")
    guarded(xs)
    saved = _no_guard()
    plain = make_step(args.tensors, "plain")
    plain(xs)                      # traced without the guard
    _restore(saved)
    times = {"guard": [], "no guard": []}
    for _ in range(args.rounds):
        for label, fn in (("guard", guarded), ("no guard", plain)):
            hvd.allreduce(tf.ones(1), name="sync")
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn(xs)
            times[label].append((time.perf_counter() - t0) / args.steps * 1e3)
    if hvd.rank() == 0:
        for label, ts in times.items():
            print(f"{label:9s}: median {statistics.median(ts):.3f} ms/step "
                  f"(min {min(ts):.3f}, max {max(ts):.3f}) over {args.rounds} rounds, "
                  f"{args.tensors} allreduces of 4 KiB per step, {hvd.size()} ranks")
        ratio = statistics.median(times["guard"]) / statistics.median(times["no guard"])
        print(f"ratio guard / no guard: {ratio:.3f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
