"""Worker side of `hvdlite.runner.run`: fetch the function, run it, hand back the result.

Started by the driver as `python -m hvdlite.runner.run_task`; everything it needs comes from the
rank environment (store address, rank, job secret), so no secret or address is on a command line.
"""
from __future__ import annotations

import datetime
import sys
import traceback

FUNC_KEY = "hvdlite/runfunc"


def result_key(rank: "int | str") -> str:
    """Where a rank (or, in elastic jobs, a worker `host:slot`) leaves its outcome."""
    return f"hvdlite/result/{rank}"


def main() -> int:
    import cloudpickle
    from torch.distributed import TCPStore

    from hvdlite.runner.secret import SECRET_ENV, sign, verify

    from hvdlite.common import config
    from hvdlite.common.rendezvous import ELASTIC_WORKER_ENV

    from hvdlite.runner.mpi_rank import mpi_rank_from_env

    # An elastic worker's rank changes; its result is filed under its stable worker id. Under
    # mpiexec (run(use_mpi=True)) the rank is MPI's.
    rank = config.raw(ELASTIC_WORKER_ENV) or int(config.raw("HVDLITE_RANK")
                                                   or mpi_rank_from_env("0"))
    timeout = datetime.timedelta(seconds=float(config.raw("HVDLITE_START_TIMEOUT", "30")))
    store = TCPStore(config.raw("HVDLITE_STORE_ADDR"), int(config.raw("HVDLITE_STORE_PORT")),
                     None, False, timeout=timeout)
    key = bytes.fromhex(config.raw(SECRET_ENV))
    func, args, kwargs = cloudpickle.loads(verify(key, store.get(FUNC_KEY)))
    try:
        payload = ("ok", func(*args, **kwargs))
    except Exception:
        text = traceback.format_exc()
        sys.stderr.write(text)
        payload = ("error", text)
    try:
        data = cloudpickle.dumps(payload)
    except Exception:
        text = f"the return value of rank {rank} cannot be pickled:\n{traceback.format_exc()}"
        sys.stderr.write(text)
        payload = ("error", text)
        data = cloudpickle.dumps(payload)
    store.set(result_key(rank), sign(key, data))
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if payload[0] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
