"""fully_shard against one process training on the whole global batch, float64.

    hvdlite-run -np N python fsdp_checks.py [--compile] [--hybrid]
    hvdlite-run -np N python fsdp_checks.py --save DIR [--steps K] [--load DIR] [--dcp]
    hvdlite-run -np N python fsdp_checks.py --only CHECK_FUNCTION

Every rank trains on its slice of the same global batch of GLOBAL rows, so the result does not
depend on the number of ranks and a checkpoint saved on 2 ranks continues on 4 to the very
weights one process reaches. float64, so sharded and single-process training agree to rounding
(1e-12). --save/--load run only the checkpoint round trip: train K steps (after loading every
saved rank's sharded state dict from DIR, if --load), then save this rank's to DIR; with --dcp
through hvdlite.torch.checkpoint (DCP's format) instead. Imported (by the tests, for the model,
the data and the reference), it starts no hvdlite.
"""
from __future__ import annotations

import glob
import os
import sys

import torch
from harness import check, expect_raises, fail, finish, log
from torch import nn

import hvdlite.torch as hvd

torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
GLOBAL, D_IN, D, D_OUT, SEED, STEPS, TOL = 8, 6, 5, 2, 3, 3, 1e-12
ARGS = sys.argv[1:]
DCP_GLOBAL = 12     # --dcp runs on 2, 4 and 3 ranks: a batch every one of them divides
if "--dcp" in ARGS:
    GLOBAL = DCP_GLOBAL


def arg(flag: str):
    return ARGS[ARGS.index(flag) + 1] if flag in ARGS else None


if __name__ == "__main__":
    hvd.init(process_sets="dynamic")
N, R = (hvd.size(), hvd.rank()) if __name__ == "__main__" else (1, 0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 7)     # 7 rows: uneven shards, padding on the last ranks
        self.fc2 = nn.Linear(7, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(D, D_OUT)   # 2 rows: on 4 ranks two hold nothing

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_model() -> Net:
    torch.manual_seed(SEED)
    return Net()


def data(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(GLOBAL, D_IN, generator=g), torch.randn(GLOBAL, D_OUT, generator=g)


def mine(t: torch.Tensor, ranks: int, index: int) -> torch.Tensor:
    per = GLOBAL // ranks
    return t[index * per:(index + 1) * per]


def loss_of(out, y):
    return ((out.to(y.dtype) - y) ** 2).mean()


def make_opt(params):
    return torch.optim.Adam(params, lr=0.02, weight_decay=0.01)


def reference(steps=STEPS, start=0, micro=1, clip=None, compute_dtype=None, model=None,
              opt=None):
    """One process, the whole global batch per step."""
    if model is None:
        model = make_model()
        opt = make_opt(model.parameters())
    for s in range(start, start + steps):
        opt.zero_grad()
        for mi in range(micro):
            x, y = data(s, mi)
            if compute_dtype is None:
                (loss_of(model(x), y) / micro).backward()
            else:
                low = make_model().to(compute_dtype)
                low.load_state_dict(model.state_dict())
                (loss_of(low(x.to(compute_dtype)), y) / micro).backward()
                for p, q in zip(model.parameters(), low.parameters()):
                    p.grad = q.grad.to(p.dtype) if p.grad is None else p.grad + q.grad
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            model._ref_norms = getattr(model, "_ref_norms", []) + [ref_norm]
        opt.step()
    return model, opt


def shard(model: Net, **kw) -> Net:
    for b in model.blocks:
        hvd.fully_shard(b, **kw)
    return hvd.fully_shard(model, **kw)


def train(model, opt, steps=STEPS, start=0, micro=1, clip=None, ranks=None, index=None):
    ranks = N if ranks is None else ranks
    index = R if index is None else index
    norms = []
    for s in range(start, start + steps):
        opt.zero_grad()
        for mi in range(micro):
            x, y = data(s, mi)
            last = mi == micro - 1
            if last:
                (loss_of(model(mine(x, ranks, index)), mine(y, ranks, index)) / micro).backward()
            else:
                with model.no_sync():
                    (loss_of(model(mine(x, ranks, index)),
                             mine(y, ranks, index)) / micro).backward()
        if clip is not None:
            norms.append(hvd.fsdp.clip_grad_norm_(model, clip))
        opt.step()
    return norms


def same_model(model, ref, what, tol=TOL):
    full = hvd.full_state_dict(model)
    for k, v in ref.state_dict().items():
        if k not in full or tuple(full[k].shape) != tuple(v.shape):
            fail(f"{what}: {k} missing or of shape {tuple(full.get(k, v[:0]).shape)}")
        elif not torch.allclose(full[k], v, rtol=tol, atol=tol):
            fail(f"{what}: {k} differs by {(full[k] - v).abs().max().item():.3e}")
    plain = make_model()
    plain.load_state_dict(full)     # what plain torch loads


def same_optimizer(model, opt, ref_opt, what, tol=TOL):
    full = hvd.full_optimizer_state_dict(model, opt)
    ref = ref_opt.state_dict()
    if sorted(full["state"]) != sorted(ref["state"]):
        return fail(f"{what}: state keys {sorted(full['state'])} vs {sorted(ref['state'])}")
    for i, st in ref["state"].items():
        for key, v in st.items():
            w = full["state"][i][key]
            if tuple(w.shape) != tuple(v.shape) or not torch.allclose(w, v, rtol=tol, atol=tol):
                fail(f"{what}: optimizer state[{i}][{key}] differs")
    plain = make_model()
    plain_opt = make_opt(plain.parameters())
    plain_opt.load_state_dict(full)


# ---------------------------------------------------------------------- checks
def adam_fully_sharded():
    model = shard(make_model())
    opt = make_opt(model.parameters())
    total = sum(p.numel() for p in make_model().parameters())
    held = sum(p.numel() for p in model.parameters())
    if held > -(-total // N) + 8 * 6:     # at most one padded row per parameter more
        fail(f"rank {R} holds {held} of {total} parameter elements with {N} ranks")
    if not all(isinstance(m, hvd.FSDPModule) for m in [model, *model.blocks]):
        fail("fully_shard did not make the modules FSDPModules")
    # From the second step on, each block's forward starts with the next block's allgather
    # already under way (prefetch) or done.
    seen = []

    def probe(i):
        def hook(_m, _args):
            if i + 1 < len(model.blocks):
                nxt = model.blocks[i + 1]._hvd_fsdp_unit
                seen.append(nxt._gather is not None or nxt.gathered)
        return hook
    # When backward reaches the first block, the second block's reduce-scatter is in flight:
    # it overlaps the rest of backward.
    overlapped = []

    def watch_backward(_m, _args, out):
        out.register_hook(lambda g: overlapped.append(
            model.blocks[1]._hvd_fsdp_unit._reduce is not None))
    hooks = [b.register_forward_pre_hook(probe(i)) for i, b in enumerate(model.blocks)]
    hooks.append(model.blocks[0].register_forward_hook(watch_backward))
    train(model, opt)
    for h in hooks:
        h.remove()
    per_step = len(model.blocks) - 1
    if seen[:per_step] != [False] * per_step or not all(seen[per_step:]):
        fail(f"forward prefetch: next block in flight per block and step {seen}")
    if not overlapped or not all(overlapped):
        fail(f"backward: block 1's reduce-scatter not in flight during block 0's {overlapped}")
    if any(p.grad is not None and p.grad.shape != p.shape for p in model.parameters()):
        fail("a sharded gradient is not shaped like its shard")
    ref, ref_opt = reference()
    same_model(model, ref, "adam")
    same_optimizer(model, opt, ref_opt, "adam")
    # the gathered parameters are freed between steps
    gathered = [sp for m in model.modules() if hasattr(m, "_hvd_fsdp_unit")
                for sp in m._hvd_fsdp_unit.params if sp.full.untyped_storage().size()]
    if gathered:
        fail(f"{len(gathered)} gathered parameters still hold memory after the step")
    # eval forward (no grad) matches the reference model's output
    x, _ = data(99)
    with torch.no_grad():
        out, want = model(x), ref(x)
    if not torch.allclose(out, want, rtol=TOL, atol=TOL):
        fail("eval forward differs from the reference")


def keep_gathered_after_forward():
    model = shard(make_model(), reshard_after_forward=False)
    opt = make_opt(model.parameters())
    train(model, opt)
    ref, _ = reference()
    same_model(model, ref, "reshard_after_forward=False")


def mixed_precision_policy():
    # output_dtype on the root only (as with FSDP2): a block's float64 output would reach the
    # root's float32 head
    mp = hvd.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    model = make_model()
    for b in model.blocks:
        hvd.fully_shard(b, mp_policy=mp)
    hvd.fully_shard(model, mp_policy=hvd.MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float64, output_dtype=torch.float64))
    opt = make_opt(model.parameters())
    x, _ = data(0)
    out = model(mine(x, N, R))
    if out.dtype != torch.float64:
        fail(f"output_dtype float64: output is {out.dtype}")
    out.sum().backward()
    opt.zero_grad()
    if any(p.dtype != torch.float64 for p in model.parameters()):
        fail("the master (sharded) parameters are no longer float64")
    train(model, opt)
    ref, _ = reference(compute_dtype=torch.float32)
    same_model(model, ref, "MixedPrecisionPolicy(param_dtype=float32)", tol=1e-5)


def bfloat16_compute():
    """bf16 gathers and compute, float32 reduction, float64 masters: the GPU recipe on the CPU.
    bf16 keeps 8 bits of mantissa, so the sums of different batch slices differ by its
    rounding; the check is that the path runs and tracks one process computing in bf16. SGD,
    not Adam: Adam's normalised step turns a rounding difference in a tiny gradient into a
    step of the learning rate's size."""
    mp = hvd.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = make_model()
    for b in model.blocks:
        hvd.fully_shard(b, mp_policy=mp)
    hvd.fully_shard(model, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    unit = model._hvd_fsdp_unit
    if unit.params[0].full.dtype != torch.bfloat16:
        fail(f"the gathered parameters are {unit.params[0].full.dtype}, not bfloat16")
    train(model, opt, steps=2)
    if any(p.grad.dtype != torch.float64 for p in model.parameters() if p.grad is not None):
        fail("bf16: the sharded gradients are not in the masters' float64")
    ref = make_model()
    reference(steps=2, compute_dtype=torch.bfloat16, model=ref,
              opt=torch.optim.SGD(ref.parameters(), lr=0.05))
    same_model(model, ref, "MixedPrecisionPolicy(param_dtype=bfloat16)", tol=2e-3)


def cpu_offload_policy():
    model = shard(make_model(), offload_policy=hvd.CPUOffloadPolicy())
    opt = make_opt(model.parameters())
    train(model, opt)
    if any(p.device.type != "cpu" for p in model.parameters()):
        fail("CPUOffloadPolicy: a shard is not in host memory")
    ref, _ = reference()
    same_model(model, ref, "CPUOffloadPolicy")


def no_sync_accumulation():
    model = shard(make_model())
    opt = make_opt(model.parameters())
    train(model, opt, micro=2)
    ref, _ = reference(micro=2)
    same_model(model, ref, "no_sync (2 micro-batches)")


def clip_grad_norm():
    model = shard(make_model())
    opt = make_opt(model.parameters())
    norms = train(model, opt, clip=0.05)
    ref, _ = reference(clip=0.05)
    for a, b in zip(norms, ref._ref_norms):
        if not torch.allclose(a, b, rtol=TOL, atol=TOL):
            fail(f"clip_grad_norm_ returned {a.item()} but the whole gradients' norm is "
                 f"{b.item()}")
    same_model(model, ref, "clip_grad_norm_")


def hybrid_sharding():
    m = hvd.parallel.mesh(dp_shard=2, dp_replicate=N // 2)
    if m.dp_shard.ranks != [2 * (R // 2), 2 * (R // 2) + 1]:
        fail(f"mesh(dp_shard=2): rank {R}'s shard group is {m.dp_shard.ranks}")
    model = shard(make_model(), process_set=m)
    opt = make_opt(model.parameters())
    held = sum(p.numel() for p in model.parameters())
    train(model, opt)
    ref, _ = reference()
    same_model(model, ref, "hybrid sharding")
    total = sum(p.numel() for p in ref.parameters())
    if held > total // 2 + 8 * 6:
        fail(f"hybrid: rank {R} holds {held} of {total} elements, sharded over 2")


def tensor_parallel_inside_mesh():
    """tp=2 inside the mesh: each tensor-parallel shard sharded again over the dp ranks."""
    from hvdlite.torch import parallel
    m = parallel.mesh(tp=2)
    torch.manual_seed(SEED)
    dense = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, D_OUT))

    class TP(nn.Module):
        def __init__(self):
            super().__init__()
            self.col = parallel.ColumnParallelLinear(D_IN, 8)
            self.row = parallel.RowParallelLinear(8, D_OUT)

        def forward(self, x):
            return self.row(torch.tanh(self.col(x)))

    model = TP()
    parallel.load_full_state_dict(model, {"col.weight": dense[0].weight, "col.bias": dense[0].bias,
                                          "row.weight": dense[2].weight, "row.bias": dense[2].bias})
    hvd.fully_shard(model.col, process_set=m)
    hvd.fully_shard(model, process_set=m)
    opt = make_opt(model.parameters())
    ref_opt = make_opt(dense.parameters())
    for s in range(STEPS):
        x, y = data(s)
        opt.zero_grad()
        loss_of(model(mine(x, m.dp_size, m.dp_rank)), mine(y, m.dp_size, m.dp_rank)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of(dense(x), y).backward()
        ref_opt.step()
    full = hvd.full_state_dict(model)
    t, half = m.tp_rank, 4
    want = {"col.weight": dense[0].weight[t * half:(t + 1) * half],
            "col.bias": dense[0].bias[t * half:(t + 1) * half],
            "row.weight": dense[2].weight[:, t * half:(t + 1) * half], "row.bias": dense[2].bias}
    for k, v in want.items():
        if tuple(full[k].shape) != tuple(v.shape) or not torch.allclose(full[k], v, rtol=TOL,
                                                                        atol=TOL):
            fail(f"tp=2 x fully_shard: {k} differs from the dense model's slice")


def compiled_blocks():
    model = make_model()
    shard(model)
    for b in model.blocks:
        b.forward = torch.compile(b.forward, backend="aot_eager")
    opt = make_opt(model.parameters())
    train(model, opt, steps=2)
    ref, _ = reference(steps=2)
    same_model(model, ref, "torch.compile on the blocks")


def distributed_optimizer_refused():
    model = shard(make_model())
    named = list(model.named_parameters())
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(make_opt(model.parameters()),
                                                               named_parameters=named),
                  "DistributedOptimizer over shards",
                  match=["fully_shard", "plain torch.optim", "reduce_dtype"])


def bad_inputs():
    model = shard(make_model())
    expect_raises(ValueError, lambda: hvd.fully_shard(model.blocks[0]), "sharded twice",
                  match=["Block", "already sharded", "once per module", "every rank"])
    tied = make_model()
    tied.blocks[1].fc1.weight = tied.blocks[0].fc1.weight
    hvd.fully_shard(tied.blocks[0])
    expect_raises(ValueError, lambda: hvd.fully_shard(tied.blocks[1]), "shared parameter",
                  match=["fc1.weight", "already sharded", "common parent"])
    differs = make_model() if R != N - 1 else Net(blocks=2)
    expect_raises(ValueError, lambda: hvd.fully_shard(differs), "model differs",
                  match=["Net", "differs", f"rank {N - 1}", "same model"])
    ps = hvd.parallel.find_process_set([0])
    added = ps is None
    ps = hvd.add_process_set([0]) if added else ps
    expect_raises(ValueError, lambda: hvd.fully_shard(make_model(), process_set=ps),
                  "process set without this rank",
                  match=["rank 1", "not in its process_set", "every rank"])
    if added:
        hvd.remove_process_set(ps)
    # after the refusals the job still trains
    ok = shard(make_model())
    train(ok, make_opt(ok.parameters()), steps=1)
    ref, _ = reference(steps=1)
    same_model(ok, ref, "training after refusals")


def tied_weight_inside_one_block():
    def tie(m):
        m.blocks[2].fc1.weight = m.blocks[1].fc1.weight
        return m
    model = make_model()
    tie(model)
    hvd.fully_shard(model.blocks[0])
    hvd.fully_shard(model)              # the root holds both blocks 1 and 2: one shard
    opt = make_opt(model.parameters())
    train(model, opt)
    torch.manual_seed(SEED)
    ref = tie(Net())
    ref_opt = make_opt(ref.parameters())
    reference(model=ref, opt=ref_opt)
    full = hvd.full_state_dict(model)
    for k, v in ref.state_dict().items():
        if not torch.allclose(full[k], v, rtol=TOL, atol=TOL):
            fail(f"tied: {k} differs")


def checkpoint_round(load_dir, save_dir, steps):
    if "--dcp" in ARGS:
        return dcp_checkpoint_round(load_dir, save_dir, steps)
    model = shard(make_model())
    opt = make_opt(model.parameters())
    start = 0
    if load_dir:
        files = sorted(glob.glob(os.path.join(load_dir, "rank*.pt")))
        saved = [torch.load(f, weights_only=False) for f in files]
        hvd.load_sharded_state_dict(model, saved, optimizer=opt)
        start = saved[0]["step"]
        log(f"loaded {len(saved)} ranks' shards at step {start}")
    train(model, opt, steps=steps, start=start)
    ref, _ = reference(steps=start + steps)
    same_model(model, ref, f"after loading {load_dir} and {steps} steps")
    sd = hvd.sharded_state_dict(model, opt)
    if not any(isinstance(v, hvd.shard.LocalShard) for v in sd["model"].values()):
        fail("sharded_state_dict holds no LocalShard")
    sd["step"] = start + steps
    os.makedirs(save_dir, exist_ok=True)
    torch.save(sd, os.path.join(save_dir, f"rank{R}.pt"))


def dcp_checkpoint_round(load_dir, save_dir, steps):
    """The model and its Adam state through hvdlite.torch.checkpoint: each rank reads only the
    rows it holds now, whatever number of ranks saved."""
    from hvdlite.torch import checkpoint

    model = shard(make_model())
    opt = make_opt(model.parameters())
    state = {"model": model, "optimizer": opt, "step": 0}
    if load_dir:
        log(f"loaded {checkpoint.load(load_dir, state)} at step {state['step']}")
    start = state["step"]
    if start:
        ref, ref_opt = reference(steps=start)
        same_model(model, ref, f"loaded from {load_dir}")
        same_optimizer(model, opt, ref_opt, f"loaded from {load_dir}")
    train(model, opt, steps=steps, start=start)
    ref, ref_opt = reference(steps=start + steps)
    same_model(model, ref, f"after {steps} steps from {start}")
    same_optimizer(model, opt, ref_opt, f"after {steps} steps from {start}")
    state["step"] = start + steps
    checkpoint.save(state, os.path.join(save_dir, f"commit-{start + steps:04d}"), async_=False)


if __name__ == "__main__":
    if "--only" in ARGS:            # one check by name, for debugging
        check(arg("--only"), globals()[arg("--only")])
    elif "--save" in ARGS:
        check("checkpoint_round", checkpoint_round, arg("--load"), arg("--save"),
              int(arg("--steps") or 2))
    else:
        check("adam_fully_sharded", adam_fully_sharded)
        check("keep_gathered_after_forward", keep_gathered_after_forward)
        check("mixed_precision_policy", mixed_precision_policy)
        check("bfloat16_compute", bfloat16_compute)
        check("cpu_offload_policy", cpu_offload_policy)
        check("no_sync_accumulation", no_sync_accumulation)
        check("clip_grad_norm", clip_grad_norm)
        check("tied_weight_inside_one_block", tied_weight_inside_one_block)
        check("distributed_optimizer_refused", distributed_optimizer_refused)
        check("bad_inputs", bad_inputs)
        if "--compile" in ARGS:
            check("compiled_blocks", compiled_blocks)
        if "--hybrid" in ARGS:      # last: the meshes become the default process sets
            check("hybrid_sharding", hybrid_sharding)
            check("bad_inputs_hybrid", bad_inputs)
            check("tensor_parallel_inside_mesh", tensor_parallel_inside_mesh)
    finish()
    hvd.shutdown()
