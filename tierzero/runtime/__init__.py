"""The runtime: `tz.wrap(model, config)` and the levels that train a wrapped model.

Each module imports only those listed above it in docs/architecture.md ("The runtime's
modules", the way FSDP2 splits its levels). The phases of a step: [Note: a wrapped step] in
wrapping.py.
"""

from tierzero.runtime.accumulate import accumulate
from tierzero.runtime.flat.collectives import (RankRuntimeError, all_gather_objects, all_reduce_, broadcast_object, rank_errors,
                                          world)
from tierzero.runtime.compile import compile
from tierzero.runtime.flat.flat_param import FlatParam
from tierzero.runtime.flat.grads import FlatGrad
from tierzero.runtime.optimizer_guard import TIERED_OPTIMIZER
from tierzero.runtime.state import (TieredState, close, full_state_dict, gathered_params, model_dtype, placement_manager,
                                    settle, state_of, state_of_param, step_comm_bytes, step_stats)
from tierzero.runtime.step.schedule import LayerMajorRefusal
from tierzero.runtime.flat.shards import RankShard, rank_shards
from tierzero.runtime.step.step_context import StepContext
from tierzero.runtime.step.step_queue import StepFailed, StepQueue
from tierzero.runtime.split import tier_bytes
from tierzero.runtime.update import (MASTER, BlockState, Held, Piece, BlockUpdate, beside_compute, check_update_fits,
                                     global_norm, update_queue)
from tierzero.runtime.wrapping import refresh, wrap

__all__ = ["wrap", "accumulate", "LayerMajorRefusal", "compile", "tier_bytes", "refresh", "gathered_params", "state_of", "state_of_param",
           "placement_manager", "step_stats", "step_comm_bytes", "full_state_dict", "settle",
           "close", "model_dtype", "TieredState", "FlatParam", "FlatGrad", "StepContext", "StepQueue", "StepFailed",
           "RankRuntimeError", "rank_errors", "world", "all_reduce_", "broadcast_object", "all_gather_objects",
           "TIERED_OPTIMIZER", "MASTER", "BlockState", "Held", "BlockUpdate", "Piece",
           "check_update_fits", "update_queue", "global_norm", "beside_compute", "RankShard", "rank_shards"]
