"""Stateful compressors (Compression.int8, Compression.powersgd) on real collectives.

    hvdlite-run -np N python compression_checks.py

1. Error feedback: every rank feeds its own gradient stream (a common drift plus per-rank
   noise); over many steps the sum of the applied (compressed, reduced) updates must track the
   sum of the exact averages, far closer than one step's compression error.
2. Training on a small real task (scikit-learn's digits if installed, else a synthetic one)
   through DistributedOptimizer(compression=...) reaches a loss close to uncompressed training.
3. A dtype the compressor cannot handle raises an error naming the tensor and the dtype.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import hvdlite.torch as hvd
from ops_common import check, fail, finish, log

torch.set_num_threads(1)
hvd.init()
N, R = hvd.size(), hvd.rank()


def grad_stream(step: int, rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    drift = torch.Generator().manual_seed(7)
    return torch.randn(shape, generator=drift) + torch.randn(shape, generator=g)


def tracks(make, steps: int = 40, bound: float = 0.05) -> None:
    comp = make()
    shapes = {"w": (48, 40), "b": (40,)}
    applied = {k: torch.zeros(s) for k, s in shapes.items()}
    exact = {k: torch.zeros(s) for k, s in shapes.items()}
    one_step_err = {}
    for t in range(steps):
        pend = {k: comp.reduce_async(grad_stream(t, R, s), f"ef.{k}") for k, s in shapes.items()}
        hvd.drive_all(pend.values())
        for k, s in shapes.items():
            out = pend[k].result()
            true = sum(grad_stream(t, r, s) for r in range(N)) / N
            applied[k] += out
            exact[k] += true
            if t == 0:
                one_step_err[k] = ((out - true).norm() / true.norm()).item()
    if hasattr(comp, "rank"):
        # PowerSGD's identity: sum(applied) = sum(exact averages) - mean over ranks of the
        # final residuals, to rounding.
        err = comp.state["ef.w"]["error"].reshape(shapes["w"]).clone()
        hvd.allreduce_(err, op=hvd.Average, name="ef.residuals")
        gap = (applied["w"] - exact["w"] + err).abs().max().item()
        log(f"PowerSGD error-feedback identity gap {gap:.2e}")
        if gap > 1e-3:
            fail(f"sum(applied) + mean residual differs from the exact sum by {gap}")
    for k in shapes:
        rel = ((applied[k] - exact[k]).norm() / exact[k].norm()).item()
        log(f"{type(comp).__name__} {k}: first-step error {one_step_err[k]:.4f}, "
            f"error of the {steps}-step sum {rel:.5f}")
        if rel > bound:
            fail(f"{k}: sum of applied updates is {rel:.4f} off the exact sum (> {bound})")
        if k == "w" and one_step_err[k] > 1e-6 and rel > one_step_err[k] / 3:
            fail(f"{k}: error feedback does not help: sum error {rel:.4f}, "
                 f"one-step error {one_step_err[k]:.4f}")


def task():
    try:
        from sklearn.datasets import load_digits
        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
    except ImportError:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1797, 64, generator=g)
        y = (x[:, :10] @ torch.randn(10, 10, generator=g)).argmax(1)
    return x, y


def train(compression, steps: int = 80, batch: int = 32) -> float:
    x, y = task()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    loss_fn = nn.CrossEntropyLoss()
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        idx = torch.randperm(len(x), generator=g)[:batch * N].view(N, batch)[R]
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        return loss_fn(model(x), y).item()


def converges() -> None:
    base = train(hvd.Compression.none)
    q8 = train(hvd.Compression.int8)
    ps = train(hvd.Compression.powersgd(rank=4))
    log(f"digits loss after 80 steps: fp32 {base:.4f}, int8 {q8:.4f}, powersgd {ps:.4f}")
    if abs(q8 - base) > 0.02 + 0.05 * base:
        fail(f"int8 final loss {q8:.4f} too far from fp32's {base:.4f}")
    if ps > 2.0 * base + 0.1:
        fail(f"powersgd final loss {ps:.4f} too far from fp32's {base:.4f}")


def bad_dtype() -> None:
    for comp in (hvd.Compression.int8(), hvd.Compression.powersgd()):
        try:
            comp.reduce_async(torch.ones(4, 4, dtype=torch.int32), "my.int.tensor")
            fail(f"{type(comp).__name__} accepted an int32 tensor")
        except TypeError as e:
            if "my.int.tensor" not in str(e) or "int32" not in str(e):
                fail(f"error does not name tensor and dtype: {e}")
    # Through the optimizer: the error surfaces at backward time, naming the parameter.
    emb = nn.Linear(3, 3).double()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                 zero_stage=2, compression=hvd.Compression.int8)
        fail("zero_stage=2 with int8 accepted")
    except ValueError:
        pass


check("int8 error feedback tracks the exact sum", tracks, hvd.Compression.int8, 40, 0.01)
check("powersgd error feedback tracks the exact sum", tracks,
      lambda: hvd.Compression.powersgd(rank=2), 40, 0.35)
check("training converges on the small task", converges)
check("unsupported dtype", bad_dtype)
finish()
