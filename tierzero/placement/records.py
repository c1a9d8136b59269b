"""A placed tensor's record: `Residency` per tier, the `Copy` on each tier it is on, and the
`TensorRecord` that holds them. ResidencyTable (residency.py) and Homes (homes.py) are the
state machine: their transitions are the only writers of these; everyone else reads the views that
`PlacementManager.record(handle)` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Mapping

import torch

from tierzero.config import Tier
from tierzero.placement.handles import TensorHandle
from tierzero.placement.moves import Move
from tierzero.placement.storage.streams import DONE, CopyEvent
from tierzero.placement.storage.tier_store import Buffer


class Residency(Enum):
    """State of one tensor on one tier, and what it costs there.

    HOME          the tensor's home copy: its bytes are reserved on the tier from register to
                  unregister (or close).
    ABSENT        no copy on this tier: costs nothing.
    FETCHING      a copy toward this tier is in flight: its bytes are reserved here (plus a host
                  staging buffer while an NVMe read feeds a device copy).
    RESIDENT      a valid cached copy: its bytes are reserved; evictable when unpinned.
    WRITING_BACK  a cached copy whose contents are being written to the home tier: bytes reserved
                  (plus a host staging buffer for device -> NVMe); not evictable until done.
    """

    HOME = "home"
    ABSENT = "absent"
    FETCHING = "fetching"
    RESIDENT = "resident"
    WRITING_BACK = "writing_back"


class Content(Enum):
    """What a copy holds against the home: one state, not flags.

    CURRENT  the home's values (the home copy itself is always CURRENT).
    DIRTY    newer than the home (released dirty with lazy=True): written back before it is
             evicted, or dropped unwritten by discard().
    STALE    older than another copy that was written (or never written: a blank copy for an
             overwrite), while it was pinned or moving: dropped once it is free, never read.
    """

    CURRENT = "current"
    DIRTY = "dirty"
    STALE = "stale"


@dataclass(eq=False)
class Copy:
    """One tensor's bytes on one tier (a TensorRecord keeps one per tier it is on); only the
    ResidencyTable's transitions write it."""

    buffer: Buffer
    """What holds the reservation: a host pool buffer, a device buffer, or an NVMe region."""
    tensor: torch.Tensor | None
    """The bytes viewed with the registered shape and dtype (None for an NVMe region)."""
    content: Content = Content.CURRENT
    pins: int = 0
    """Acquires not yet released, plus moves in flight reading from this copy."""
    holders: list[int] = field(default_factory=list)
    """The threads (idents) of the acquires not yet released: a wait for room that only this
    thread's own copies block can never end (the wait tells it at once)."""
    used: bool = False
    """Acquired since it was fetched: a prefetched copy not yet used is evicted last."""
    event: CopyEvent = DONE
    """The copy that filled it; compute waits on it before using the tensor."""
    move: Move | None = None
    """The move in flight on it: the fetch filling it, the write-back reading it, or (on an
    NVMe home) the store writing it."""


class TensorRecord:
    """A registered tensor: its handle (name, shape, dtype, bytes, home tier) and where it is now.

    `residency` (per tier), `pins(tier)` and `in_flight` are read-only views; only
    the transition methods of ResidencyTable and Homes change them.
    """

    def __init__(self, handle: TensorHandle) -> None:
        self.handle = handle
        self.name = handle.name
        self.nbytes = handle.nbytes
        self.shape: torch.Size = handle.shape
        self.dtype: torch.dtype = handle.dtype
        self.home: Tier = handle.home
        self._residency = {t: Residency.ABSENT for t in Tier}
        self.residency: Mapping[Tier, Residency] = MappingProxyType(self._residency)
        """Per tier; read-only (a view, not a property: readers on the hot path call nothing)."""
        self._copies: dict[Tier, Copy] = {}
        self._home_error: BaseException | None = None
        """The last write to the home failed: its contents there are lost until the next write."""

    @property
    def in_flight(self) -> tuple[Move, ...]:
        return tuple(c.move for c in self._copies.values() if c.move is not None)

    def pins(self, tier: Tier | str) -> int:
        copy = self._copies.get(Tier.parse(tier))
        return copy.pins if copy is not None else 0

    def __repr__(self) -> str:
        where = ", ".join(f"{t.value}: {r.value}" for t, r in self._residency.items() if r is not Residency.ABSENT)
        return (f"TensorRecord({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"nbytes={self.nbytes}, home={self.home.value}, {{{where}}})")
