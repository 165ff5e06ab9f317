"""`import hvdlite.torch as hvd`: Horovod's PyTorch API on hvdlite's engine."""
from ..common import basics as _basics
from ..common.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                             gloo_built, gloo_enabled, is_homogeneous, is_initialized,
                             local_rank, local_size, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rank, rocm_built, size,
                             start_timeline, stop_timeline)
from ..common.basics import add_process_set, remove_process_set
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..common.process_sets import ProcessSet, global_process_set
from . import mpi_ops as _mpi_ops
from .compression import Compression, drive_all
from .mpi_ops import *  # noqa: F401,F403
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import parallel
from . import elastic


def init(comm=None, process_sets=None) -> None:
    """Initialize hvdlite (Horovod's `hvd.init`)."""
    _mpi_ops._reset()
    _basics.init(comm, process_sets)


def shutdown() -> None:
    """Shut hvdlite down; `init()` may be called again afterwards."""
    _basics.shutdown()
    _mpi_ops._reset()
