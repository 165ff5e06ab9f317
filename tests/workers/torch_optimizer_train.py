"""A Horovod-style PyTorch training script, then the same training in one process.

    hvdlite-run -np N python torch_optimizer_train.py

The distributed part is what a Horovod user writes (init, seed, broadcast_parameters,
broadcast_optimizer_state, DistributedOptimizer, loop). Each rank starts from different random
weights and rank 0's learning rate differs from the others', so the broadcasts matter. Each step
the global batch is split into contiguous per-rank slices; the reference trains one model in this
process on the whole global batch and must end with the same weights.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd

BATCH = 8        # per rank
STEPS = 12
SEED = 42


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def dataset(n):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).long() + (x[:, 3] > 1).long()
    return x, y


def global_batch(x, y, step, size):
    g = torch.Generator().manual_seed(SEED + step)
    idx = torch.randperm(len(x), generator=g)[:BATCH * size]
    return x[idx], y[idx]


# ---------------------------------------------------------------- the Horovod-style script
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(SEED + hvd.rank())          # different initial weights on every rank
model = Net()
lr = 0.05 if hvd.rank() == 0 else 0.3         # only rank 0's value may survive
optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)

hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

x_all, y_all = dataset(512)
r, n = hvd.rank(), hvd.size()
for step in range(STEPS):
    x, y = global_batch(x_all, y_all, step, n)
    x_local, y_local = x[r * BATCH:(r + 1) * BATCH], y[r * BATCH:(r + 1) * BATCH]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x_local), y_local)
    loss.backward()
    optimizer.step()

# ---------------------------------------------------------------- single-process reference
torch.manual_seed(SEED)                        # rank 0's initial weights
ref = Net()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05 * n, momentum=0.9)
for step in range(STEPS):
    x, y = global_batch(x_all, y_all, step, n)
    ref_opt.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()

assert optimizer.param_groups[0]["lr"] == 0.05 * n, optimizer.param_groups[0]["lr"]
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m: f"{name}: {m}")
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
rows = hvd.allgather(flat.unsqueeze(0), name="final_weights")
assert all(torch.equal(rows[i], flat) for i in range(n)), "weights differ between ranks"
print(f"TRAIN OK ranks={n} checksum={float(flat.sum()):.6f}", flush=True)
hvd.shutdown()
