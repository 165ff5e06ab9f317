"""broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object and
SyncBatchNorm (2 ranks), each against what a single process computes.

SyncBatchNorm is compared with torch's BatchNorm on the global batch (every rank's local batch
concatenated, also with unequal per-rank batch sizes): forward output, input gradient, the sum
over ranks of the weight/bias gradients (they stay local, as in Horovod, for DistributedOptimizer
to reduce), running statistics, and eval-mode output. Prints one `CHECK <name> OK|FAIL` line per check (tests/workers/harness.py).
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd
import harness

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
torch.set_num_threads(1)
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def same_everywhere(t: torch.Tensor, name: str) -> None:
    rows = hvd.allgather(t.detach().reshape(1, -1), name=name)
    for r in range(SIZE):
        assert torch.equal(rows[r], rows[0]), f"{name}: rank {r} differs from rank 0"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


def rank_net(seed_offset=0):
    torch.manual_seed(100 + RANK + seed_offset)
    net = Net()
    with torch.no_grad():
        net.bn.running_mean.uniform_()
        net.bn.num_batches_tracked.fill_(RANK + 3)
    return net


# ---------------------------------------------------------------------- broadcast_parameters
@check
def broadcast_parameters_forms():
    for root in (0, 1):
        expected = {k: v.clone() for k, v in _root_state(root).items()}
        # dict (state_dict, with an int64 buffer), sorted by key
        net = rank_net()
        hvd.broadcast_parameters(net.state_dict(), root_rank=root)
        for k, v in net.state_dict().items():
            assert torch.equal(v, expected[k]), k
        # list of (name, tensor)
        net = rank_net()
        hvd.broadcast_parameters(list(net.named_parameters()), root_rank=root)
        for k, v in net.named_parameters():
            assert torch.equal(v.detach(), expected[k]), k
        # list of tensors, a generator, and a prefix
        net = rank_net()
        hvd.broadcast_parameters(list(net.parameters()), root_rank=root)
        for (k, v) in net.named_parameters():
            assert torch.equal(v.detach(), expected[k]), k
        net = rank_net()
        hvd.broadcast_parameters(net.named_parameters(), root_rank=root, prefix="model.")
        for (k, v) in net.named_parameters():
            assert torch.equal(v.detach(), expected[k]), k
    try:
        hvd.broadcast_parameters(torch.zeros(3), root_rank=0)
    except ValueError as exc:
        assert str(exc).startswith("invalid params of type"), str(exc)
    else:
        raise AssertionError("broadcast_parameters(tensor) did not raise")


def _root_state(root):
    """Rank `root`'s initial state, known to every rank without communication."""
    torch.manual_seed(100 + root)
    net = Net()
    with torch.no_grad():
        net.bn.running_mean.uniform_()
        net.bn.num_batches_tracked.fill_(root + 3)
    return net.state_dict()


# ---------------------------------------------------------------------- optimizer state
def _local_steps(net, opt, n):
    g = torch.Generator().manual_seed(7 + RANK)
    for _ in range(n):
        opt.zero_grad()
        net(torch.randn(5, 3, generator=g)).pow(2).mean().backward()
        opt.step()


def _state_tensors(opt):
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in sorted(opt.state[p].items()):
                out.append(v.detach().reshape(-1).double() if torch.is_tensor(v)
                           else torch.tensor([float(v)], dtype=torch.float64))
    return torch.cat(out)


@check
def broadcast_optimizer_state_existing_state():
    for cls, kw in ((torch.optim.SGD, dict(lr=0.1 + RANK, momentum=0.9)),
                    (torch.optim.Adam, dict(lr=0.01 * (RANK + 1), betas=(0.8, 0.9 + RANK / 50))),
                    (torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, momentum=0.5))):
        net = rank_net()
        opt = cls(net.parameters(), **kw)
        _local_steps(net, opt, 2 + RANK)          # the ranks' states now differ
        root_state = hvd.broadcast_object(opt.state_dict(), root_rank=1)
        hvd.broadcast_optimizer_state(opt, root_rank=1)
        same_everywhere(_state_tensors(opt), f"optstate.{cls.__name__}")
        mine = opt.state_dict()
        for pid, st in root_state["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(mine["state"][pid][k]), torch.as_tensor(v)), \
                    (cls.__name__, k)
        for g_root, g_mine in zip(root_state["param_groups"], mine["param_groups"]):
            for k, v in g_root.items():
                assert g_mine[k] == v, (cls.__name__, k, g_mine[k], v)
                assert type(g_mine[k]) is type(v), (k, type(g_mine[k]), type(v))


@check
def broadcast_optimizer_state_fresh():
    # Empty state: initialised by a zero-gradient step, then broadcast.
    net = rank_net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01 * (RANK + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == len(list(net.parameters()))
    assert opt.param_groups[0]["lr"] == 0.01
    same_everywhere(_state_tensors(opt), "fresh_adam")

    # Same through a DistributedOptimizer: only the wrapped optimizer's step runs (no allreduce).
    net = rank_net()
    dopt = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                    named_parameters=net.named_parameters())
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    assert dopt._handles == {} and len(dopt.state) == len(list(net.parameters()))

    # Stateless optimizer: nothing to broadcast, no error.
    net = rank_net()
    hvd.broadcast_optimizer_state(torch.optim.SGD(net.parameters(), lr=0.1), root_rank=0)

    # The zero-gradient step moves weights under weight decay; model= puts them back.
    for model_arg in (False, True):
        net = rank_net()
        before = [p.detach().clone() for p in net.parameters()]
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.5)
        hvd.broadcast_optimizer_state(opt, root_rank=0, model=net if model_arg else None)
        unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, net.parameters()))
        assert unchanged == model_arg, (model_arg, unchanged)

    try:
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(rank_net().parameters()), root_rank=0)
    except ValueError as exc:
        assert str(exc) == "cannot broadcast torch.optim.LBFGS state"
    else:
        raise AssertionError("LBFGS did not raise")


class CountingSGD(torch.optim.SGD):
    """Keeps a Python int and a Python float in its per-parameter state."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["count"] = st.get("count", 0) + 1 + RANK
                st["scale"] = 0.5 * (RANK + 1)
        return super().step(closure)


@check
def broadcast_optimizer_state_scalars():
    net = rank_net()
    opt = CountingSGD(net.parameters(), lr=0.1, momentum=0.9)
    _local_steps(net, opt, 2)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for p in net.parameters():
        assert opt.state[p]["count"] == 2 and type(opt.state[p]["count"]) is int
        assert opt.state[p]["scale"] == 0.5 and type(opt.state[p]["scale"]) is float
    same_everywhere(_state_tensors(opt), "scalars")


# ---------------------------------------------------------------------- objects
@check
def broadcast_object_and_allgather_object():
    for root in (0, 1):
        obj = {"hello": 123, 0: [1, 2], "t": torch.arange(4) * root, "f": lambda v: v + root} \
            if RANK == root else None
        got = hvd.broadcast_object(obj, root_rank=root)
        assert got["hello"] == 123 and got[0] == [1, 2]
        assert torch.equal(got["t"], torch.arange(4) * root) and got["f"](1) == 1 + root
    # Named, and different sizes of the same name in a row.
    for n in (3, 3000, 10):
        got = hvd.broadcast_object(list(range(n)) if RANK == 0 else None, root_rank=0,
                                   name="sized")
        assert got == list(range(n))

    d = {"metric_val_1": RANK}
    if RANK == 1:
        d["metric_val_2"] = 42
    got = hvd.allgather_object(d)
    expected = [{"metric_val_1": i} for i in range(SIZE)]
    expected[1] = {"metric_val_1": 1, "metric_val_2": 42}
    assert got == expected, got
    got = hvd.allgather_object("x" * (1 + 500 * RANK), name="strings")
    assert got == ["x" * (1 + 500 * r) for r in range(SIZE)]
    # Objects of different types on different ranks (the default name does not depend on it).
    got = hvd.allgather_object(None if RANK == 0 else {"r": RANK})
    assert got == [None] + [{"r": r} for r in range(1, SIZE)], got


# ---------------------------------------------------------------------- SyncBatchNorm
def _sync_vs_reference(shape_tail, counts, kind, iters=3, dtype=torch.float32, **bn_kwargs):
    """Run SyncBatchNorm on this rank's slice and torch BatchNorm on the whole batch."""
    C = 3
    sbn = hvd.SyncBatchNorm(C, **bn_kwargs).to(dtype)
    ref = kind(C, **bn_kwargs).to(dtype)
    if sbn.affine:
        with torch.no_grad():
            torch.manual_seed(5)
            sbn.weight.uniform_(0.5, 1.5)
            sbn.bias.uniform_(-0.5, 0.5)
            ref.weight.copy_(sbn.weight)
            ref.bias.copy_(sbn.bias)
    total = sum(counts)
    start = sum(counts[:RANK])
    sl = slice(start, start + counts[RANK])
    for it in range(iters):
        g = torch.Generator().manual_seed(900 + it)
        x = (torch.randn(total, C, *shape_tail, generator=g) * 2 + 3).to(dtype)
        up = torch.randn(total, C, *shape_tail, generator=g).to(dtype)   # upstream gradient
        x_local = x[sl].clone().requires_grad_(True)
        x_ref = x.clone().requires_grad_(True)
        sbn.zero_grad()
        ref.zero_grad()
        out = sbn(x_local)
        (out * up[sl]).sum().backward()
        out_ref = ref(x_ref)
        (out_ref * up).sum().backward()

        torch.testing.assert_close(out, out_ref[sl])
        torch.testing.assert_close(x_local.grad, x_ref.grad[sl])
        if sbn.affine:
            gw = hvd.allreduce(sbn.weight.grad, op=hvd.Sum, name="sbn.gw")
            gb = hvd.allreduce(sbn.bias.grad, op=hvd.Sum, name="sbn.gb")
            torch.testing.assert_close(gw, ref.weight.grad)
            torch.testing.assert_close(gb, ref.bias.grad)
        if sbn.track_running_stats:
            torch.testing.assert_close(sbn.running_mean, ref.running_mean)
            torch.testing.assert_close(sbn.running_var, ref.running_var)
            assert int(sbn.num_batches_tracked) == int(ref.num_batches_tracked) == it + 1
    return sbn, ref


@check
def sync_batch_norm_equal_batches():
    _sync_vs_reference((), [4, 4], nn.BatchNorm1d)
    _sync_vs_reference((5,), [3, 3], nn.BatchNorm1d)
    _sync_vs_reference((4, 5), [2, 2], nn.BatchNorm2d)
    _sync_vs_reference((4, 5), [2, 2], nn.BatchNorm2d, dtype=torch.float64)


@check
def sync_batch_norm_unequal_batches():
    _sync_vs_reference((), [3, 9], nn.BatchNorm1d)
    _sync_vs_reference((6,), [1, 4], nn.BatchNorm1d)
    _sync_vs_reference((3, 3), [5, 1], nn.BatchNorm2d)
    # One rank with an empty batch.
    _sync_vs_reference((3, 3), [0, 3], nn.BatchNorm2d)


@check
def sync_batch_norm_options():
    _sync_vs_reference((4,), [2, 5], nn.BatchNorm1d, momentum=None)
    _sync_vs_reference((4,), [2, 5], nn.BatchNorm1d, affine=False)
    _sync_vs_reference((4,), [2, 5], nn.BatchNorm1d, momentum=0.3, eps=1e-3)
    # No running statistics: batch statistics, synchronised, in eval mode too (as Horovod).
    sbn, ref = _sync_vs_reference((4,), [2, 5], nn.BatchNorm1d, track_running_stats=False)
    sbn.eval()
    ref.eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, 4, generator=g)
    sl = slice(0, 2) if RANK == 0 else slice(2, 7)
    torch.testing.assert_close(sbn(x[sl]), ref(x)[sl])


@check
def sync_batch_norm_eval_is_local():
    sbn, ref = _sync_vs_reference((5,), [2, 6], nn.BatchNorm1d)
    sbn.eval()
    ref.eval()
    if RANK == 0:
        # Eval mode uses the running statistics and makes no collective: one rank alone works.
        x = torch.randn(4, 3, 5)
        torch.testing.assert_close(sbn(x), ref(x))
    try:
        hvd.SyncBatchNorm(3)(torch.randn(3))
    except ValueError as exc:
        assert str(exc) == "expected at least 2D input (got 1D input)"
    else:
        raise AssertionError("1D input did not raise")


class BNNet(nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = bn(4)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


@check
def sync_batch_norm_training_with_distributed_optimizer():
    torch.manual_seed(21)
    model = BNNet(hvd.SyncBatchNorm)
    torch.manual_seed(21)
    ref = BNNet(nn.BatchNorm2d)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    n = 3
    for step in range(4):
        g = torch.Generator().manual_seed(40 + step)
        x = torch.randn(SIZE * n, 2, 5, 5, generator=g)
        y = torch.randint(0, 3, (SIZE * n,), generator=g)
        sl = slice(RANK * n, (RANK + 1) * n)
        opt.zero_grad()
        F.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)
    assert type(model.bn).__name__ == "SyncBatchNorm"
    assert isinstance(model.bn, torch.nn.modules.batchnorm._BatchNorm)


for fn in CHECKS:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        harness.check(fn.__name__, fn)
    if harness.FAILURES:   # later checks assume this one's state: stop every rank at once
        break
harness.finish()
if harness.FAILURES:
    sys.exit(1)
hvd.shutdown()
