"""Placement: where every placed tensor lives, within each tier's budget, and how it moves.

One module per level, from the bytes up: docs/architecture.md ("The placement's modules").
"""

from tierzero.config import Tier
from tierzero.placement.cow_home import CheckpointHome, Segment
from tierzero.placement.eviction import EvictionPolicy, LeastRecentlyUsed
from tierzero.placement.handles import TRAFFIC_GROUPS, Kind, TensorHandle
from tierzero.placement.manager import PlacementManager
from tierzero.placement.nvme import ChecksumError, SwapSpace
from tierzero.placement.residency import Residency, TensorRecord
from tierzero.placement.streams import CopyEvent, CopyStreams, DeviceCopies
from tierzero.placement.telemetry import (ACTIVATIONS_TRACK, MAX_EVENTS, STALL_SOURCES, UPDATES_TRACK, StepRecorder,
                                         StepStats, Telemetry)
from tierzero.placement.tiers import windowed_room

__all__ = ["PlacementManager", "Tier", "Kind", "TensorHandle", "TRAFFIC_GROUPS", "Residency", "TensorRecord",
           "CopyStreams", "CopyEvent", "DeviceCopies", "StepRecorder",
           "EvictionPolicy", "LeastRecentlyUsed", "CheckpointHome", "Segment", "SwapSpace", "ChecksumError",
           "StepStats", "Telemetry", "MAX_EVENTS", "STALL_SOURCES", "UPDATES_TRACK", "ACTIVATIONS_TRACK",
           "windowed_room"]
