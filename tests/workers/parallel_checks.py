"""hvdlite.torch.parallel on real ranks (hvdlite-run, gloo), against the dense single-process
model every rank computes locally: tensor parallel with tp = world size, pipeline parallel with
pp = world size (both schedules, m in {p, 2p, odd}), and on 4 ranks tp=2 x pp=2 and the
compositions with data parallelism. One `CHECK <name> OK|FAIL` line per check and rank.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import hvdlite.torch as hvd
from hvdlite.torch import parallel as P
from parallel_common import check, close, equal, expect_raises, fail, finish, log
from parallel_models import (dense_lm_loss, gpt_batch, gpt_layers, pp_layers, tp_lm_loss)

torch.set_num_threads(1)
hvd.init(process_sets="dynamic")
rank, size = hvd.rank(), hvd.size()
LR = 0.1


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def dense_step(model, x, y, loss_fn, steps=1):
    """Loss, outputs, grads and post-step weights of the dense model (in place on `model`)."""
    opt = sgd(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), out.detach(), grads, weights


# ============================================================================ tensor parallel
def tp_init_slices(tp):
    k, r = tp.size(), tp.rank()
    single = P.find_process_set([rank])
    for seed in (0, 1):
        torch.manual_seed(seed)
        lin = nn.Linear(12, 8)
        emb = nn.Embedding(16, 6)
        torch.manual_seed(seed)
        col = P.ColumnParallelLinear(12, 8, process_set=tp)
        emb_p = P.VocabParallelEmbedding(16, 6, process_set=tp)
        torch.manual_seed(seed)
        col1 = P.ColumnParallelLinear(12, 8, process_set=single)
        emb1 = P.VocabParallelEmbedding(16, 6, process_set=single)
        equal(col.weight, lin.weight.chunk(k, 0)[r], f"column weight shard (seed {seed})")
        equal(col.bias, lin.bias.chunk(k, 0)[r], "column bias shard")
        equal(col.weight, col1.weight.chunk(k, 0)[r], "column shard vs tp=1 layer")
        equal(emb_p.weight, emb.weight.chunk(k, 0)[r], "vocab embedding shard")
        equal(emb_p.weight, emb1.weight.chunk(k, 0)[r], "vocab embedding shard vs tp=1 layer")
        torch.manual_seed(seed)
        lin2 = nn.Linear(8, 12)
        torch.manual_seed(seed)
        row = P.RowParallelLinear(8, 12, process_set=tp)
        torch.manual_seed(seed)
        row1 = P.RowParallelLinear(8, 12, process_set=single)
        equal(row.weight, lin2.weight.chunk(k, 1)[r], "row weight shard")
        equal(row.bias, lin2.bias, "row bias (replicated)")
        equal(row.weight, row1.weight.chunk(k, 1)[r], "row shard vs tp=1 layer")
    # custom init
    torch.manual_seed(3)
    full = torch.empty(8, 4)
    nn.init.normal_(full, 0, 0.02)
    torch.manual_seed(3)
    c = P.ColumnParallelLinear(4, 8, process_set=tp, init_method=lambda w: nn.init.normal_(w, 0,
                                                                                           0.02))
    equal(c.weight, full.chunk(k, 0)[r], "init_method shard")
    equal(c.bias, torch.zeros(8 // k), "bias defaults to zeros with init_method")
    assert c.weight.tensor_parallel and c.weight.partition_dim == 0


def tp_mappings(tp):
    k, r = tp.size(), tp.rank()
    base = [torch.arange(12, dtype=torch.float32).view(3, 4) * (j + 1) for j in range(k)]
    x = base[r].clone().requires_grad_(True)
    y = P.copy_to_tensor_parallel_region(x, tp, name="map.copy")
    equal(y, base[r], "copy forward is identity")
    y.backward(torch.full_like(y, float(r + 1)))
    equal(x.grad, torch.full((3, 4), float(sum(range(1, k + 1)))), "copy backward sums")
    x = base[r].clone().requires_grad_(True)
    y = P.reduce_from_tensor_parallel_region(x, tp, name="map.reduce")
    equal(y, sum(base), "reduce forward sums")
    y.backward(torch.ones_like(y) * 3)
    equal(x.grad, torch.full((3, 4), 3.0), "reduce backward is identity")
    full = torch.arange(6 * 4 * k, dtype=torch.float32).view(6, 4 * k)
    x = full.clone().requires_grad_(True)
    y = P.scatter_to_tensor_parallel_region(x, tp, name="map.scatter")
    equal(y, full[:, 4 * r:4 * (r + 1)], "scatter keeps this rank's slice")
    y.backward(torch.full_like(y, float(r + 1)))
    want = torch.cat([torch.full((6, 4), float(j + 1)) for j in range(k)], dim=-1)
    equal(x.grad, want, "scatter backward gathers")
    x = full[:, 4 * r:4 * (r + 1)].clone().requires_grad_(True)
    y = P.gather_from_tensor_parallel_region(x, tp, name="map.gather")
    equal(y, full, "gather concatenates the last dimension")
    y.backward(want)
    equal(x.grad, torch.full((6, 4), float(r + 1)), "gather backward slices")
    # unnamed calls (named by call site) work too, forward and backward
    x = base[r].clone().requires_grad_(True)
    P.reduce_from_tensor_parallel_region(P.copy_to_tensor_parallel_region(x, tp), tp).sum() \
        .backward()
    equal(x.grad, torch.full((3, 4), float(k)), "unnamed copy+reduce gradient")
    expect_raises(ValueError, lambda: P.scatter_to_tensor_parallel_region(
        torch.ones(2, 4 * k + 1), tp), "scatter of an indivisible dimension",
        match="not divisible") if k > 1 else None


def _tp_compare(tp_model, dense, x, y, tp_loss, dense_loss, what, steps=2, out_slice=None):
    """Run `steps` SGD steps on both; compare loss, outputs, full gradients and full weights."""
    opt_t = sgd(tp_model.parameters())
    opt_d = sgd(dense.parameters())
    for step in range(steps):
        opt_t.zero_grad()
        opt_d.zero_grad()
        out_t = tp_model(x)
        out_d = dense(x)
        lt, ld = tp_loss(out_t, y), dense_loss(out_d, y)
        lt.backward()
        ld.backward()
        close(lt.detach(), ld.detach(), f"{what} loss (step {step})")
        close(out_t.detach(), out_slice(out_d.detach()) if out_slice else out_d.detach(),
              f"{what} outputs (step {step})")
        grads = P.gather_state_dict(tp_model, grads=True)
        for n, p in dense.named_parameters():
            close(grads[n], p.grad, f"{what} gradient of {n} (step {step})")
        opt_t.step()
        opt_d.step()
        weights = P.gather_state_dict(tp_model)
        for n, p in dense.named_parameters():
            close(weights[n], p.detach(), f"{what} weight {n} after step {step}")


class _MLP(nn.Module):
    def __init__(self, tp, d=8, hidden=16, gather=False, parallel_input=True, bias=True):
        super().__init__()
        if tp is None:
            self.fc1, self.fc2 = nn.Linear(d, hidden, bias=bias), nn.Linear(hidden, d, bias=bias)
        else:
            self.fc1 = P.ColumnParallelLinear(d, hidden, bias=bias, gather_output=gather,
                                              process_set=tp)
            self.fc2 = P.RowParallelLinear(hidden, d, bias=bias, input_is_parallel=parallel_input,
                                           process_set=tp)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def tp_mlp(tp):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    for gather, par, bias in [(False, True, True), (True, False, True), (False, True, False)]:
        torch.manual_seed(11)
        dense = _MLP(None, bias=bias)
        torch.manual_seed(11)
        mlp = _MLP(tp, gather=gather, parallel_input=par, bias=bias)
        _tp_compare(mlp, dense, x, y, F.mse_loss, F.mse_loss,
                    f"mlp(gather_output={gather}, input_is_parallel={par}, bias={bias})")


def tp_embedding(tp):
    ids = torch.randint(0, 16, (5, 7), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(5)
    dense = nn.Embedding(16, 6)
    torch.manual_seed(5)
    emb = P.VocabParallelEmbedding(16, 6, tp)
    out = emb(ids)
    equal(out, dense(ids), "embedding lookup (sums of one row and zeros are exact)")
    w = torch.randn(5, 7, 6, generator=torch.Generator().manual_seed(6))
    (out * w).sum().backward()
    (dense(ids) * w).sum().backward()
    full = P.gather_state_dict(emb, grads=True)["weight"]
    close(full, dense.weight.grad, "embedding gradient")


def tp_cross_entropy(tp):
    k, r = tp.size(), tp.rank()
    vocab = 8 * k
    g = torch.Generator().manual_seed(9)
    logits_full = torch.randn(4, 5, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (4, 5), generator=g)
    target[0, :2] = -100
    target[3, 4] = 7
    for eps in (0.0, 0.1):
        for reduction in ("mean", "sum", "none"):
            lf = logits_full.clone().requires_grad_(True)
            ls = logits_full[..., 8 * r:8 * (r + 1)].clone().requires_grad_(True)
            ref = F.cross_entropy(lf.reshape(-1, vocab), target.reshape(-1), ignore_index=-100,
                                  label_smoothing=eps, reduction=reduction)
            got = P.vocab_parallel_cross_entropy(ls, target, tp, label_smoothing=eps,
                                                 reduction=reduction)
            if reduction == "none":
                ref = ref.view(4, 5)
            close(got.detach(), ref.detach(), f"cross entropy eps={eps} {reduction}")
            wt = torch.rand(ref.shape, generator=torch.Generator().manual_seed(10))
            (ref * wt).sum().backward()
            (got * wt).sum().backward()
            close(ls.grad, lf.grad[..., 8 * r:8 * (r + 1)],
                  f"cross entropy gradient eps={eps} {reduction}")
    ignore = torch.full((2, 3), 5)
    got = P.vocab_parallel_cross_entropy(torch.zeros(2, 3, 8), ignore, tp, ignore_index=5)
    if not torch.isnan(got):
        fail("all targets ignored: mean should be nan like torch")
    expect_raises(ValueError, lambda: P.vocab_parallel_cross_entropy(
        torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long), tp), "shape mismatch",
        match="targets of shape")


def tp_gpt(tp):
    x, y = gpt_batch(4)
    k, r = tp.size(), tp.rank()
    torch.manual_seed(21)
    dense = P.SkipSequential(gpt_layers(None))
    torch.manual_seed(21)
    model = P.SkipSequential(gpt_layers(tp))
    _tp_compare(model, dense, x, y, tp_lm_loss(tp), dense_lm_loss, "gpt tp",
                out_slice=lambda o: o.chunk(k, -1)[r])


def tp_rng(tp, dp_set):
    r = tp.rank()

    def draw():
        x = torch.ones(64)
        out = F.dropout(x, 0.5)
        with P.get_rng_tracker().fork():
            inside = F.dropout(x, 0.5)
        after = F.dropout(x, 0.5)
        return out, inside, after

    P.model_parallel_seed(1234, tp)
    a = draw()
    P.model_parallel_seed(1234, tp)
    b = draw()
    for u, v, what in zip(a, b, ["outside", "inside", "outside after fork"]):
        equal(u, v, f"dropout {what} a TP region is reproducible")
    # Outside: identical on every tensor-parallel rank; inside: different per tp rank.
    outs = hvd.allgather(a[0].unsqueeze(0), name="rng.outside", process_set=tp)
    ins = hvd.allgather(a[1].unsqueeze(0), name="rng.inside", process_set=tp)
    for j in range(tp.size()):
        equal(outs[j], outs[0], f"outside mask of tp rank {j} equals tp rank 0's")
        if j != r and torch.equal(ins[j], ins[r]):
            fail(f"inside masks of tp ranks {r} and {j} are equal")
    # the fork leaves the default stream untouched
    torch.manual_seed(1234)
    plain = F.dropout(torch.ones(64), 0.5), F.dropout(torch.ones(64), 0.5)
    equal(a[0], plain[0], "default stream unchanged by model_parallel_seed")
    equal(a[2], plain[1], "default stream unchanged by fork")
    if dp_set is not None and dp_set.size() > 1:
        same = hvd.allgather(a[1].unsqueeze(0), name="rng.dp", process_set=dp_set)
        for j in range(dp_set.size()):
            equal(same[j], same[0], "inside mask identical across data-parallel replicas")
    expect_raises(KeyError, lambda: P.get_rng_tracker().fork("nope").__enter__(),
                  "unknown stream", match="model_parallel_seed")
    expect_raises(ValueError, lambda: P.get_rng_tracker().add("again", 1234 + 2718 + r),
                  "duplicate seed", match="already used")


def tp_checkpoint(tp):
    torch.manual_seed(31)
    mlp = _MLP(tp)

    def fn(x):
        h = F.dropout(x, 0.3)                       # replicated region: default stream
        h = mlp.fc1(h)
        with P.get_rng_tracker().fork():
            h = F.dropout(h, 0.3)                   # sharded region: tracked stream
        return mlp.fc2(F.gelu(h))

    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(32))
    results = []
    for use_ckpt in (False, True):
        P.model_parallel_seed(77, tp)
        mlp.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = P.checkpoint(fn, xi) if use_ckpt else fn(xi)
        out.pow(2).sum().backward()
        results.append((out.detach(), xi.grad.clone(),
                        [q.grad.clone() for q in mlp.parameters()]))
    equal(results[1][0], results[0][0], "checkpointed output")
    equal(results[1][1], results[0][1], "checkpointed input gradient (dropout replayed)")
    for g1, g0 in zip(results[1][2], results[0][2]):
        equal(g1, g0, "checkpointed parameter gradient")


def tp_errors(tp):
    k = tp.size()
    expect_raises(ValueError, lambda: P.ColumnParallelLinear(8, 4 * k + 1, process_set=tp),
                  "column out_features", match=["out_features", "not divisible",
                                                f"tensor-parallel size {k}"])
    expect_raises(ValueError, lambda: P.RowParallelLinear(4 * k + 1, 8, process_set=tp),
                  "row in_features", match=["in_features", "not divisible"])
    expect_raises(ValueError, lambda: P.VocabParallelEmbedding(4 * k + 3, 8, process_set=tp),
                  "embedding vocab", match=["num_embeddings", "not divisible"])
    row = P.RowParallelLinear(4 * k, 3, process_set=tp)
    expect_raises(ValueError, lambda: row(torch.ones(2, 4 * k)), "row with a full input",
                  match="input_is_parallel=False")
    expect_raises(ValueError, lambda: P.mesh(tp=3), "mesh tp=3",
                  match=["does not match the world size", f"{size}"])
    expect_raises(ValueError, lambda: P.mesh(tp=size, pp=2, dp=2), "mesh needing more ranks",
                  match=[f"needs tp * pp * dp = {size * 4} ranks", f"has {size}"])
    expect_raises(ValueError, lambda: P.mesh(tp=0), "mesh tp=0", match="positive integer")


def mesh_layout():
    for tp, pp in [(size, 1), (1, size)] + ([(2, 2)] if size == 4 else []):
        m = P.mesh(tp=tp, pp=pp)
        dp = size // (tp * pp)
        assert (m.tp_size, m.pp_size, m.dp_size) == (tp, pp, dp)
        assert m.rank_of(tp=m.tp_rank, pp=m.pp_rank, dp=m.dp_rank) == rank
        assert rank == m.tp_rank + tp * (m.dp_rank + dp * m.pp_rank), "Megatron layout"
        assert m.tp.ranks == [m.rank_of(tp=i, pp=m.pp_rank, dp=m.dp_rank) for i in range(tp)] \
            or (tp == size and m.tp.process_set_id == 0)
        assert sorted(m.pp.ranks or range(size)) == \
            [m.rank_of(tp=m.tp_rank, pp=j, dp=m.dp_rank) for j in range(pp)]
        assert m.tp.rank() == m.tp_rank and m.pp.rank() == m.pp_rank
        assert P.current_mesh() is m
        text = str(m)
        for want in (f"tp={tp}, pp={pp}, dp={dp}", "tp groups:", "pp groups:", "dp groups:",
                     f"this rank (*): {rank}"):
            if want not in text:
                fail(f"rank map lacks {want!r}:\n{text}")
        if rank == 0 and (tp, pp) == ((2, 2) if size == 4 else (size, 1)):
            log("MESH\n" + text)
    groups = P.mesh_groups(16, tp=2, pp=4)
    assert groups["tp"][:2] == [[0, 1], [2, 3]], groups["tp"]
    assert groups["dp"][:2] == [[0, 2], [1, 3]], groups["dp"]
    assert groups["pp"][:2] == [[0, 4, 8, 12], [1, 5, 9, 13]], groups["pp"]


# ============================================================================ pipeline
def _pp_compare(pipe, dense, x, y, loss_fn, what, dense_loss=None, steps=1, gathered=False,
                out_slice=None, opt_factory=sgd):
    """train_step + optimizer step on the pipeline vs the dense model; compare loss (last
    stage), outputs (last stage), this stage's gradients and weights after the step."""
    dense_loss = dense_loss or loss_fn
    opt_p = opt_factory(list(pipe.parameters()) or [torch.zeros(1, requires_grad=True)])
    opt_d = opt_factory(dense.parameters())
    for step in range(steps):
        opt_p.zero_grad()
        opt_d.zero_grad()
        loss, out = pipe.train_step(x if pipe.is_first_stage else None,
                                    y if pipe.is_last_stage else None,
                                    loss_fn if pipe.is_last_stage else None,
                                    return_outputs=True)
        out_d = dense(x)
        ld = dense_loss(out_d, y)
        ld.backward()
        if pipe.is_last_stage:
            close(loss, ld.detach(), f"{what} loss (step {step})")
            close(out, out_slice(out_d.detach()) if out_slice else out_d.detach(),
                  f"{what} outputs (step {step})")
        else:
            if loss is not None or out is not None:
                fail(f"{what}: stage {pipe.stage} returned a loss/outputs")
        dparams = dict(dense.named_parameters())
        grads = P.gather_state_dict(pipe, grads=True) if gathered else \
            {n: q.grad for n, q in pipe.named_parameters()}
        for n, g in grads.items():
            close(g, dparams[n].grad, f"{what} gradient of {n} (step {step})")
        opt_p.step()
        opt_d.step()
        weights = P.gather_state_dict(pipe) if gathered else \
            {n: q.detach() for n, q in pipe.named_parameters()}
        for n, w in weights.items():
            close(w, dparams[n].detach(), f"{what} weight {n} after step {step}")
    expected = sum(1 for n in dict(dense.named_parameters())
                   if int(n.split(".")[1]) in range(*pipe.partition[pipe.stage]))
    if len(list(pipe.parameters())) != expected:
        fail(f"{what}: stage holds {len(list(pipe.parameters()))} parameters, expected {expected}")


def _pp_pair(layers_fn, seed, **kw):
    torch.manual_seed(seed)
    dense = P.SkipSequential(layers_fn())
    torch.manual_seed(seed)
    pipe = P.Pipeline(layers_fn(), **kw)
    return dense, pipe


def pp_equivalence(schedule, m, checkpoint="never", batch=None):
    pp = P.current_mesh().pp
    batch = batch or max(2 * m, 6)
    g = torch.Generator().manual_seed(100 + m)
    x = torch.randn(batch, 8, generator=g)
    y = torch.randn(batch, 4, generator=g)
    dense, pipe = _pp_pair(pp_layers, 41 + m, chunks=m, schedule=schedule,
                           checkpoint=checkpoint, process_set=pp)
    if pipe.schedule_report.bubble <= 0 and pipe.num_stages > 1:
        fail("simulated bubble should be positive")
    what = f"pp{pipe.num_stages} {schedule} m={m} checkpoint={checkpoint}"
    _pp_compare(pipe, dense, x, y, F.mse_loss, what, steps=2)


def pp_forward_only():
    pp = P.current_mesh().pp
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(5))
    dense, pipe = _pp_pair(pp_layers, 3, chunks=3, process_set=pp)
    out = pipe(x if pipe.is_first_stage else None)
    if pipe.is_last_stage:
        close(out, dense(x).detach(), "forward-only outputs")
    elif out is not None:
        fail("forward() returned outputs on a non-last stage")
    if any(q.grad is not None for q in pipe.parameters()):
        fail("forward() produced gradients")


class _Trunc(nn.Module):
    """Changes the sequence length with the micro-batch: shapes differ per micro-batch."""

    def forward(self, x):
        keep = 2 + x.shape[0] % 3
        return x[:, :keep]


class _Pool(nn.Module):
    def forward(self, x):
        return x.mean(1)


def pp_variable_shapes():
    pp = P.current_mesh().pp

    def layers():
        return [nn.Linear(4, 6), _Trunc(), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                nn.Linear(6, 6), _Pool(), nn.Linear(6, 3)]

    x = torch.randn(11, 5, 4, generator=torch.Generator().manual_seed(8))
    y = torch.randn(11, 3, generator=torch.Generator().manual_seed(9))

    def loss_sum(out, t):
        return ((out - t) ** 2).sum()

    class Dense(nn.Module):
        """The same computation, micro-batch by micro-batch (the model depends on the split)."""

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(layers())

        def forward(self, inp):
            outs = []
            for part in torch.tensor_split(inp, 5):
                h = part
                for layer in self.layers:
                    h = layer(h)
                outs.append(h)
            return torch.cat(outs)

    torch.manual_seed(12)
    dense = Dense()
    torch.manual_seed(12)
    pipe = P.Pipeline(layers(), chunks=5, schedule="gpipe", process_set=pp,
                      balance=[2, 6] if pp.size() == 2 else [2, 2, 2, 2], loss_reduction="sum")
    _pp_compare(pipe, dense, x, y, loss_sum, "variable shapes", steps=1)


def pp_balance():
    pp = P.current_mesh().pp
    p = pp.size()
    layers = pp_layers()
    pipe = P.Pipeline(layers, balance="params", chunks=2, process_set=pp)
    from hvdlite.torch.parallel import balance as B
    costs = B.param_costs(pp_layers())
    want = B.by_cost(costs, p)
    if pipe.balance != want or sum(pipe.balance) != 12:
        fail(f"balance='params' gave {pipe.balance}, expected {want}")
    stage_costs = [sum(costs[a:b]) for a, b in pipe.partition]
    if max(stage_costs) > sum(costs) / p * 2.5:
        fail(f"params split is unbalanced: {stage_costs}")
    sample = torch.randn(3, 8)
    dense, pipe = _pp_pair(pp_layers, 55, balance="time", sample=sample, chunks=3,
                           process_set=pp)
    splits = hvd.allgather_object(pipe.balance, name="check.time_split")
    if any(sp != splits[0] for sp in splits):
        fail(f"balance='time' differs between ranks: {splits}")
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    _pp_compare(pipe, dense, x, y, F.mse_loss, f"balance=time {pipe.balance}")
    explicit = [12 - (p - 1)] + [1] * (p - 1)
    dense, pipe = _pp_pair(pp_layers, 56, balance=explicit, chunks=2, process_set=pp)
    if pipe.balance != explicit:
        fail(f"explicit balance ignored: {pipe.balance}")
    _pp_compare(pipe, dense, x, y, F.mse_loss, f"balance={explicit}")


def pp_factories():
    pp = P.current_mesh().pp
    p = pp.size()
    built = []

    def factory(i, n_in, n_out):
        def make():
            torch.manual_seed(500 + i)
            built.append(i)
            return nn.Linear(n_in, n_out)
        return make

    dims = [8] + [10] * (2 * p - 1) + [4]
    facs = [factory(i, dims[i], dims[i + 1]) for i in range(2 * p)]
    pipe = P.Pipeline(facs, chunks=2, process_set=pp)
    lo, hi = pipe.partition[pipe.stage]
    if sorted(built) != list(range(lo, hi)):
        fail(f"factories built {sorted(built)} on stage {pipe.stage}, expected {lo}..{hi - 1}")
    dense = P.SkipSequential([f() for f in facs])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    y = torch.randn(4, 4, generator=torch.Generator().manual_seed(4))
    _pp_compare(pipe, dense, x, y, F.mse_loss, "factories")
    expect_raises(ValueError, lambda: P.Pipeline(facs, balance="params", process_set=pp),
                  "params balance with factories", match="factory")


def pp_custom_schedule():
    pp = P.current_mesh().pp
    p = pp.size()
    m = 3
    # Forward all, then backward in forward order (neither GPipe's nor 1F1B's order).
    custom = [[f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)] for _ in range(p)]
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    dense, pipe = _pp_pair(pp_layers, 61, chunks=m, schedule=custom, process_set=pp)
    _pp_compare(pipe, dense, x, y, F.mse_loss, "custom schedule")
    # Stage 1 wants F1 before F0 while stage 0 waits for B0's gradient: deadlock.
    bad = [["F0", "B0", "F1", "B1"]] + [["F1", "F0", "B0", "B1"]] * (p - 1)
    err = expect_raises(P.ScheduleError, lambda: P.Pipeline(pp_layers(), chunks=2, schedule=bad,
                                                            process_set=pp),
                        "deadlocking custom schedule", match=["deadlock", "stage 1", "waits for"])
    if rank == 0 and err is not None:
        log("DEADLOCK-REPORT " + str(err).replace("\n", " | "))
    expect_raises(P.ScheduleError, lambda: P.Pipeline(
        pp_layers(), chunks=2, schedule=[["F0", "F1", "B0"]] * p, process_set=pp),
        "custom schedule missing B1", match="never runs B1")
    expect_raises(P.ScheduleError, lambda: P.Pipeline(
        pp_layers(), chunks=2, schedule=[["B0", "F0", "F1", "B1"]] * p, process_set=pp),
        "backward before forward", match="before F0")


def pp_errors():
    pp = P.current_mesh().pp
    p = pp.size()
    L = pp_layers
    expect_raises(ValueError, lambda: P.Pipeline(L(), balance=[5] * p, process_set=pp),
                  "balance that does not sum to the layer count",
                  match=[f"sums to {5 * p}", "12 layers"])
    expect_raises(ValueError, lambda: P.Pipeline(L(), balance=[12], process_set=pp),
                  "balance with the wrong length", match=["has 1 entries", f"{p} stages"])
    expect_raises(ValueError, lambda: P.Pipeline(L(), balance=[0] + [12 // (p - 1)] * (p - 1)
                                                 if p > 1 else [0], process_set=pp),
                  "empty stage", match="at least one layer")
    for bad in (0, -2, 1.5, True):
        expect_raises(ValueError, lambda: P.Pipeline(L(), chunks=bad, process_set=pp),
                      f"chunks={bad!r}", match="chunks must be an integer >= 1")
    expect_raises(ValueError, lambda: P.Pipeline(L(), checkpoint="sometimes", process_set=pp),
                  "bad checkpoint", match="checkpoint must be")
    expect_raises(ValueError, lambda: P.Pipeline(L(), schedule="zb", process_set=pp),
                  "bad schedule", match="'gpipe', '1f1b'")
    expect_raises(ValueError, lambda: P.Pipeline(L(), balance="memory", process_set=pp),
                  "bad balance", match="'uniform', 'params', 'time'")
    expect_raises(ValueError, lambda: P.Pipeline(L(), balance="time", process_set=pp),
                  "time without sample", match="sample=")
    expect_raises(ValueError, lambda: P.Pipeline([nn.Linear(2, 2)] * (p - 1) if p > 1 else [],
                                                 process_set=pp),
                  "too few layers", match="at least one layer")
    expect_raises(ValueError, lambda: P.Pipeline([P.Pop("a"), P.Stash("a")], process_set=pp),
                  "Pop before Stash", match="comes before any Stash")
    expect_raises(ValueError, lambda: P.Pipeline([P.Stash("a"), nn.Tanh()], process_set=pp),
                  "Stash never popped", match="never popped")
    # Different arguments on different ranks of one pipeline: every rank raises.
    counts = [12 - (p - 1)] + [1] * (p - 1) if rank == 0 else [1] * (p - 1) + [12 - (p - 1)]
    expect_raises(P.PipelineError, lambda: P.Pipeline(L(), balance=counts, process_set=pp),
                  "ranks disagree on balance", match=["built differently", "balance"])
    x = torch.randn(2, 8)
    pipe = P.Pipeline(L(), chunks=3, process_set=pp)
    if pipe.is_first_stage:
        expect_raises(ValueError, lambda: pipe.train_step(x, None, None) if p > 1 else
                      pipe.train_step(x, torch.zeros(2, 4), F.mse_loss), "batch < chunks",
                      match=["chunks=3", "at least 3 rows"])


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def pp_stall_warning():
    pp = P.current_mesh().pp
    dense, pipe = _pp_pair(pp_layers, 71, chunks=2, process_set=pp, warn_after=0.5)
    cap = _Capture()
    logging.getLogger("hvdlite").addHandler(cap)
    try:
        if pipe.is_first_stage:
            time.sleep(2.0)
        x = torch.randn(4, 8)
        pipe.train_step(x, torch.zeros(4, 4), F.mse_loss)
    finally:
        logging.getLogger("hvdlite").removeHandler(cap)
    if pipe.stage == 1:
        name = f"pipe{pipe._uid}.fwd.0>1.mb0"
        hits = [r for r in cap.records if name in r and "waited" in r]
        if not hits:
            fail(f"stage 1 did not report the message it waits for ({name}): {cap.records}")
        else:
            log("STALL-WARNING " + hits[0])


def pp_dp():
    """pp=2 x dp=2 with DistributedOptimizer(process_set=mesh.dp): each replica trains on half
    the batch; the result equals the dense model on the whole batch."""
    m = P.mesh(pp=2, dp=2)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(81)
    dense = P.SkipSequential(pp_layers())
    torch.manual_seed(81)
    pipe = P.Pipeline(pp_layers(), chunks=2, schedule="1f1b", process_set=m.pp)
    opt = hvd.DistributedOptimizer(sgd(pipe.parameters()), named_parameters=pipe.named_parameters(),
                                   process_set=m.dp)
    opt_d = sgd(dense.parameters())
    half = slice(4 * m.dp_rank, 4 * (m.dp_rank + 1))
    for step in range(2):
        opt.zero_grad()
        opt_d.zero_grad()
        loss = pipe.train_step(x[half], y[half], F.mse_loss)
        ld = F.mse_loss(dense(x), y)
        ld.backward()
        opt.step()
        opt_d.step()
        dparams = dict(dense.named_parameters())
        for n, q in pipe.named_parameters():
            close(q.grad, dparams[n].grad, f"pp x dp gradient of {n} (step {step})")
            close(q.detach(), dparams[n].detach(), f"pp x dp weight {n} after step {step}")
        if pipe.is_last_stage:
            mean = hvd.allreduce(loss.reshape(1), op=hvd.Average, name="ppdp.loss",
                                 process_set=m.dp)
            close(mean[0], ld.detach(), f"pp x dp loss averaged over replicas (step {step})")


def tp_dp():
    """tp=2 x dp=2: a tensor-parallel MLP, gradients averaged over mesh.dp by
    DistributedOptimizer, equals the dense model on the whole batch."""
    m = P.mesh(tp=2, dp=2)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(91)
    dense = _MLP(None)
    torch.manual_seed(91)
    mlp = _MLP(m.tp)
    opt = hvd.DistributedOptimizer(sgd(mlp.parameters()), named_parameters=mlp.named_parameters(),
                                   process_set=m.dp)
    opt_d = sgd(dense.parameters())
    half = slice(4 * m.dp_rank, 4 * (m.dp_rank + 1))
    for step in range(2):
        opt.zero_grad()
        opt_d.zero_grad()
        F.mse_loss(mlp(x[half]), y[half]).backward()
        F.mse_loss(dense(x), y).backward()
        opt.step()
        opt_d.step()
        full = P.gather_state_dict(mlp)
        for n, q in dense.named_parameters():
            close(full[n], q.detach(), f"tp x dp weight {n} after step {step}")


def gpt_3d(schedule, m, checkpoint="never"):
    """tp=2 x pp=2: the GPT's tensor-parallel layers inside a 2-stage pipeline."""
    mesh = P.mesh(tp=2, pp=2)
    x, y = gpt_batch(max(2 * m, 4))
    torch.manual_seed(101)
    dense = P.SkipSequential(gpt_layers(None, blocks=2))
    torch.manual_seed(101)
    pipe = P.Pipeline(gpt_layers(mesh.tp, blocks=2), chunks=m, schedule=schedule,
                      checkpoint=checkpoint, process_set=mesh.pp)
    _pp_compare(pipe, dense, x, y, tp_lm_loss(mesh.tp), f"gpt tp2 x pp2 {schedule} m={m} "
                f"checkpoint={checkpoint}", dense_loss=dense_lm_loss, steps=2, gathered=True,
                out_slice=lambda o: o.chunk(2, -1)[mesh.tp_rank])


def clip_3d():
    """clip_grad_norm_ over tp=2 x pp=2 equals torch's on the dense model."""
    mesh = P.mesh(tp=2, pp=2)
    x, y = gpt_batch(4)
    for norm_type, max_norm in [(2.0, 0.05), (float("inf"), 0.01), (2.0, 1e6)]:
        torch.manual_seed(111)
        dense = P.SkipSequential(gpt_layers(None))
        torch.manual_seed(111)
        pipe = P.Pipeline(gpt_layers(mesh.tp), chunks=2, process_set=mesh.pp)
        pipe.train_step(x, y, tp_lm_loss(mesh.tp))
        dense_lm_loss(dense(x), y).backward()
        norm = P.clip_grad_norm_(pipe.parameters(), max_norm, mesh, norm_type=norm_type)
        ref = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm, norm_type=norm_type)
        close(norm, ref, f"total gradient norm (norm_type={norm_type})")
        grads = P.gather_state_dict(pipe, grads=True)
        dparams = dict(dense.named_parameters())
        for n, g in grads.items():
            close(g, dparams[n].grad, f"clipped gradient of {n} (norm_type={norm_type}, "
                                      f"max_norm={max_norm})")


# ============================================================================ p2p
def p2p_messages():
    if size < 2:
        return
    peer = 1 - rank if rank < 2 else None
    P.p2p.connect([(0, 1)])
    if peer is None:
        return
    msgs = [
        torch.arange(6, dtype=torch.float32).view(2, 3),
        (torch.tensor(3.5, dtype=torch.float64), None, torch.ones(0, 4),
         torch.tensor([True, False]), torch.arange(4, dtype=torch.int16).view(2, 2)),
        [torch.randn(3, dtype=torch.bfloat16), (torch.ones(2, dtype=torch.uint8), None)],
        None,
        torch.randn(5, 7, dtype=torch.complex64),
    ]
    g = torch.Generator().manual_seed(3)
    msgs = [m.clone() if isinstance(m, torch.Tensor) else m for m in msgs]
    msgs[2][0].copy_(torch.randn(3, generator=g).to(torch.bfloat16))
    msgs[4] = torch.randn(5, 7, generator=g, dtype=torch.complex64)
    grad_src = torch.randn(2, 2, generator=g).requires_grad_(True)
    msgs.append((grad_src * 2, torch.ones(3)))

    def same_structure(a, b, path="msg"):
        if isinstance(a, torch.Tensor):
            if not isinstance(b, torch.Tensor):
                return fail(f"{path}: got {type(b).__name__}")
            equal(b.detach(), a.detach(), path)
            if b.requires_grad != a.requires_grad:
                fail(f"{path}: requires_grad {b.requires_grad} != {a.requires_grad}")
        elif a is None:
            if b is not None:
                fail(f"{path}: expected None")
        else:
            if type(a) is not type(b) or len(a) != len(b):
                return fail(f"{path}: {type(b).__name__} of {len(b) if b else 0}, expected "
                            f"{type(a).__name__} of {len(a)}")
            for j, (u, v) in enumerate(zip(a, b)):
                same_structure(u, v, f"{path}[{j}]")

    os.environ["HVDLITE_P2P_INLINE_BYTES"] = "64"     # large messages take the two-step path
    try:
        for round_ in range(2):
            for i, msg in enumerate(msgs):
                name = f"p2p.test.{i}"
                if rank == 0:
                    P.p2p.send(msg, 1, name).wait()
                else:
                    same_structure(msg, P.p2p.recv(0, name), f"round {round_} message {i}")
            os.environ["HVDLITE_P2P_INLINE_BYTES"] = str(1 << 20)
    finally:
        os.environ.pop("HVDLITE_P2P_INLINE_BYTES", None)
    # both directions at once, posted before sent
    if rank == 0:
        h = P.p2p.irecv(1, "p2p.back")
        P.p2p.send(torch.ones(3), 1, "p2p.there").wait()
        equal(h.wait(), torch.full((3,), 2.0), "reply")
    else:
        x = P.p2p.recv(0, "p2p.there")
        P.p2p.send(x * 2, 0, "p2p.back").wait()
    expect_raises(ValueError, lambda: P.p2p.connect([(0, 0)]), "pair with itself",
                  match="two different ranks")
    expect_raises(TypeError, lambda: P.p2p.send({"a": 1}, peer, "p2p.bad"), "dict message",
                  match="tensor")


def pipeline_timeout():
    """A stage whose peer never sends raises PipelineTimeoutError naming the message."""
    pp = P.current_mesh().pp
    pipe = P.Pipeline(pp_layers(), chunks=2, process_set=pp, timeout=1.5, warn_after=0)
    if pipe.stage == 1:
        err = expect_raises(P.PipelineTimeoutError, lambda: pipe.train_step(
            None, torch.zeros(4, 4), F.mse_loss), "timeout",
            match=[f"pipe{pipe._uid}.fwd.0>1.mb0", "activations of micro-batch 0 from stage 0",
                   "timeout"])
        if err is not None:
            log("TIMEOUT-ERROR " + str(err))
        expect_raises(P.PipelineError, lambda: pipe.train_step(None, torch.zeros(4, 4),
                                                               F.mse_loss),
                      "a timed-out pipeline refuses to run again", match="cannot run again")
    hvd.barrier()


def mesh_without_dynamic_sets():
    """Without dynamic process sets, a mesh that needs new sets fails on every rank with a
    message that says how to fix it; after re-init with dynamic sets it works."""
    hvd.shutdown()
    hvd.init()
    try:
        expect_raises(ValueError, lambda: P.mesh(tp=size), "mesh without dynamic sets",
                      match=["process_sets='dynamic'", "mesh_groups"])
        if P.current_mesh() is not None:
            fail("a mesh from before shutdown is still current")
    finally:
        hvd.shutdown()
        hvd.init(process_sets="dynamic")
    m = P.mesh(tp=size)
    if m.tp.size() != size:
        fail(f"mesh after re-init has tp size {m.tp.size()}")


# ============================================================================ main
def main(sections):
    if "tp" in sections:
        m = P.mesh(tp=size)
        tp = m.tp
        check("mesh_layout", mesh_layout)
        m = P.mesh(tp=size)
        tp = m.tp
        check(f"tp{size}_init_slices", tp_init_slices, tp)
        check(f"tp{size}_mappings", tp_mappings, tp)
        check(f"tp{size}_mlp", tp_mlp, tp)
        check(f"tp{size}_embedding", tp_embedding, tp)
        check(f"tp{size}_cross_entropy", tp_cross_entropy, tp)
        check(f"tp{size}_gpt", tp_gpt, tp)
        check(f"tp{size}_rng", tp_rng, tp, None)
        check(f"tp{size}_checkpoint", tp_checkpoint, tp)
        check(f"tp{size}_errors", tp_errors, tp)
    if "pp" in sections:
        P.mesh(pp=size)
        p = size
        for schedule in ("gpipe", "1f1b"):
            for m in (p, 2 * p, 2 * p + 1 if p == 2 else 5):
                check(f"pp{p}_{schedule}_m{m}", pp_equivalence, schedule, m)
        check(f"pp{p}_gpipe_checkpoint_except_last", pp_equivalence, "gpipe", p + 1,
              "except_last")
        check(f"pp{p}_1f1b_checkpoint_always", pp_equivalence, "1f1b", 2 * p, "always")
        check(f"pp{p}_m1", pp_equivalence, "1f1b", 1)
        check(f"pp{p}_forward_only", pp_forward_only)
        check(f"pp{p}_variable_shapes", pp_variable_shapes)
        check(f"pp{p}_balance", pp_balance)
        check(f"pp{p}_factories", pp_factories)
        check(f"pp{p}_custom_schedule", pp_custom_schedule)
        check(f"pp{p}_errors", pp_errors)
        check("p2p_messages", p2p_messages)
    if "3d" in sections and size == 4:
        for schedule in ("gpipe", "1f1b"):
            for m in (2, 4, 3):
                check(f"tp2_pp2_{schedule}_m{m}", gpt_3d, schedule, m)
        check("tp2_pp2_1f1b_m3_checkpoint", gpt_3d, "1f1b", 3, "always")
        check("tp2_pp2_clip_grad_norm", clip_3d)
        check("pp2_dp2_distributed_optimizer", pp_dp)
        check("tp2_dp2_distributed_optimizer", tp_dp)
        m = P.mesh(tp=2, dp=2)
        check("tp2_rng_across_dp", tp_rng, m.tp, m.dp)
    if "stall" in sections:
        check("mesh_without_dynamic_sets", mesh_without_dynamic_sets)
        P.mesh(pp=size)
        check(f"pp{size}_stall_warning", pp_stall_warning)
        check(f"pp{size}_timeout", pipeline_timeout)
    finish()
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:] or ["tp", "pp", "3d", "stall"])
