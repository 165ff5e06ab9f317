"""Parameter sharding (ZeRO-3) with FSDP2's calling pattern, on hvdlite's engine.

    import hvdlite.torch as hvd
    for block in model.blocks:
        hvd.fully_shard(block)
    hvd.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())      # the shards: 1/N of every parameter

Modules: `params` (the dim-0 layout of one parameter), `unit` (one block's collectives),
`schedule` (the hooks: when blocks are gathered, freed, reduced), `policies`, `state_dict`,
`clip`, `elastic` (TorchState handlers), `api` (fully_shard and its checks). See docs/fsdp.md.
"""
from . import elastic as _elastic
from .api import FSDPModule, fully_shard, sharded_param_of
from .clip import clip_grad_norm_
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state_dict import (full_optimizer_state_dict, full_state_dict, is_fully_sharded,
                         load_full_optimizer_state_dict, load_full_state_dict,
                         load_sharded_state_dict, optimizer_state_box, optimizer_state_shard,
                         sharded_state_dict)

_elastic.register()     # TorchState re-shards a fully sharded model and its optimizer

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "clip_grad_norm_", "full_optimizer_state_dict", "full_state_dict", "fully_shard",
           "is_fully_sharded", "load_full_optimizer_state_dict", "load_full_state_dict",
           "load_sharded_state_dict", "optimizer_state_box", "optimizer_state_shard",
           "sharded_param_of", "sharded_state_dict"]
