"""Rank 1 finishes early (it calls shutdown and exits), dies (kill), or crashes on an uncaught
exception (raise); rank 0's next collective must fail fast, and say which.

argv[2] "tf": through hvdlite.tensorflow, eagerly, where the error must be Horovod's class for a
broken job, tf.errors.UnknownError, and a HorovodInternalError too."""
import sys
import time

if sys.argv[2:] == ["tf"]:
    import tensorflow as tf

    import hvdlite.tensorflow as hvd

    def ones():
        return tf.ones(2)
else:
    import torch

    import hvdlite.torch as hvd

    def ones():
        return torch.ones(2)

hvd.init()
r = hvd.rank()
hvd.allreduce(ones(), name="warmup")
if r == 1:
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(0)          # atexit runs hvd.shutdown()
    if mode == "raise":
        raise ValueError("the loader failed on batch 7\n(a second line, not shown)")
    if mode == "kill":
        import os
        import signal
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
t0 = time.monotonic()
try:
    time.sleep(1.0)
    hvd.allreduce(ones(), name="after")
except hvd.HorovodInternalError as exc:
    if sys.argv[2:] == ["tf"] and not isinstance(exc, tf.errors.UnknownError):
        print("NOT UnknownError", type(exc).__mro__, flush=True)
        sys.exit(1)
    print("RAISED", f"{time.monotonic() - t0:.1f}", str(exc).replace("\n", " "), flush=True)
    sys.exit(0)
print("NO ERROR", flush=True)
sys.exit(1)
