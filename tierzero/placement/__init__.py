"""Placement: where every placed tensor lives, within each tier's budget, and how it moves.

One module per level, from the bytes up (listed below; docs/architecture.md, "The placement's
modules"). The runtime imports only this face (tests/test_architecture.py, PLACEMENT_INTERFACE).
"""

# The modules, from the bytes up:
# handles.py    TensorHandle and Kind: what a placed tensor is
# storage/      the bytes: tiers' budgets and buffers, copy streams, swap files (its __init__)
# telemetry.py  moves, stalls, bytes per tier, the Chrome trace; StepRecorder
# moves.py      a move in flight, its legs and outcome
# records.py    Residency, Content, Copy, TensorRecord: one tensor's state per tier
# plans.py      the typed plans of moves and the worker bodies that run them
# executor.py   MoveExecutor and MoveTable: runs the bodies on workers, commits them under the lock
# eviction.py   Room: reservations all or nothing, evicting by policy
# waiting.py    the wait for room or a move, and when it gives up
# residency.py  CopyStates (the records and their transitions: the state machine) and
#               ResidencyTable (the calls on cached copies, each in one method)
# homes.py      Homes: the calls on home copies (register, unregister, relabel, store, read)
# scratch.py    Scratch: buffers a caller fills and computes on itself
# manager.py    PlacementManager: the public API, a thin face over the table and the homes

from tierzero.config import Tier
from tierzero.placement.storage.cow_home import CheckpointHome, Segment
from tierzero.placement.eviction import EvictionPolicy, LeastRecentlyUsed
from tierzero.placement.handles import TRAFFIC_GROUPS, Kind, TensorHandle
from tierzero.placement.manager import PlacementManager
from tierzero.placement.storage.nvme import ChecksumError, SwapSpace
from tierzero.placement.records import Residency, TensorRecord
from tierzero.placement.storage.streams import CopyEvent, CopyStreams, DeviceCopies
from tierzero.placement.telemetry import (ACTIVATIONS_TRACK, MAX_EVENTS, STALL_SOURCES, UPDATES_TRACK, StepRecorder,
                                         StepStats, Telemetry)
from tierzero.placement.storage.tiers import windowed_bytes

__all__ = ["PlacementManager", "Tier", "Kind", "TensorHandle", "TRAFFIC_GROUPS", "Residency", "TensorRecord",
           "CopyStreams", "CopyEvent", "DeviceCopies", "StepRecorder",
           "EvictionPolicy", "LeastRecentlyUsed", "CheckpointHome", "Segment", "SwapSpace", "ChecksumError",
           "StepStats", "Telemetry", "MAX_EVENTS", "STALL_SOURCES", "UPDATES_TRACK", "ACTIVATIONS_TRACK",
           "windowed_bytes"]
