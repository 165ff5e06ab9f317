"""Train a small PyTorch model on a Ray cluster with hvdlite: Horovod's RayExecutor API, elastic
with --min-workers, or through Ray Train with --ray-train.

    ray start --head                                   # or use an existing cluster
    python examples/ray/pytorch_ray_train.py --num-workers 2
    python examples/ray/pytorch_ray_train.py --min-workers 1 --max-workers 4    # elastic
    python examples/ray/pytorch_ray_train.py --num-workers 2 --ray-train         # Ray Train

Without a running cluster, `ray.init()` starts a local one. The training function is an ordinary
hvdlite.torch script: `hvd.init()` finds its rank, which Ray's placement decided.
"""
import argparse
import os

import ray
import torch

parser = argparse.ArgumentParser(description="hvdlite on Ray: PyTorch")
parser.add_argument("--address", default=None, help="Ray cluster address (default: auto/local)")
parser.add_argument("--num-workers", type=int, default=2)
parser.add_argument("--min-workers", type=int, default=None, help="elastic: at least this many")
parser.add_argument("--max-workers", type=int, default=None, help="elastic: at most this many")
parser.add_argument("--cpus-per-worker", type=float, default=1)
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--ray-train", action="store_true", help="run through Ray Train instead")
args = parser.parse_args()


def make_data(n=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, x @ w + 0.1 * torch.randn(n, 1, generator=g)


def train(epochs: int, report=None):
    import hvdlite.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    x, y = make_data()
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]   # this rank's shard
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    state = hvd.elastic.TorchState(model, opt, epoch=0)

    @hvd.elastic.run       # a no-op wrapper in a fixed-size job; rolls back in an elastic one
    def loop(state):
        while state.epoch < epochs:
            for i in range(0, len(x), 64):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x[i:i + 64]), y[i:i + 64])
                loss.backward()
                opt.step()
            loss = hvd.allreduce(loss.detach(), name="loss").item()
            if report is not None:
                report({"epoch": state.epoch, "loss": loss})
            elif hvd.rank() == 0:
                print(f"epoch {state.epoch:3d}  loss {loss:.4f}  workers {hvd.size()}",
                      flush=True)
            state.epoch += 1
            state.commit()
        return loss

    return loop(state)


def ray_train_loop(config):
    import ray.train

    train(config["epochs"], report=ray.train.report)


def main():
    ray.init(address=args.address)
    if args.ray_train:
        from ray.train import ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        from hvdlite.ray import HvdliteConfig

        trainer = DataParallelTrainer(
            ray_train_loop, train_loop_config={"epochs": args.epochs},
            backend_config=HvdliteConfig(),
            scaling_config=ScalingConfig(num_workers=args.num_workers,
                                         resources_per_worker={"CPU": args.cpus_per_worker}))
        result = trainer.fit()
        print("Ray Train result:", result.metrics, "error:", result.error)
        return
    from hvdlite.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    if args.min_workers or args.max_workers:
        executor = RayExecutor(settings, min_workers=args.min_workers or 1,
                               max_workers=args.max_workers,
                               cpus_per_worker=args.cpus_per_worker)
    else:
        executor = RayExecutor(settings, num_workers=args.num_workers,
                               cpus_per_worker=args.cpus_per_worker)
    executor.start()
    try:
        losses = executor.run(train, args=[args.epochs])
        print(f"final loss per rank: {[round(v, 4) for v in losses]}")
    finally:
        executor.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    main()
