"""Placement: where every placed tensor lives, within each tier's budget, and how it moves.

One module per level, from the bytes up:

    handles.py    TensorHandle and Kind: what a placed tensor is
    tiers.py      Budget (a tier's byte account) and HostPool (page-aligned, pinned with CUDA)
    stand_in.py   the CPU's asynchronous stand-in for them: serial copy workers, poison, checks
    streams.py    the device's copy streams and events (CUDA's, or the CPU's stand-ins)
    cow_home.py   a checkpoint's files serving as NVMe homes until first written
    swap_dirs.py  this run's locked folder; reclaiming what killed runs left, safely
    nvme.py       this run's swap files: extents, checksummed IO through io_engine
    tier_store.py one store per tier: buffers within the tier's budget
    telemetry.py  moves, stalls, bytes per tier and the Chrome trace
    moves.py      the typed plan of each move, the worker bodies, the executor that runs them
    eviction.py   Room: reservations all or nothing, evicting by policy, writing dirty copies home
    residency.py  Residency, TensorRecord, ResidencyTable: the records and their transitions
    waiting.py    the wait for room or a move, and when it gives up
    manager.py    PlacementManager: the public API
"""

from tierzero.config import Tier
from tierzero.placement.cow_home import CheckpointHome, Segment
from tierzero.placement.eviction import EvictionPolicy, LeastRecentlyUsed
from tierzero.placement.handles import TRAFFIC_GROUPS, Kind, TensorHandle
from tierzero.placement.manager import PlacementManager
from tierzero.placement.nvme import ChecksumError, SwapSpace
from tierzero.placement.residency import Residency, TensorRecord
from tierzero.placement.streams import CopyEvent, CopyStreams
from tierzero.placement.telemetry import (ACTIVATIONS_TRACK, MAX_EVENTS, STALL_SOURCES, UPDATES_TRACK, StepStats,
                                         Telemetry)

__all__ = ["PlacementManager", "Tier", "Kind", "TensorHandle", "TRAFFIC_GROUPS", "Residency", "TensorRecord",
           "CopyStreams", "CopyEvent",
           "EvictionPolicy", "LeastRecentlyUsed", "CheckpointHome", "Segment", "SwapSpace", "ChecksumError",
           "StepStats", "Telemetry", "MAX_EVENTS", "STALL_SOURCES", "UPDATES_TRACK", "ACTIVATIONS_TRACK"]
