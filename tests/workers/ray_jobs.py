"""Functions that tests/test_ray.py runs inside Ray actors (this directory is on the cluster's
PYTHONPATH, so they travel by reference and import hvdlite from the tree under test).

Training: a batch of ROWS integer-valued rows is split evenly over the ranks; each rank's loss is
the mean over its rows, and DistributedOptimizer averages the gradients, so every step equals the
single-process step on the whole batch (`reference`). The elastic job reuses elastic_train.py.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import socket

import torch

ROWS, LR = 12, 0.1


def coordinates() -> dict:
    import hvdlite.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.tensor([float(r + 1), 2.0 * r]), op=hvd.Sum, name="sum")
    avg = hvd.allreduce(torch.tensor([float(r)]), name="avg")
    gathered = hvd.allgather(torch.full((r + 1, 2), float(r)), name="gather")
    bcast = hvd.broadcast(torch.tensor([float(r + 10)]), root_rank=n - 1, name="bcast")
    objs = hvd.allgather_object({"rank": r, "node": os.environ["HVDLITE_HOSTNAME"]})
    return {"rank": r, "size": n, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "env_rank": int(os.environ["HOROVOD_RANK"]), "node": os.environ["HVDLITE_HOSTNAME"],
            "sum": total.tolist(), "avg": avg.tolist(), "gathered": gathered.tolist(),
            "bcast": bcast.tolist(), "objs": objs, "pid": os.getpid(),
            "host": socket.gethostname()}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randint(-3, 4, (ROWS, 4), generator=g).float(),
            torch.randint(-2, 3, (ROWS, 2), generator=g).float())


def reference(steps: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def train(steps: int) -> dict:
    import hvdlite.torch as hvd

    hvd.init()
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                   named_parameters=model.named_parameters())
    r, n = hvd.rank(), hvd.size()
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[r::n]), y[r::n]).backward()
        opt.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def fail_on(rank: int) -> int:
    import hvdlite.torch as hvd

    hvd.init()
    if hvd.rank() == rank:
        raise ValueError(f"bad input on purpose at rank {hvd.rank()}")
    # the others wait in a collective that the failing rank never joins
    hvd.allreduce(torch.ones(1), name="never_complete")
    return hvd.rank()


def wait_in_collectives(marker: str) -> int:
    """Signal readiness through a file, then keep doing collectives until the job is ended."""
    import time

    import hvdlite.torch as hvd

    hvd.init()
    open(f"{marker}.{hvd.rank()}", "w").close()
    for i in range(10_000):
        hvd.allreduce(torch.ones(1), name=f"loop{i % 4}")
        time.sleep(0.02)
    return hvd.rank()


def elastic_job() -> dict | None:
    """elastic_train.main() (configured by the ELASTIC_* variables the executor set), with its
    RESULT line turned into the return value."""
    import elastic_train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        elastic_train.main()
    for line in out.getvalue().splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None


def train_loop(config: dict) -> None:
    """A Ray Train loop written for hvdlite.torch: reports metrics and a checkpoint."""
    import tempfile

    import ray.train

    import hvdlite.torch as hvd

    hvd.init()
    ctx = ray.train.get_context()
    assert hvd.rank() == ctx.get_world_rank() and hvd.size() == ctx.get_world_size()
    weights = train(config["steps"])
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if hvd.rank() == 0:
            torch.save(weights, os.path.join(d, "weights.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"rank": hvd.rank(), "size": hvd.size()}, checkpoint=checkpoint)
