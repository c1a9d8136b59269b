"""`DeviceAccount`: the one account of a wrapped model's device room, which the blocks' fetches,
the prefetcher, early gradient capture and the placed activations all read and write.

Placement reserves every byte it moves (tierzero.placement); this account is the runtime's view
of the device budget within a step: what the step's own holders take out of it, so that each of
them judges the room left by the same sum. See [Note: the device account].
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping, Protocol

from tierzero.config import Tier
from tierzero.placement import PlacementManager, TensorHandle


class HeldBlock(Protocol):
    """What the account uses of a block (tierzero.runtime.blocks.Block, above)."""

    name: str
    nbytes: int


# [Note: the device account]
# The device budget less, at any moment:
#
#     homes        tensors registered with a device home (their whole life; activations' packs apart)
#     held         the blocks fetched now (from their fetch to their release)
#     activations  placed activations kept on the device: packs homed there, and device copies
#                  of packs homed elsewhere acquired for a block's backward
#     capture      early capture's device buffers (grads.py), taken only while the largest block
#                  still fits beside them (`take_capture`), so a fetch never lacks room for them
#
# is `free_bytes()`: what a fetch, an all-gather started ahead, tz.gathered_params and the placed
# activations' choice of tier see. The prefetcher plans within `free_for_prefetch()`, which also
# leaves out the packs brought (or on their way) to the device ahead of backward and not used yet:
# counted as free, each fetch brought more packs, which the blocks' fetches pushed out again
# before backward reached them. `beside()` is what the tier model replays at each fetch
# (tierzero/planning/tier_model.py): the bytes that come and go over an iteration beside the
# held blocks and the packs acquired for backward.
class DeviceAccount:
    """The device room of one wrapped model's step (see [Note: the device account])."""

    def __init__(self, pm: PlacementManager) -> None:
        self.pm = pm
        self.budget = pm.budget(Tier.DEVICE)
        """The device budget (a manager's budgets are fixed when it is made)."""
        self.captures = 0
        """Flat gradients whose shares early capture summed on the device (grads.py), since wrap."""
        self.largest_block = 0
        """Device bytes of the largest block: room early capture leaves for the next fetch."""
        self.ahead: Callable[[], int] = lambda: 0
        """Bytes of placed activations brought (or coming) to the device ahead of backward and not
        used yet (Activations.bytes_ahead, once the activations are placed)."""
        self._held: dict[str, HeldBlock] = {}
        self.held: Mapping[str, HeldBlock] = MappingProxyType(self._held)
        """Blocks fetched now, by name (read-only)."""
        self._homes = 0
        self._activations = 0
        self._activation_homes = 0
        """Of `_activations`, the packs homed on the device (the rest: acquired copies)."""
        self._capture = 0

    # ------------------------------------------------------------------------- the room

    def free_bytes(self) -> int:
        """Bytes of the device budget not taken by device-homed tensors, held blocks, the placed
        activations kept on the device and early capture's buffers."""
        held = sum(block.nbytes for block in self._held.values())
        return self.budget - self._homes - held - self._activations - self._capture

    def free_for_prefetch(self) -> int:
        """`free_bytes()` less the placed activations brought ahead of backward and not used yet: the
        room the prefetcher plans in."""
        return self.free_bytes() - self.ahead()

    def beside(self) -> int:
        """Device bytes neither held blocks nor packs acquired for backward take out of the room
        beside the homes: early capture's buffers and packs homed on the device."""
        return self._capture + self._activation_homes

    @property
    def homes(self) -> int:
        """Bytes of the tensors registered with a device home (not activations)."""
        return self._homes

    # ------------------------------------------------------------------------- its entries

    def registered(self, handle: TensorHandle, *, added: bool) -> None:
        """A tensor was registered (`added`) or unregistered: a device home counts."""
        if handle.home is Tier.DEVICE:
            self._homes += handle.nbytes if added else -handle.nbytes

    def hold(self, block: HeldBlock) -> None:
        self._held[block.name] = block

    def release(self, block: HeldBlock) -> None:
        del self._held[block.name]

    def add_activations(self, nbytes: int, *, home: bool = False) -> None:
        """Placed activations took (or, negative, gave back) device bytes; `home`: packs homed
        on the device, else device copies of packs homed elsewhere, acquired for backward."""
        self._activations += nbytes
        if home:
            self._activation_homes += nbytes

    def take_capture(self, nbytes: int) -> bool:
        """Take `nbytes` for early capture if the largest block still fits beside them; give them
        back with `capture_done`."""
        if self.free_bytes() - nbytes < self.largest_block:
            return False
        self._capture += nbytes
        self.captures += 1
        return True

    def capture_done(self, nbytes: int) -> None:
        self._capture -= nbytes

    def __repr__(self) -> str:
        return (f"DeviceAccount(free={self.free_bytes()}, held={list(self._held)}, homes={self._homes}, "
                f"activations={self._activations}, capture={self._capture})")
