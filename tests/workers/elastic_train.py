"""Elastic training worker whose result can be checked exactly.

Every rank trains on the same batch at each step, so the averaged gradient equals the
single-process one whatever the membership, and the integer-valued data keep every sum exact:
the final weights must equal `reference(TOTAL)` bit for bit, and `trace` (the steps the job
committed) must be exactly 0..TOTAL-1. A lost step or one done twice changes both.

Beside the model, an `ElasticSampler` over DATASET sample ids hands each rank BATCH ids per step;
the ids all ranks took are recorded per epoch (`epochs`), so a test can check that every epoch
covered every sample although the job was resized and rolled back in the middle of epochs.

Environment (all optional):
  ELASTIC_TOTAL_STEPS   steps to train (40)
  ELASTIC_COMMIT_EVERY  commit every N steps (2)
  ELASTIC_STEP_DELAY    seconds of sleep per step (0.05)
  ELASTIC_HOLD_AT       at this step (a commit point), wait until the job has ...
  ELASTIC_HOLD_SIZE     ... this many ranks (bounded: ~90 s)
  ELASTIC_HOLD_FILE     ... and this file exists
  ELASTIC_MARK_DIR      write pid.<worker> and step.<worker> ("<step> <size> <rank>") here
  ELASTIC_SIGSTOP_AT    after this step the highest rank stops itself (SIGSTOP), once per job
  ELASTIC_EXIT_IN_INIT  this worker ("host:slot") dies inside its first hvd.init(), once
  ELASTIC_ZERO_STAGE    DistributedOptimizer(zero_stage=...) (0); with 1 or 2 the RESULT also
                        holds the consolidated momentum buffers ("momentum")
  ELASTIC_STEP_LOG      rank 0 appends "run <step> <time>" before each step and "commit <steps>
                        <time>" after each commit to this file, so a test can count the committed steps a
                        failure made the job run again (`steps_lost`)
  ELASTIC_CHECKPOINT_DIR, ELASTIC_CHECKPOINT_EVERY
                        TorchState(checkpoint_dir=..., checkpoint_every=...): durable state
  ELASTIC_ONE_CORE      1: each worker runs on one core, so (one rank per host, over TCP) the
                        optimizer keeps its gradients in one flat buffer (torch/flat_grads.py);
                        the RESULT's "flat" says whether it did at the end
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

TOTAL = int(os.environ.get("ELASTIC_TOTAL_STEPS", "40"))
COMMIT_EVERY = int(os.environ.get("ELASTIC_COMMIT_EVERY", "2"))
STEP_DELAY = float(os.environ.get("ELASTIC_STEP_DELAY", "0.05"))
HOLD_AT = int(os.environ["ELASTIC_HOLD_AT"]) if os.environ.get("ELASTIC_HOLD_AT") else None
HOLD_SIZE = int(os.environ.get("ELASTIC_HOLD_SIZE", "1"))
HOLD_FILE = os.environ.get("ELASTIC_HOLD_FILE")
MARK_DIR = os.environ.get("ELASTIC_MARK_DIR")
SIGSTOP_AT = int(os.environ["ELASTIC_SIGSTOP_AT"]) if os.environ.get("ELASTIC_SIGSTOP_AT") \
    else None
EXIT_IN_INIT = os.environ.get("ELASTIC_EXIT_IN_INIT")
ZERO_STAGE = int(os.environ.get("ELASTIC_ZERO_STAGE", "0"))
LR, MOMENTUM = 0.25, 0.5
DATASET, BATCH = 40, 2
STEP_LOG = os.environ.get("ELASTIC_STEP_LOG")


def _log_step(line: str) -> None:
    import hvdlite.torch as hvd

    if STEP_LOG and hvd.rank() == 0:
        with open(STEP_LOG, "a") as f:
            f.write(f"{line} {time.time():.3f}\n")


def steps_lost(log_text: str) -> list[int]:
    """The committed steps that were run again: a step below the highest commit so far."""
    committed, lost = 0, set()
    for line in log_text.splitlines():
        kind, value = line.split()[:2]
        if kind == "commit":
            committed = max(committed, int(value))
        elif kind == "run" and int(value) < committed:
            lost.add(int(value))
    return sorted(lost)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(-3, 4, (8, 4), generator=g).float()
    c = torch.randint(-2, 3, (8, 2), generator=g).float()
    return x, c


def make_model() -> torch.nn.Module:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(8.0).reshape(2, 4) / 4)
        model.bias.zero_()
    return model


def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, c = batch(step)
    opt.zero_grad()
    (model(x) * c).sum().backward()
    opt.step()


def reference(steps: int, momentum: bool = False):
    """The single-process result of `steps` steps (and the momentum buffers, if asked)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for s in range(steps):
        step_fn(model, opt, s)
    params = {k: v.tolist() for k, v in model.state_dict().items()}
    if momentum:
        return params, momentum_of(opt.state_dict())
    return params


def momentum_of(state_dict: dict) -> list:
    return [state_dict["state"][k]["momentum_buffer"].tolist()
            for k in sorted(state_dict["state"])]


def _mark(kind: str, text: str) -> None:
    if MARK_DIR:
        wid = (os.environ.get("HVDLITE_ELASTIC_WORKER")
               or f"rank{os.environ.get('HVDLITE_RANK', '0')}").replace(":", "_")
        path = os.path.join(MARK_DIR, f"{kind}.{wid}")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def _once(kind: str) -> bool:
    """True the first time in the job (a marker file in MARK_DIR)."""
    path = os.path.join(MARK_DIR or ".", f"once.{kind}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def main() -> int:
    import hvdlite.torch as hvd

    _mark("pid", str(os.getpid()))
    if EXIT_IN_INIT and os.environ.get("HVDLITE_ELASTIC_WORKER") == EXIT_IN_INIT \
            and _once("exit_in_init"):
        from hvdlite.common import basics

        def die(*args, **kwargs):  # a member lost while its round is in init()
            os._exit(3)
        basics._share_address = die
    if os.environ.get("ELASTIC_ONE_CORE") == "1":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # before init: whole passes
    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                   named_parameters=model.named_parameters(),
                                   zero_stage=ZERO_STAGE)
    sampler = hvd.elastic.ElasticSampler(range(DATASET), shuffle=True, seed=7)
    durable = {}
    if os.environ.get("ELASTIC_CHECKPOINT_DIR"):
        durable = {"checkpoint_dir": os.environ["ELASTIC_CHECKPOINT_DIR"],
                   "checkpoint_every": int(os.environ.get("ELASTIC_CHECKPOINT_EVERY", "1"))}
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, step=0, trace=[], epochs=[[]],
                                   **durable)
    sizes: list[int] = []
    state.register_reset_callbacks([lambda: sizes.append(hvd.size())])

    def hold() -> None:
        for _ in range(450):
            # Decided together (sizes are equal everywhere; the file by a collective), so that
            # every rank leaves the loop at the same iteration.
            released = HOLD_FILE is None or os.path.exists(HOLD_FILE)
            if HOLD_FILE is not None:
                flag = torch.tensor([1.0 if released else 0.0])
                released = hvd.allreduce(flag, name="hold.release", op=hvd.Max).item() > 0
            if released and hvd.size() >= HOLD_SIZE:
                return
            _mark("step", f"{state.step} {hvd.size()} {hvd.rank()}")
            state.check_host_updates()  # a collective: every rank loops in step
            time.sleep(0.2)

    def take_samples(it) -> bool:
        """Record the ids of this step's batch on every rank; False at the end of the epoch."""
        mine = [i for _, i in zip(range(BATCH), it)]
        got = hvd.allgather_object(mine, name="sample_ids")
        if not any(got):
            return False
        state.epochs[-1].extend(i for ids in got for i in ids)
        state.sampler.record_batch(0, BATCH)
        return True

    @hvd.elastic.run
    def train(state) -> None:
        it = iter(state.sampler)
        while state.step < TOTAL:
            if HOLD_AT is not None and state.step == HOLD_AT:
                hold()
            s = state.step
            _log_step(f"run {s}")
            step_fn(model, opt, s)
            # Unnamed: named by call site and count, which restart with every round, so a
            # worker that joins late names it as the survivors do.
            ones = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
            assert int(ones.item()) == hvd.size(), (ones, hvd.size())
            if not take_samples(it):
                state.epochs.append([])
                state.sampler.set_epoch(len(state.epochs) - 1)
                it = iter(state.sampler)
                take_samples(it)
            state.trace.append(s)
            state.step += 1
            _mark("step", f"{state.step} {hvd.size()} {hvd.rank()}")
            if SIGSTOP_AT is not None and state.step == SIGSTOP_AT and \
                    hvd.rank() == hvd.size() - 1 and _once("sigstop"):
                import signal
                os.kill(os.getpid(), signal.SIGSTOP)  # hung: alive, sockets open, silent
            if state.step % COMMIT_EVERY == 0:
                try:
                    state.commit()
                finally:  # saved even when the host-update check after it raises
                    _log_step(f"commit {state.step}")
            time.sleep(STEP_DELAY)

    train(state)
    _mark("done", f"{state.step} {hvd.size()} {hvd.rank()}")
    extra = {}
    if ZERO_STAGE:
        # Consolidated (a collective); every rank owns only its shard.
        extra = {"momentum": momentum_of(opt.state_dict()),
                 "owned": len(opt.owned_parameters())}
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({
            "step": state.step, "trace": state.trace, "size": hvd.size(),
            "epochs": state.epochs,
            "params": {k: v.tolist() for k, v in model.state_dict().items()},
            "reset_sizes": sizes,
            "flat": bool(getattr(opt, "_flat", None) and opt._flat.active), **extra}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
