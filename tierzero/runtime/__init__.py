"""The runtime: `tz.wrap(model, config)` and the levels that train a wrapped model.

Each module imports only those above it in this list (the way FSDP2 splits its levels):

    collectives.py      torch.distributed calls over flat tensors (module-level, so tests patch them)
    step_queue.py       the overlapped step's FIFO of block updates
    step_context.py     StepContext: what one wrapped model's blocks share in a step
    gathers.py          one flat tensor's fetch: the device copy of its shard and its all-gather
    grads.py            FlatGrad: one flat tensor's gradient shard, early capture
    placeholders.py     parameters that refuse to be read while they hold no data
    flat_param.py       FlatParam: one flat tensor and the nn.Parameters that view it
    fetch_group.py      FetchGroup: a block's flat tensors fetched and reduced together
    activation_pack.py  ActivationPack: one block call's saved tensors, as one placed tensor
    activations.py      Activations: what autograd saves in a block call, placed on its tier
    recompute.py        Frame: activation checkpointing's recompute of a block call
    blocks.py           Block: the hooks of forward, backward, recomputation
    optimizer_guard.py  refusing torch optimizers that would not train a wrapped model
    state.py            TieredState: the root of a wrapped model, the queries on it, tz.gathered_params
    shards.py           RankShard: this rank's shard of a stored tensor, read and written (checkpoints)
    update.py           BlockState: a block's optimizer state and the room one update holds (optim)
    split.py            each block's tier per kind at wrap (split placement), tz.tier_bytes
    wrapping.py         tz.wrap: blocks built, hooks registered, the prefetcher attached; refresh
    accumulate.py       tz.accumulate: gradient accumulation layer by layer over k micro-batches
    compile.py          tz.compile: each block's forward compiled, the hooks outside the graphs

The phases of a step: [Note: a wrapped step] in wrapping.py.
"""

from tierzero.runtime.accumulate import accumulate
from tierzero.runtime.collectives import RankRuntimeError, all_reduce_, rank_errors, world
from tierzero.runtime.compile import compile
from tierzero.runtime.flat_param import FlatParam
from tierzero.runtime.grads import FlatGrad
from tierzero.runtime.optimizer_guard import TIERED_OPTIMIZER
from tierzero.runtime.state import (TieredState, close, full_state_dict, gathered_params, model_dtype, placement_manager,
                                    settle, state_of, state_of_param, step_comm_bytes, step_stats)
from tierzero.runtime.shards import RankShard, values_shard
from tierzero.runtime.step_context import StepContext
from tierzero.runtime.step_queue import StepFailed, StepQueue
from tierzero.runtime.split import tier_bytes
from tierzero.runtime.update import (MASTER, BlockState, Piece, UpdateRoom, beside_compute, check_update_rooms,
                                     global_norm, update_queue)
from tierzero.runtime.wrapping import refresh, wrap

__all__ = ["wrap", "accumulate", "compile", "tier_bytes", "refresh", "gathered_params", "state_of", "state_of_param",
           "placement_manager", "step_stats", "step_comm_bytes", "full_state_dict", "settle",
           "close", "model_dtype", "TieredState", "FlatParam", "FlatGrad", "StepContext", "StepQueue", "StepFailed",
           "RankRuntimeError", "rank_errors", "world", "all_reduce_", "TIERED_OPTIMIZER", "MASTER", "BlockState", "UpdateRoom", "Piece",
           "check_update_rooms", "update_queue", "global_norm", "beside_compute", "RankShard", "values_shard"]
