"""Every kind of cross-rank mismatch raises the same clear error on every rank, and the job goes on."""
import time

import torch

import hvdlite.torch as hvd

hvd.init()
r = hvd.rank()


def expect_error(fn, *needles):
    t0 = time.monotonic()
    try:
        fn()
    except hvd.HorovodInternalError as exc:
        msg = str(exc)
        for n in needles:
            assert n in msg, f"{n!r} not in {msg!r}"
        assert time.monotonic() - t0 < 10, "error took too long"
        print("ERROR-OK", msg.splitlines()[0][:200], flush=True)
        return
    raise AssertionError(f"no error for {needles}")


expect_error(lambda: hvd.allreduce(torch.ones(2 + r, 3), name="w.shape"),
             "w.shape", "[2, 3]", "[3, 3]", "rank 0", "rank 1")
expect_error(lambda: hvd.allreduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64),
                                   name="w.dtype"), "w.dtype", "float32", "float64")
expect_error(lambda: (hvd.allreduce(torch.ones(3), name="w.op") if r == 0
                      else hvd.broadcast(torch.ones(3), 0, name="w.op")),
             "w.op", "ALLREDUCE", "BROADCAST")
expect_error(lambda: hvd.broadcast(torch.ones(3), root_rank=r, name="w.root"),
             "w.root", "root")
expect_error(lambda: hvd.allreduce(torch.ones(3), name="w.redop",
                                   op=hvd.Sum if r == 0 else hvd.Max), "w.redop", "Sum", "Max")
expect_error(lambda: hvd.allreduce(torch.ones(3), name="w.scale", prescale_factor=1.0 + r),
             "w.scale", "prescale")
expect_error(lambda: hvd.allgather(torch.ones(2, 3 + r), name="w.gather"), "w.gather",
             "first dimension")
# One bad member of a grouped op fails the group on every rank; its other members do not wait
# for that member forever.
expect_error(lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(3 + r), torch.ones(4)],
                                           name="w.group"),
             "w.group.1", "[3]", "[4]", "rank 0", "rank 1")
# The job is still healthy afterwards.
out = hvd.allreduce(torch.ones(3) * r, name="after", op=hvd.Sum)
assert out.tolist() == [sum(range(hvd.size()))] * 3
print("OK", flush=True)
hvd.shutdown()
