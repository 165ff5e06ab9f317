"""TensorFlow's eager collectives against the torch frontend's same calls, in the same processes.

    hvdlite-run -np 2 python benchmarks/tf_eager_ops.py [--rounds 5] [--calls 300] [--json out.json]

A custom loop's metrics, logged losses and gathered predictions run eagerly, outside any
`tf.function`, as blocking `hvd.allreduce` / `grouped_allreduce` / `allgather` / `broadcast`
calls. Each is timed against the torch frontend's same call on the same bytes (the peer: the
engine's own cost, with no TensorFlow around it), alternating rounds of `--calls` calls:
medians, their ratio, and the min-max of the per-round ratios. A last row times the
TensorFlow allreduce inside a `tf.GradientTape` that watches its input (so it records the
collective's gradient) against the same call with no tape.
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.torch as hvd_torch  # noqa: E402
from bench_util import alternate, paired_args, report_paired  # noqa: E402


def main():
    args = paired_args(__doc__, rounds=5, calls=300)
    hvd.init()
    torch.set_num_threads(1)
    small = np.ones(1024, np.float32)                       # 4 KiB
    rows_np = np.ones((64, 10), np.float32)                 # a batch of predictions
    x, xt = tf.constant(small), torch.from_numpy(small.copy())
    p, pt = tf.constant(rows_np), torch.from_numpy(rows_np.copy())
    m = [tf.constant([1.0]), tf.constant([2.0])]
    mt = [torch.tensor([1.0]), torch.tensor([2.0])]
    w = tf.Variable(small)

    def taped():
        with tf.GradientTape() as tape:
            y = hvd.allreduce(w * 1.0, name="tfe.taped")
        return tape, y

    cases = {
        "allreduce": ("hvd.allreduce, 4 KiB", "torch frontend, same call",
                      lambda: hvd.allreduce(x, name="tfe.ar"),
                      lambda: hvd_torch.allreduce(xt, name="tfe.ar.t")),
        "allreduce_unnamed": ("hvd.allreduce, 4 KiB, unnamed", "torch frontend, same call",
                              lambda: hvd.allreduce(x), lambda: hvd_torch.allreduce(xt)),
        "grouped_allreduce": ("hvd.grouped_allreduce of 2 metrics", "torch frontend, same call",
                              lambda: hvd.grouped_allreduce(m),
                              lambda: hvd_torch.grouped_allreduce(mt)),
        "allgather": ("hvd.allgather of 64 x 10 predictions", "torch frontend, same call",
                      lambda: hvd.allgather(p), lambda: hvd_torch.allgather(pt)),
        "broadcast": ("hvd.broadcast, 4 KiB", "torch frontend, same call",
                      lambda: hvd.broadcast(x, 0), lambda: hvd_torch.broadcast(xt, 0)),
        "taped": ("hvd.allreduce, 4 KiB, recorded by a tape", "the same call, no tape",
                  taped, lambda: hvd.allreduce(w * 1.0, name="tfe.untaped")),
    }
    rows = {k: (what, peer, alternate(a, b, args.calls, args.rounds))
            for k, (what, peer, a, b) in cases.items()}
    if hvd.rank() == 0:
        report_paired(f"TensorFlow eager collectives, {hvd.size()} ranks, medians of "
                      f"{args.rounds} alternating rounds of {args.calls} calls (spread: min-max "
                      f"of per-round ratios)", rows, args.json,
                      {"ranks": hvd.size(), "rounds": args.rounds, "calls": args.calls},
                      label="hvdlite.tensorflow us")
    hvd.shutdown()


if __name__ == "__main__":
    main()
