"""Print this rank's launcher-provided environment as one JSON line; with `store`, also meet
the other ranks in the job's TCPStore (rank r writes, then reads rank r+1's key). The driver
serves it, or rank 0 does on the socket in HVDLITE_STORE_FD when rank 0 runs on the launcher's
machine."""
import json
import os
import sys

keys = sorted(k for k in os.environ
              if k.startswith(("HVDLITE_", "HOROVOD_")) or k in
              ("PYTHONUNBUFFERED", "NCCL_IB_DISABLE", "LAUNCHER_TEST_CALLER_VAR"))
report = {k: os.environ[k] for k in keys}

if "store" in sys.argv[1:]:
    import datetime

    from torch.distributed import TCPStore

    rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
    addr, port = os.environ["HVDLITE_STORE_ADDR"], int(os.environ["HVDLITE_STORE_PORT"])
    timeout = datetime.timedelta(seconds=20)
    if "HVDLITE_STORE_FD" in os.environ:  # a local rank 0 serves the store (as hvd.init() does)
        store = TCPStore(addr, port, None, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=int(os.environ["HVDLITE_STORE_FD"]))
    else:
        store = TCPStore(addr, port, None, False, timeout=timeout)
    store.set(f"test/{rank}", f"hello from {rank}")
    peer = (rank + 1) % size
    store.wait([f"test/{peer}"])
    report["peer_value"] = store.get(f"test/{peer}").decode()
    # The store lives as long as the process that serves it: rank 0 stays until every rank
    # is done with it.
    store.add("test/done", 1)
    if "HVDLITE_STORE_FD" in os.environ:
        import time

        deadline = time.monotonic() + 20
        while store.add("test/done", 0) < size and time.monotonic() < deadline:
            time.sleep(0.01)

print("ENV " + json.dumps(report))
