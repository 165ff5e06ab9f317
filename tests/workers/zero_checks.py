"""ZeRO stages 1 and 2 against stage 0 and a single-process run on the global batch.

    hvdlite-run -np N python zero_checks.py [--quick] [--mesh]

float64 everywhere, so sharded and unsharded updates agree to rounding. Every check runs the
same collectives on every rank; a mismatch is recorded (ops_common.check) and fails at the end.
--quick runs one case per optimizer and stage; --mesh (4 ranks) adds checks where the
optimizer is sharded over the dp group of `parallel.mesh(tp=2)` (process_set), each dp group
training on its own data.
"""
from __future__ import annotations

import copy
import io
import sys

import torch
import torch.nn as nn

import hvdlite.torch as hvd
from ops_common import check, fail, finish, log

torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
BATCH, STEPS, SEED = 4, 5, 7
MESH = "--mesh" in sys.argv
QUICK = "--quick" in sys.argv
hvd.init(process_sets="dynamic" if MESH else None)
PS, DP_SIZE, DP_RANK, DATA_SEED = hvd.global_process_set, hvd.size(), hvd.rank(), 0


def use_mesh_dp() -> None:
    """Shard over the dp group of parallel.mesh(tp=2); each dp group has its own data."""
    global PS, DP_SIZE, DP_RANK, DATA_SEED
    from hvdlite.torch.parallel import mesh
    m = mesh(tp=2)
    PS, DP_SIZE, DP_RANK, DATA_SEED = m.dp, m.dp_size, m.dp_rank, 100 * m.tp_rank


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5), nn.Tanh(),
                         nn.Linear(5, 3), nn.Linear(3, 2, bias=False))


def make_opt(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=0.01, weight_decay=0.01)


def batch(step: int, micro: int, r: int):
    g = torch.Generator().manual_seed(DATA_SEED + 1000 * step + 10 * micro + r)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 2, generator=g)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference(kind: str, passes: int, clip: float | None, steps: int = STEPS):
    """One process, the whole global batch (DP_SIZE ranks' batches) per step."""
    model = make_model()
    opt = make_opt(kind, model.parameters())
    for s in range(steps):
        opt.zero_grad()
        for mi in range(passes):
            xs, ys = zip(*[batch(s, mi, r) for r in range(DP_SIZE)])
            loss_of(model, torch.cat(xs), torch.cat(ys)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model, opt


def distributed(kind: str, stage: int, passes: int, clip: float | None, steps: int = STEPS,
                model=None, opt=None):
    if model is None:
        model = make_model()
        opt = hvd.DistributedOptimizer(make_opt(kind, model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       zero_stage=stage, backward_passes_per_step=passes,
                                       process_set=PS)
    for s in range(steps):
        opt.zero_grad()
        for mi in range(passes):
            x, y = batch(s, mi, DP_RANK)
            loss_of(model, x, y).backward()
        if clip is not None:
            if stage == 0:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                with opt.skip_synchronize():
                    opt.step()
                continue
            opt.clip_grad_norm_(clip)
        opt.step()
    return model, opt


def same_weights(a: nn.Module, b: nn.Module, what: str, tol: float = 1e-12) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if not torch.allclose(p, q, rtol=tol, atol=tol):
            fail(f"{what}: {n} differs by {(p - q).abs().max().item():.3e}")


def same_state(full: dict, ref: dict, what: str) -> None:
    if sorted(full["state"]) != sorted(ref["state"]):
        fail(f"{what}: state keys {sorted(full['state'])} != {sorted(ref['state'])}")
        return
    for k, s in ref["state"].items():
        for n, v in s.items():
            w = full["state"][k][n]
            if torch.is_tensor(v) and not torch.allclose(w.to(v.dtype), v, rtol=1e-12,
                                                         atol=1e-12):
                fail(f"{what}: state[{k}][{n}] differs")


def equal_to_reference(kind, stage, passes, clip, what):
    ref_model, ref_opt = reference(kind, passes, clip)
    m0, o0 = distributed(kind, 0, passes, clip)
    mz, oz = distributed(kind, stage, passes, clip)
    same_weights(mz, ref_model, what + " vs single process", 1e-10)
    same_weights(mz, m0, what + " vs stage 0", 1e-10)
    full = oz.state_dict()
    same_state(full, ref_opt.state_dict(), what + " consolidated state")
    # Sharded: this rank keeps state for its own parameters only.
    if DP_SIZE > 1 and len(oz.state) >= len(ref_opt.state):
        fail(f"{what}: rank keeps {len(oz.state)} of {len(ref_opt.state)} states")


CASES = ((1, None), (2, None), (1, 0.05)) if not QUICK else ((2, 0.05),)
for kind in ("sgd", "adam"):
    for stage in (1, 2):
        for passes, clip in CASES:
            what = f"{kind} stage {stage} passes={passes} clip={clip}"
            check(what, equal_to_reference, kind, stage, passes, clip, what)

def round_trip():
    ref_model, ref_opt = reference("adam", 1, None, steps=STEPS + 3)
    mz, oz = distributed("adam", 2, 1, None)
    full = oz.state_dict()
    buf = io.BytesIO()
    torch.save({"model": mz.state_dict(), "opt": full}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    # Plain torch loads it and continues exactly as the reference.
    plain_model = make_model()
    plain_model.load_state_dict(ck["model"])
    plain = make_opt("adam", plain_model.parameters())
    plain.load_state_dict(copy.deepcopy(ck["opt"]))   # torch keeps references to its tensors
    for s in range(STEPS, STEPS + 3):
        plain.zero_grad()
        xs, ys = zip(*[batch(s, 0, r) for r in range(DP_SIZE)])
        loss_of(plain_model, torch.cat(xs), torch.cat(ys)).backward()
        plain.step()
    same_weights(plain_model, ref_model, "plain torch after loading the consolidated state",
                 1e-10)
    # A fresh sharded optimizer loads the full state (keeping its shard) and continues.
    m2 = make_model()
    m2.load_state_dict(ck["model"])
    o2 = hvd.DistributedOptimizer(make_opt("adam", m2.parameters()),
                                  named_parameters=m2.named_parameters(), zero_stage=1,
                                  process_set=PS)
    o2.load_state_dict(ck["opt"])
    for s in range(STEPS, STEPS + 3):
        o2.zero_grad()
        x, y = batch(s, 0, DP_RANK)
        loss_of(m2, x, y).backward()
        o2.step()
    same_weights(m2, ref_model, "sharded optimizer after load_state_dict", 1e-10)

def bad_input():
    model = make_model()
    try:
        hvd.DistributedOptimizer(make_opt("sgd", model.parameters()),
                                 named_parameters=model.named_parameters(), zero_stage=3)
        fail("zero_stage=3 accepted")
    except ValueError as e:
        if "(0, 1, 2)" not in str(e):
            fail(f"zero_stage error does not name the allowed values: {e}")
    opt = hvd.DistributedOptimizer(make_opt("sgd", model.parameters()),
                                   named_parameters=model.named_parameters(), zero_stage=1,
                                   process_set=PS)
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        fail("add_param_group after sharding accepted")
    except RuntimeError as e:
        if "Rebuild" not in str(e):
            fail(f"unclear error: {e}")
    opt.param_groups[0]["params"] = opt.param_groups[0]["params"][:-1]
    try:
        opt.step()
        fail("changed param group accepted")
    except RuntimeError as e:
        if "Rebuild" not in str(e):
            fail(f"unclear error: {e}")
    # A state dict from a model whose last layer is wider.
    other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5), nn.Tanh(),
                          nn.Linear(5, 3), nn.Linear(3, 4, bias=False))
    oo = make_opt("adam", other.parameters())
    ((other(torch.randn(2, 6)) ** 2).sum()).backward()
    oo.step()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt("adam", model.parameters()),
                                   named_parameters=model.named_parameters(), zero_stage=2,
                                   process_set=PS)
    try:
        opt.load_state_dict(oo.state_dict())
        fail("state dict with other shapes accepted")
    except ValueError as e:
        if "'5.weight'" not in str(e):
            fail(f"error does not name the parameter: {e}")

check("state_dict round trip through plain torch and back", round_trip)
check("bad input: zero_stage, param group change, wrong shapes", bad_input)
if MESH:
    use_mesh_dp()
    for stage in (1, 2):
        what = f"adam stage {stage} over the mesh dp process set"
        check(what, equal_to_reference, "adam", stage, 1, 0.05, what)
log(f"rank {hvd.rank()} zero checks done")
finish()
