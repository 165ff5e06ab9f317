"""Tensor- and pipeline-parallel add-ons for hvdlite's PyTorch frontend.

Everything runs on hvdlite's engine and process sets (no second communicator), under
`hvdlite-run`, and composes with data parallelism through `DistributedOptimizer(...,
process_set=mesh.dp)`:

    import hvdlite.torch as hvd
    from hvdlite.torch import parallel

    hvd.init(process_sets="dynamic")
    mesh = parallel.mesh(tp=2, pp=2)                  # Megatron's rank layout, tp fastest
    parallel.model_parallel_seed(1234)
    layers = [Embedding(...), Block(...), ..., Head(...)]   # built from ColumnParallelLinear,
                                                             # RowParallelLinear, ...
    pipe = parallel.Pipeline(layers, chunks=8, schedule="1f1b", process_set=mesh.pp)
    loss = pipe.train_step(tokens, targets, loss_fn)  # loss_fn may use vocab_parallel_cross_entropy

See README.md in this directory for the full guide (docs/parallel.md includes it).
"""
from . import p2p, schedule
from .cross_entropy import vocab_parallel_cross_entropy
from .grads import clip_grad_norm_, grad_norm
from .groups import Mesh, current_mesh, ensure_process_sets, find_process_set, mesh, mesh_groups
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     gather_state_dict, gather_tensor_parallel, load_full_state_dict, shard_of)
from .mappings import (copy_to_tensor_model_parallel_region, copy_to_tensor_parallel_region,
                       gather_from_tensor_model_parallel_region,
                       gather_from_tensor_parallel_region,
                       reduce_from_tensor_model_parallel_region,
                       reduce_from_tensor_parallel_region,
                       scatter_to_tensor_model_parallel_region,
                       scatter_to_tensor_parallel_region)
from .pipeline import (Pipeline, PipelineError, PipelineStats, PipelineTimeoutError, Pop,
                       SkipSequential, Stash)
from .random import (MODEL_PARALLEL_RNG, RNGStatesTracker, checkpoint, get_rng_tracker,
                     model_parallel_seed)
from .schedule import ScheduleError, ScheduleReport, bubble_formula

__all__ = [
    "mesh", "Mesh", "mesh_groups", "current_mesh", "find_process_set", "ensure_process_sets",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "gather_tensor_parallel", "gather_state_dict",
    "load_full_state_dict", "shard_of", "clip_grad_norm_", "grad_norm",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "RNGStatesTracker", "get_rng_tracker", "model_parallel_seed", "checkpoint",
    "MODEL_PARALLEL_RNG",
    "Pipeline", "PipelineError", "PipelineTimeoutError", "PipelineStats", "Stash", "Pop",
    "SkipSequential", "ScheduleError", "ScheduleReport", "bubble_formula", "p2p", "schedule",
]
