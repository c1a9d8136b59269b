"""Layout: which modules form a block, how a block's parameters pack into flat tensors, and
what each ZeRO stage keeps whole. Pure arithmetic over a model's parameters (no placement, no
communication), shared by the runtime that builds blocks and the planning that sizes them.

    grouping.py     blocks of a model: the repeated layers, the containers outside them, the root
    flat_layout.py  FlatLayout: parameters packed, aligned, padded to the world size, sharded
    zero.py         ZeroStage (what a rank keeps whole) and CommBytes (bytes of collectives)
    sizes.py        device bytes of a block while fetched
    saved.py        PackLayout: the tensors autograd saves in a block call, packed as segments
    split.py        split placement: each block's tier of a kind split across tiers
    state_bytes.py  the state's flat tensors per block, kind and tier, and their bytes
    plan.py         PlacementPlan: every block's tiers, every tier's homes and the step's room there,
                    the check wrap refuses by, the least budgets, the split "auto" chooses
    state_codec.py  an optimizer state's values in its format (fp32, bf16, blockwise int8)
"""

from tierzero.layout.flat_layout import ALIGN_BYTES, FlatLayout, ParamSlot
from tierzero.layout.grouping import (ROOT, BlockSpec, assign_params, block_specs, blocks_of, group_modules,
                                      outside_read_hints, param_count, unique_params)
from tierzero.layout.saved import SEGMENT_ALIGN, PackLayout, SavedGeometry, SavedSpan, Segment, saved_span
from tierzero.layout.split import BlockTiers, split_blocks
from tierzero.layout.state_bytes import (Blocks, FlatTensor, KindSizes, kind_sizes, placement_order, state_tensors,
                                         tier_need)
from tierzero.layout.plan import NVME_MOVES, PlacementPlan, PlanInputs
from tierzero.layout.state_codec import StateCodec, round_stochastic_, sqrt_, window_numel
from tierzero.layout.sizes import block_fetch_bytes, fetched_bytes, flat_groups
from tierzero.layout.zero import CommBytes, ZeroStage

__all__ = ["FlatLayout", "ParamSlot", "ALIGN_BYTES", "ROOT", "BlockSpec", "assign_params", "block_specs",
           "blocks_of", "group_modules", "outside_read_hints", "param_count", "unique_params", "block_fetch_bytes", "fetched_bytes",
           "flat_groups", "CommBytes", "ZeroStage", "PackLayout", "SavedGeometry", "SavedSpan", "Segment", "SEGMENT_ALIGN",
           "saved_span", "BlockTiers", "KindSizes", "split_blocks", "Blocks", "FlatTensor", "kind_sizes",
           "placement_order", "state_tensors", "tier_need", "NVME_MOVES", "PlacementPlan", "PlanInputs",
           "StateCodec", "round_stochastic_", "sqrt_", "window_numel"]
