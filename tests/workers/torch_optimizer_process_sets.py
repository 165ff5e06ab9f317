"""DistributedOptimizer(process_set=...) on 4 ranks: two independent data-parallel pairs, and a
set that leaves rank 0 out (rank 0 then trains alone). Each rank compares its weights with a
single-process reference over its own set's global batch."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd

PAIRS = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])]
NOT_ZERO = hvd.ProcessSet([1, 2, 3])
hvd.init(process_sets=PAIRS + [NOT_ZERO])
RANK, SIZE = hvd.rank(), hvd.size()
assert SIZE == 4, "run with -np 4"
torch.set_num_threads(1)
N_LOCAL = 3


def make_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def run(ps, members, salt, steps=4, **kwargs):
    """Train on this rank's slice of its set's global batch; return (model, reference)."""
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   process_set=ps, **kwargs)
    ref_opt = sgd(ref)
    pos = members.index(RANK)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * salt + step)
        x = torch.randn(len(members) * N_LOCAL, 5, generator=g)
        y = torch.randn(len(members) * N_LOCAL, 2, generator=g)
        sl = slice(pos * N_LOCAL, (pos + 1) * N_LOCAL)
        opt.zero_grad()
        F.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m: f"{name}: {m}")
    return model


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gather_all(model, name):
    return hvd.allgather(flat(model).unsqueeze(0), name=name)


# Two independent pairs, each with its own data; plain and with groups (the group order is taken
# from the set's first rank, which for the pair {2, 3} is not rank 0).
for i, kwargs in enumerate([{}, {"groups": 2}]):
    pair = RANK // 2
    members = PAIRS[pair].ranks
    model = run(PAIRS[pair], members, salt=10 * i + pair, **kwargs)
    rows = gather_all(model, f"pairs.{i}")
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[2], rows[3]), "pair out of sync"
    assert not torch.allclose(rows[0], rows[2]), "the pairs should have trained differently"
    print(f"OK pairs {kwargs}", flush=True)

# A set without rank 0: rank 0 registers no hooks and trains on its own batch only.
if RANK == 0:
    model = run(NOT_ZERO, [0], salt=7)
    assert model[0].weight.grad is not None
else:
    model = run(NOT_ZERO, NOT_ZERO.ranks, salt=8)
rows = gather_all(model, "not_zero")
assert torch.equal(rows[1], rows[2]) and torch.equal(rows[2], rows[3])
assert not torch.allclose(rows[0], rows[1])
print("OK excluded rank", flush=True)

# broadcast_object / allgather_object restricted to a process set (roots are global ranks).
pair = PAIRS[RANK // 2]
got = hvd.broadcast_object({"from": RANK} if RANK == pair.ranks[1] else None,
                           root_rank=pair.ranks[1], process_set=pair)
assert got == {"from": pair.ranks[1]}, got
got = hvd.allgather_object(("rank", RANK, "x" * RANK), process_set=pair)
assert got == [("rank", r, "x" * r) for r in pair.ranks], got
if RANK != 0:
    got = hvd.allgather_object(RANK * 10, name="nz", process_set=NOT_ZERO)
    assert got == [10, 20, 30], got
print("OK objects on process sets", flush=True)
hvd.barrier()  # rank 0 (the coordinator) must not shut down while others still work
print("ALL DONE", flush=True)
hvd.shutdown()
