"""hvdlite.torch.checkpoint on N ranks: save, load (resharded), bad input.

The model and data are elastic_train's (every rank trains on the same integer-valued batch), so
after S steps the weights and momentum buffers equal `elastic_train.reference(S, momentum=True)`
exactly on any number of ranks, with or without ZeRO. Beside them a "table" tensor is held as
`LocalShard`s (rows split over the ranks, as a `fully_shard` state dict holds its parameters).

    checkpoint_checks.py save DIR STEPS ZERO     train STEPS steps, save DIR/commit-STEPS
    checkpoint_checks.py resume DIR STEPS MORE ZERO
                                                  load the newest under DIR (must be STEPS),
                                                  check it, train MORE steps, save again
    checkpoint_checks.py bad DIR                 every bad input, on every rank; then, in DIR/die,
                                                  save one and die while the next is written
"""
from __future__ import annotations

import logging
import os
import resource
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import elastic_train as et  # noqa: E402
from harness import check, expect_raises, fail, finish, log  # noqa: E402

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.torch import checkpoint  # noqa: E402
from hvdlite.torch.shard import LocalShard  # noqa: E402

TABLE = torch.arange(11 * 3, dtype=torch.float32).reshape(11, 3)


def my_rows() -> tuple[int, int]:
    bounds = [len(part) for part in torch.tensor_split(torch.arange(TABLE.shape[0]), hvd.size())]
    start = sum(bounds[:hvd.rank()])
    return start, bounds[hvd.rank()]


def build(zero: int, filled: bool):
    model = et.make_model()
    if not filled:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-1.0)   # must be overwritten by the load
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=et.LR,
                                                   momentum=et.MOMENTUM),
                                   named_parameters=model.named_parameters(), zero_stage=zero)
    start, n = my_rows()
    table = TABLE[start:start + n].clone() if filled else torch.zeros(n, 3)
    state = {"model": model, "optimizer": opt, "step": 0,
             "table": LocalShard(table, tuple(TABLE.shape), (start, 0))}
    return model, opt, state


def train(model, opt, first: int, steps: int) -> None:
    for s in range(first, first + steps):
        et.step_fn(model, opt, s)


def check_state(model, opt, state, steps: int) -> None:
    params, momentum = et.reference(steps, momentum=True)
    got = {k: v.tolist() for k, v in model.state_dict().items()}
    if got != params:
        fail(f"rank {hvd.rank()}: weights {got} != reference {params}")
    full = opt.state_dict()   # consolidated (a collective under ZeRO)
    if et.momentum_of(full) != momentum:
        fail(f"rank {hvd.rank()}: momentum {et.momentum_of(full)} != reference {momentum}")
    if state["step"] != steps:
        fail(f"rank {hvd.rank()}: step {state['step']} != {steps}")
    start, n = my_rows()
    shard = state["table"]
    if not torch.equal(shard.local, TABLE[start:start + n]):
        fail(f"rank {hvd.rank()}: table rows {start}..{start + n} = {shard.local.tolist()}")


def save_mode(root: str, steps: int, zero: int) -> None:
    model, opt, state = build(zero, filled=True)
    train(model, opt, 0, steps)
    state["step"] = steps

    def do_save():
        started = checkpoint.save(state, os.path.join(root, f"commit-{steps:04d}"), keep=2,
                                  extra={"step": steps})
        if not started:
            fail("save did not start")
        # Training goes on while the background thread writes (the step after it).
        ones = hvd.allreduce(torch.tensor([1.0]), name="after_save", op=hvd.Sum)
        if ones.item() != hvd.size():
            fail("collective after the save")
        err = checkpoint.wait()
        if err:
            fail(f"save failed: {err}")
        hvd.allreduce(torch.tensor([0.0]), name="saved")   # every rank's part is written
    check("save", do_save)


def resume_mode(root: str, steps: int, more: int, zero: int) -> None:
    model, opt, state = build(zero, filled=False)

    def do_load():
        found = checkpoint.load(root, state)
        if not found.endswith(f"commit-{steps:04d}"):
            fail(f"loaded {found}, expected commit-{steps:04d}")
    check("load", do_load)
    check("loaded_state_equals_reference", check_state, model, opt, state, steps)
    if more:
        train(model, opt, steps, more)
        state["step"] = steps + more

        def do_save():
            checkpoint.save(state, os.path.join(root, f"commit-{steps + more:04d}"), keep=2,
                            async_=False)
        check("save_again", do_save)


def bad_mode(root: str) -> None:
    model, opt, state = build(0, filled=True)
    train(model, opt, 0, 2)
    state["step"] = 2
    checkpoint.save(state, os.path.join(root, "commit-0002"), async_=False)

    def another_model():
        other = torch.nn.Sequential(torch.nn.Linear(4, 2))
        expect_raises(checkpoint.CheckpointError,
                      lambda: checkpoint.load(root, {"model": other}), "another model",
                      match=["does not match this state", "'model.0.weight'"])
        wider = torch.nn.Linear(5, 2)
        expect_raises(checkpoint.CheckpointError,
                      lambda: checkpoint.load(root, {"model": wider}), "another shape",
                      match=["'model.weight' has shape (2, 4) there but (2, 5) here"])
    check("another_models_checkpoint_names_the_key", another_model)

    def partial_skipped():
        # A save that never finished: shard files, no manifest.
        partial = os.path.join(root, "commit-0004")
        if hvd.rank() == 0:
            os.makedirs(partial, exist_ok=True)
            with open(os.path.join(partial, "__0_0.distcp"), "wb") as f:
                f.write(b"torn")
        hvd.allreduce(torch.tensor([0.0]), name="partial_made")
        records: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        handler = Keep()
        logging.getLogger("hvdlite.torch.checkpoint").addHandler(handler)
        try:
            _, _, fresh = build(0, filled=False)
            found = checkpoint.load(root, fresh)
        finally:
            logging.getLogger("hvdlite.torch.checkpoint").removeHandler(handler)
        if not found.endswith("commit-0002"):
            fail(f"loaded {found}")
        if not any("skipping" in r and "commit-0004" in r and "no manifest" in r
                   for r in records):
            fail(f"no warning about the partial checkpoint: {records}")
        if fresh["step"] != 2:
            fail(f"step {fresh['step']}")
    check("partial_checkpoint_skipped_with_a_warning", partial_skipped)

    def unwritable_on_one_rank():
        # Rank 1 may write no byte (as on a full disk); the same path on every rank.
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if hvd.rank() == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
        try:
            exc = expect_raises(checkpoint.CheckpointError,
                                lambda: checkpoint.save(state, os.path.join(root, "commit-0006")),
                                "unwritable on rank 1",
                                match=["rank 1", os.path.join(root, "commit-0006"),
                                       "File too large", "training state is unchanged"])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old)
        log(f"rank {hvd.rank()} saw: {exc}")
        # Training goes on.
        train(model, opt, 2, 1)
        if os.path.exists(os.path.join(root, "commit-0006", checkpoint.MANIFEST)):
            fail("a manifest was written for the failed save")
    check("unwritable_on_one_rank_fails_everywhere_and_training_goes_on",
          unwritable_on_one_rank)

    def second_save_skipped_or_waits():
        # A slow first write (its data is large) and a second save at once.
        big = {"w": torch.ones(4_000_000), "step": 1}
        checkpoint.save(big, os.path.join(root, "big-1"))
        skipped = not checkpoint.save(big, os.path.join(root, "big-2"), if_busy="skip")
        flags = hvd.allgather_object(skipped, name="skip_flags")
        if len(set(flags)) != 1:
            fail(f"ranks disagree on skipping: {flags}")
        checkpoint.save(big, os.path.join(root, "big-3"), if_busy="wait")
        checkpoint.wait()
        hvd.allreduce(torch.tensor([0.0]), name="big_done")
        if checkpoint.latest(os.path.join(root)) is None:
            fail("no complete checkpoint")
    check("at_most_one_save_in_flight", second_save_skipped_or_waits)
    finish()
    die_mode(os.path.join(root, "die"))


def die_mode(root: str) -> None:
    model, opt, state = build(0, filled=True)
    train(model, opt, 0, 2)
    state["step"] = 2
    checkpoint.save(state, os.path.join(root, "commit-0002"), async_=False)
    train(model, opt, 2, 2)
    state["step"] = 4
    # The next save's parts are written, but rank 0 is killed before it finishes the manifest.
    from torch.distributed.checkpoint import FileSystemWriter

    def stall(self, *args, **kwargs):
        log("STALLED BEFORE METADATA")
        os.kill(os.getpid(), signal.SIGKILL)
    FileSystemWriter.finish = stall
    checkpoint.save(state, os.path.join(root, "commit-0004"))
    time.sleep(60)


def main() -> int:
    hvd.init()
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "save":
        save_mode(root, int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "resume":
        resume_mode(root, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif mode == "bad":
        bad_mode(root)
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
