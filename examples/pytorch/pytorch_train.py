"""Train a small classifier with hvdlite: a Horovod PyTorch script with one changed import.

    hvdlite-run -np 2 python examples/pytorch/pytorch_train.py

Each rank trains on its shard of a synthetic data set (spirals, made with a fixed seed so every
rank builds the same one); gradients are averaged by hvd.DistributedOptimizer.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="hvdlite PyTorch training example")
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
parser.add_argument("--samples", type=int, default=4096)
parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()


def make_spirals(n: int, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per = n // classes
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, per)
        theta = c * 2 * math.pi / classes + r * 4 + 0.2 * torch.randn(per, generator=g)
        xs.append(torch.stack([r * torch.sin(theta), r * torch.cos(theta)], dim=1))
        ys.append(torch.full((per,), c, dtype=torch.long))
    x, y = torch.cat(xs), torch.cat(ys)
    perm = torch.randperm(len(x), generator=g)
    return x[perm], y[perm]


class Net(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(2, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, classes)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def main():
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    x, y = make_spirals(args.samples, seed=args.seed)
    # Shard the data set by rank, as torch's DistributedSampler would, dropping the remainder so
    # every rank runs the same number of steps (otherwise see hvd.join()).
    n = len(x) - len(x) % hvd.size()
    x_local, y_local = x[hvd.rank():n:hvd.size()], y[hvd.rank():n:hvd.size()]

    model = Net()
    # Scale the learning rate by the number of ranks (Horovod's recipe).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    steps = len(x_local) // args.batch_size
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(args.seed + epoch)
        order = torch.randperm(len(x_local), generator=g)
        total = 0.0
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_local[idx]), y_local[idx])
            loss.backward()
            optimizer.step()
            total += loss.item()
        avg = hvd.allreduce(torch.tensor(total / steps), name="epoch_loss").item()
        if hvd.rank() == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
            print(f"epoch {epoch + 1:3d}  loss {avg:.4f}", flush=True)

    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean()
    accuracy = hvd.allreduce(correct, name="accuracy").item()
    if hvd.rank() == 0:
        print(f"final loss {avg:.4f}  accuracy {accuracy:.3f}  ranks {hvd.size()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
