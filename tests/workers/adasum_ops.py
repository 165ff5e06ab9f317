"""op=hvd.Adasum against the NumPy reference (adasum_ref.py), and DistributedOptimizer(op=Adasum)
against a reference training computed here, one replica per rank.

Usage: hvdlite-run -np N python adasum_ops.py
With a power-of-two N every check runs; otherwise only the errors Horovod raises are checked.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

import hvdlite.torch as hvd
from adasum_ref import adasum as adasum_ref
from ops_common import check, close, expect_raises, fail, finish, log, salt_id, same

hvd.init(process_sets="dynamic")
rank, size = hvd.rank(), hvd.size()
POW2 = size & (size - 1) == 0
TOL = {torch.float16: (2e-3, 2e-3), torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-12)}


def rnd(r: int, shape, dtype, salt) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + r + 7919 * salt_id(salt))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def reference(inputs: list, pre: float = 1.0, post: float = 1.0) -> torch.Tensor:
    dtype = inputs[0].dtype
    np_dtype = {torch.float16: np.float16, torch.float32: np.float32,
                torch.float64: np.float64}[dtype]
    scaled = [(x.to(torch.float64) * pre).to(dtype).numpy() for x in inputs]
    out = adasum_ref(scaled, np_dtype).astype(np.float64) * post
    return torch.from_numpy(np.asarray(out, dtype=np_dtype).reshape(inputs[0].shape))


def near(actual, expected, what):
    rtol, atol = TOL[expected.dtype]
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return fail(f"{what}: got {actual.dtype}{tuple(actual.shape)}, expected "
                    f"{expected.dtype}{tuple(expected.shape)}")
    close(actual, expected, what, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- collectives
def check_dtype(dtype):
    for i, shape in enumerate([(), (5,), (3, 4, 5), (1000,)]):
        salt = f"single.{dtype}.{i}"
        inputs = [rnd(r, shape, dtype, salt) for r in range(size)]
        got = hvd.allreduce(inputs[rank], name=f"ada.{dtype}.{i}", op=hvd.Adasum)
        near(got, reference(inputs), f"{dtype} shape {shape}")


def check_in_flight():
    """Many tensors at once (fused per dtype, each reduced on its own), Sum ones among them."""
    specs = [("f32.a", (64,), torch.float32), ("f64.a", (17, 3), torch.float64),
             ("f32.b", (2, 300), torch.float32), ("f64.b", (1,), torch.float64),
             ("f32.c", (4096,), torch.float32), ("f32.zero0", (50,), torch.float32),
             ("f32.same", (40,), torch.float32), ("f32.orth", (2 * size,), torch.float32)]
    per_rank = {}
    for name, shape, dtype in specs:
        xs = [rnd(r, shape, dtype, name) for r in range(size)]
        if name == "f32.zero0":
            xs[0] = torch.zeros(shape, dtype=dtype)           # Adasum(0, b) == b
        if name == "f32.same":
            xs = [xs[0].clone() for _ in range(size)]          # equal vectors: their average
        if name == "f32.orth":
            xs = [torch.eye(2 * size, dtype=dtype)[2 * r] * (r + 1) for r in range(size)]
        per_rank[name] = xs
    handles = {}
    for k, (name, shape, dtype) in enumerate(specs):
        handles[name] = hvd.allreduce_async(per_rank[name][rank], name=f"fly.{name}",
                                            op=hvd.Adasum)
        if k == 3:
            handles["sum"] = hvd.allreduce_async(torch.full((64,), float(rank + 1)),
                                                 name="fly.sum", op=hvd.Sum)
    for name, shape, dtype in specs:
        got = hvd.synchronize(handles[name])
        near(got, reference(per_rank[name]), f"in flight {name}")
    same(hvd.synchronize(handles["sum"]), torch.full((64,), float(size * (size + 1) // 2)),
         "Sum allreduce beside Adasum ones")
    got_same = per_rank["f32.same"][0]
    near(reference(per_rank["f32.same"]), got_same, "reference: equal vectors average")
    orth = sum(per_rank["f32.orth"])
    near(reference(per_rank["f32.orth"]), orth, "reference: orthogonal vectors add")


def check_grouped_and_inplace():
    xs = [[rnd(r, (30,), torch.float32, f"grp.{i}") for i in range(3)] for r in range(size)]
    outs = hvd.grouped_allreduce(xs[rank], name="grp", op=hvd.Adasum)
    for i in range(3):
        near(outs[i], reference([xs[r][i] for r in range(size)]), f"grouped tensor {i}")
    ys = [rnd(r, (2, 50), torch.float64, "inplace") for r in range(size)]
    mine = ys[rank].clone()
    hvd.allreduce_(mine, name="inplace", op=hvd.Adasum, prescale_factor=0.5,
                   postscale_factor=3.0)
    near(mine, reference(ys, pre=0.5, post=3.0), "in place with prescale/postscale")
    zs = [rnd(r, (8,), torch.float16, "half") for r in range(size)]
    near(hvd.allreduce(zs[rank], name="half", op=hvd.Adasum), reference(zs), "float16")


# ---------------------------------------------------------------------------- optimizer
def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(r: int, step: int):
    g = torch.Generator().manual_seed(100 * r + step)
    return torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)


def check_optimizer(make_opt, tag, steps=3, passes=1, reset_after_a_pass=False):
    """`passes`: backward_passes_per_step. `reset_after_a_pass`: one backward pass, then the
    elastic reset every rank runs after a membership change (TorchState.on_reset), which must
    drop that partly counted step, as the plain optimizer's does (torch_optimizer_checks)."""
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   backward_passes_per_step=passes)
    if reset_after_a_pass:
        state = hvd.elastic.TorchState(model=model, optimizer=opt)
        x, y = batch(rank, 99)
        (100.0 * nn.functional.mse_loss(model(x), y)).backward()
        state.on_reset()
        if any(p.grad is not None for p in model.parameters()) or \
                any(d != passes for d in opt._allreduce_delay.values()):
            fail(f"{tag}: the reset kept the partial step: {opt._allreduce_delay}")
    # Reference: one replica (with its own optimizer state) per rank; every step each replica
    # starts from the common weights and steps on its rank's batches (their gradients summed
    # over `passes` backward passes); the common weights move by the Adasum of the replicas'
    # changes, parameter by parameter.
    common = {k: v.detach().clone() for k, v in make_model().named_parameters()}
    replicas = [make_model() for _ in range(size)]
    ref_opts = [make_opt(m.parameters()) for m in replicas]
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = batch(rank, step * passes + micro)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        deltas = {k: [] for k in common}
        for r, (rep, ropt) in enumerate(zip(replicas, ref_opts)):
            with torch.no_grad():
                for k, p in rep.named_parameters():
                    p.copy_(common[k])
            ropt.zero_grad()
            for micro in range(passes):
                xr, yr = batch(r, step * passes + micro)
                nn.functional.mse_loss(rep(xr), yr).backward()
            ropt.step()
            for k, p in rep.named_parameters():
                deltas[k].append(p.detach() - common[k])
        for k in common:
            common[k] = common[k] + reference(deltas[k])
        for k, p in model.named_parameters():
            near(p.detach(), common[k], f"{tag} step {step} parameter {k}")


# ---------------------------------------------------------------------------- errors
def check_errors():
    msg = "Running Adasum with non-power of 2 ranks is not supported yet."
    if not POW2:
        expect_raises(NotImplementedError, lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum),
                      "allreduce", match=msg)
        expect_raises(NotImplementedError,
                      lambda: hvd.grouped_allreduce([torch.ones(3)], op=hvd.Adasum),
                      "grouped_allreduce", match=msg)
        model = make_model()
        expect_raises(NotImplementedError,
                      lambda: hvd.DistributedOptimizer(
                          torch.optim.SGD(model.parameters(), lr=0.1),
                          named_parameters=model.named_parameters(), op=hvd.Adasum),
                      "DistributedOptimizer", match=msg)
    else:
        expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32),
                                                        op=hvd.Adasum),
                      "integer tensor", match="floating-point")
    # The job is still healthy afterwards.
    same(hvd.allreduce(torch.ones(4), name="after", op=hvd.Sum), torch.full((4,), float(size)),
         "Sum after the errors")


def check_process_set_error():
    ps = hvd.add_process_set([0])
    model = make_model()
    expect_raises(NotImplementedError,
                  lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum, process_set=ps),
                  "allreduce on a process set",
                  match="Adasum does not support non-global process sets yet.")
    expect_raises(NotImplementedError,
                  lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                   named_parameters=model.named_parameters(),
                                                   op=hvd.Adasum, process_set=ps),
                  "DistributedOptimizer on a process set",
                  match="Adasum does not support non-global process sets yet.")
    hvd.remove_process_set(ps)


log(f"rank {rank} of {size}")
check("errors", check_errors)
check("process_set_error", check_process_set_error)
if POW2:
    check("adasum_float32", check_dtype, torch.float32)
    check("adasum_float64", check_dtype, torch.float64)
    check("adasum_in_flight", check_in_flight)
    check("adasum_grouped_inplace", check_grouped_and_inplace)
    check("optimizer_sgd", check_optimizer,
          lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "SGD")
    check("optimizer_adam", check_optimizer, lambda ps: torch.optim.Adam(ps, lr=0.01), "Adam")
    check("optimizer_elastic_reset_drops_a_partial_step", check_optimizer,
          lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "SGD, 2 passes, a reset",
          passes=2, reset_after_a_pass=True)
finish()
hvd.shutdown()
