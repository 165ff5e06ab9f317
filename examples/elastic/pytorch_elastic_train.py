"""Elastic PyTorch training with hvdlite: the job survives workers that die and hosts that come
and go, and picks up new hosts as they appear.

    # one machine, hosts from a file you can edit while the job runs:
    echo localhost:2 > hosts.txt
    hvdlite-run --min-np 1 --max-np 4 --host-discovery-script "cat hosts.txt" \
        python examples/elastic/pytorch_elastic_train.py

    # several machines (ssh), hosts from your cluster's discovery:
    hvdlite-run -np 4 --min-np 2 --max-np 8 --host-discovery-script ./discover_hosts.sh \
        --blacklist-cooldown-range 30 300 -p 22 -i ~/.ssh/id_ed25519 \
        python examples/elastic/pytorch_elastic_train.py --epochs 50

What makes it elastic (Horovod's recipe, unchanged):
- the training state (model, optimizer, sampler, epoch) lives in `hvd.elastic.TorchState`;
- the training loop is a function decorated with `@hvd.elastic.run`;
- `state.commit()` every few batches: a failure rolls every rank back to the last commit, and a
  host change takes effect there;
- `ElasticSampler` spreads what is left of the epoch over the ranks after each change;
- the learning rate follows the number of ranks through a reset callback;
- no collective between `hvd.init()` and the decorated function (new workers start there).
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="hvdlite elastic PyTorch example")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
parser.add_argument("--samples", type=int, default=4096)
parser.add_argument("--commit-every", type=int, default=10, help="batches between commits")
parser.add_argument("--batch-delay", type=float, default=0.0,
                    help="seconds to sleep per batch (to watch the job react to changes)")
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
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    # No broadcast here: the state is synced inside `train`, where new workers meet the others.
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def on_reset():
        # Horovod's recipe: the learning rate scales with the number of ranks.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} ranks, resuming epoch {state.epoch} at sample "
                  f"{sampler.processed_num}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        # Horovod's elastic idiom: the loop variables live on the state, so a reset resumes there.
        for state.epoch in range(state.epoch, args.epochs):  # noqa: B020 (see above)
            model.train()
            total, count = 0.0, 0
            for state.batch, (xb, yb) in enumerate(loader, start=state.batch):  # noqa: B020 (as above)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                total += loss.item()
                count += 1
                sampler.record_batch(state.batch, args.batch_size)
                if state.batch % args.commit_every == 0:
                    state.commit()
                if args.batch_delay:
                    time.sleep(args.batch_delay)
            mean = hvd.allreduce(torch.tensor(total / max(count, 1)), name="epoch_loss").item()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch:3d}  loss {mean:.4f}  ranks {hvd.size()}", flush=True)
            state.batch = 0
            sampler.set_epoch(state.epoch + 1)
            state.commit()

    train(state)

    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    if hvd.rank() == 0:
        print(f"final accuracy {accuracy:.3f}  ranks {hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
