"""Placement: where every placed tensor lives, within each tier's budget, and how it moves.

One module per level, from the bytes up (listed below; docs/architecture.md, "The placement's
modules"). The runtime imports only this face (tests/test_architecture.py, PLACEMENT_INTERFACE).
"""

# The modules, from the bytes up:
# handles.py    TensorHandle and Kind: what a placed tensor is
# tiers.py      Budget, HostPool, PinnedArena: a tier's byte account and host buffers
# stand_in.py   the CPU's asynchronous stand-in for the copy streams
# streams.py    the device's copy streams and events; DeviceCopies, what the runtime uses
# cow_home.py   a checkpoint's files serving as NVMe homes until first written
# swap_dirs.py  this run's locked folder; reclaiming what killed runs left
# nvme.py       this run's swap files: extents, checksummed IO through io_engine
# tier_store.py one store per tier: buffers within the tier's budget
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
from tierzero.placement.cow_home import CheckpointHome, Segment
from tierzero.placement.eviction import EvictionPolicy, LeastRecentlyUsed
from tierzero.placement.handles import TRAFFIC_GROUPS, Kind, TensorHandle
from tierzero.placement.manager import PlacementManager
from tierzero.placement.nvme import ChecksumError, SwapSpace
from tierzero.placement.records import Residency, TensorRecord
from tierzero.placement.streams import CopyEvent, CopyStreams, DeviceCopies
from tierzero.placement.telemetry import (ACTIVATIONS_TRACK, MAX_EVENTS, STALL_SOURCES, UPDATES_TRACK, StepRecorder,
                                         StepStats, Telemetry)
from tierzero.placement.tiers import windowed_room

__all__ = ["PlacementManager", "Tier", "Kind", "TensorHandle", "TRAFFIC_GROUPS", "Residency", "TensorRecord",
           "CopyStreams", "CopyEvent", "DeviceCopies", "StepRecorder",
           "EvictionPolicy", "LeastRecentlyUsed", "CheckpointHome", "Segment", "SwapSpace", "ChecksumError",
           "StepStats", "Telemetry", "MAX_EVENTS", "STALL_SOURCES", "UPDATES_TRACK", "ACTIVATIONS_TRACK",
           "windowed_room"]
