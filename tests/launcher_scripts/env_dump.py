"""Print this rank's launcher-provided environment as one JSON line; with `store`, also meet
the other ranks in the driver's TCPStore (rank r writes, then reads rank r+1's key)."""
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
    store = TCPStore(os.environ["HVDLITE_STORE_ADDR"], int(os.environ["HVDLITE_STORE_PORT"]),
                     None, False, timeout=datetime.timedelta(seconds=20))
    store.set(f"test/{rank}", f"hello from {rank}")
    peer = (rank + 1) % size
    store.wait([f"test/{peer}"])
    report["peer_value"] = store.get(f"test/{peer}").decode()

print("ENV " + json.dumps(report))
