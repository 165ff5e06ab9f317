"""`import hvdlite.torch as hvd`: Horovod's PyTorch API on hvdlite's engine."""
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..common.process_sets import ProcessSet, global_process_set
from .compression import Compression, drive_all
from .mpi_ops import *  # noqa: F401,F403
# (Horovod's horovod.torch.mpi_ops holds these too, and `from ...mpi_ops import rank` works.)
from .mpi_ops import (add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                      ddl_built, gloo_built, gloo_enabled, init, is_homogeneous,
                      is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built,
                      shutdown, size, start_timeline, stop_timeline)
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import parallel
from . import elastic

from . import fsdp  # noqa: F401
from .fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,  # noqa: F401
                   OffloadPolicy, full_optimizer_state_dict, full_state_dict, fully_shard,
                   load_full_optimizer_state_dict, load_full_state_dict, load_sharded_state_dict,
                   sharded_state_dict)
