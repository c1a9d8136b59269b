"""Room on the tiers: reservations taken all or nothing, evicting cached copies by policy.

`Room` is what PlacementManager asks for the buffers of a move. For each (tier, nbytes) it
needs, the tier's store allocates within the budget; when it has no room, unpinned RESIDENT
cached copies on that tier are offered to the `EvictionPolicy` (least recently used first) and
evicted, victims first, until the buffer fits. If one need cannot be met, the buffers taken for
the others go back and the answer is a `Shortfall` naming what was missing, so no reservation
is ever held while waiting for another. Room also counts the bytes homed on each tier, to
refuse at once a tensor that can never fit.

Room keeps no residency: PlacementManager tells it which copies exist (`cached`, `touch`,
`forget`) and lends it callbacks: `evictable(handle, tier)`, `evict(handle, tier)` (its drop
transition), `clean(tier, nbytes)`, called when a need falls short, which starts writing
back dirty cached copies there (lazy releases) so they become evictable once written, and
`unused(handle, tier)`: a prefetched copy not used yet (no acquire, no move has read it),
evicted after the others whatever the policy's order;
`buffer(handle, tier)`: a cached copy's buffer, for a store whose memory is one region to pick,
among the policy's victims, those that open a window of the size needed ([Note: arena windows]
in tiers.py). Not thread-safe on its own; used under the manager's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

from tierzero.config import Tier, format_size
from tierzero.placement.handles import TensorHandle
from tierzero.placement.tier_store import Buffer, TierStore


class EvictionPolicy(Protocol):
    def order(self, candidates: list[TensorHandle]) -> list[TensorHandle]:
        """Victims first, from the tensors with an evictable copy on the tier that needs room."""
        ...


class LeastRecentlyUsed:
    """The default policy: candidates arrive least recently used first, and are kept so."""

    def order(self, candidates: list[TensorHandle]) -> list[TensorHandle]:
        return list(candidates)

    def __repr__(self) -> str:
        return "LeastRecentlyUsed()"


class Shortfall(NamedTuple):
    """What a reservation lacked: room for `nbytes` on `tier`."""

    tier: Tier
    nbytes: int


class Room:
    """Reservations across the tiers of one PlacementManager (see the module docstring)."""

    def __init__(self, stores: Mapping[Tier, TierStore],
                 evictable: Callable[[TensorHandle, Tier], bool],
                 evict: Callable[[TensorHandle, Tier], None],
                 clean: Callable[[Tier, int], None],
                 buffer: Callable[[TensorHandle, Tier], Buffer],
                 unused: Callable[[TensorHandle, Tier], bool] = lambda h, t: False) -> None:
        self.stores = stores
        self.policy: EvictionPolicy = LeastRecentlyUsed()
        self._evictable = evictable
        self._evict = evict
        self._clean = clean
        self._buffer = buffer
        self._unused = unused
        self._lru: OrderedDict[tuple[TensorHandle, Tier], None] = OrderedDict()
        self._homes = dict.fromkeys(Tier, 0)

    # ------------------------------------------------------------------ cached copies and homes

    def cached(self, handle: TensorHandle, tier: Tier) -> None:
        """A cached copy appeared: the most recently used."""
        self._lru[(handle, tier)] = None

    def touch(self, handle: TensorHandle, tier: Tier) -> None:
        if (handle, tier) in self._lru:
            self._lru.move_to_end((handle, tier))

    def forget(self, handle: TensorHandle, tier: Tier) -> None:
        self._lru.pop((handle, tier), None)

    def cached_on(self, tier: Tier) -> list[TensorHandle]:
        """Tensors with a cached copy on `tier`, least recently used first."""
        return [h for (h, t) in self._lru if t is tier]

    def add_home(self, handle: TensorHandle) -> None:
        self._homes[handle.home] += self.stores[handle.home].reserved(handle.nbytes)

    def homed(self, tier: Tier) -> int:
        """Bytes of the tensors homed on `tier` (reserved there for their whole life)."""
        return self._homes[tier]

    def remove_home(self, handle: TensorHandle) -> None:
        self._homes[handle.home] -= self.stores[handle.home].reserved(handle.nbytes)

    # ------------------------------------------------------------------------------ reserving

    def check_fits(self, name: str, nbytes: int, tier: Tier, *, why: str = "") -> None:
        """ValueError when `nbytes` can never fit `tier` beside the tensors homed there."""
        need = self.stores[tier].reserved(nbytes)
        limit = self.stores[tier].budget.limit
        homes = self._homes[tier]
        if need <= limit - homes:
            return
        because = f" ({why})" if why else ""
        if need > limit:
            raise ValueError(
                f"tensor {name!r} ({nbytes} bytes) needs {format_size(need)} ({need} bytes) on the {tier.value} tier"
                f"{because} but the {tier.value} budget is {format_size(limit)} ({limit} bytes); raise "
                f"{tier.value}_budget to at least {need} bytes or split the tensor into smaller blocks")
        raise ValueError(
            f"tensor {name!r} ({nbytes} bytes) needs {format_size(need)} ({need} bytes) on the "
            f"{tier.value} tier{because} but tensors homed there already hold {format_size(homes)} of its "
            f"{format_size(limit)} budget; raise {tier.value}_budget or home some tensors on another tier")

    def check_working_set(self, what: str, handles: Sequence[TensorHandle],
                          extra: Sequence[tuple[Tier, int]] = ()) -> None:
        """ValueError when `handles` acquired on their staging tiers at once (plus `extra`
        buffers) can never fit beside the tensors homed there (PlacementManager.check_working_set)."""
        sizes: dict[Tier, list[int]] = {}
        for h in handles:
            if h.staging is not h.home:
                sizes.setdefault(h.staging, []).append(h.nbytes)
        for tier, nbytes in extra:
            sizes.setdefault(tier, []).append(nbytes)
        for tier, tier_sizes in sizes.items():
            limit, homed = self.stores[tier].budget.limit, self._homes[tier]
            nbytes = self.stores[tier].room_for(tier_sizes)
            if nbytes > limit - homed:
                names = ", ".join(h.name for h in handles if h.staging is tier and h.home is not tier)
                held = sum(self.stores[tier].reserved(n) for n in tier_sizes)
                windows = (f" (and {format_size(nbytes - held)} more: in the {tier.value} tier's one pinned region "
                           "the last one taken needs a free run of its size between the others, see [Note: working "
                           "set windows])") if nbytes > held else ""
                raise ValueError(
                    f"{what} holds {format_size(held)} on the {tier.value} tier at once ({names}){windows}, beside the "
                    f"{format_size(homed)} homed there, but the {tier.value} budget is {format_size(limit)}; "
                    f"raise {tier.value}_budget to at least {homed + nbytes} bytes, or split the model into "
                    "smaller blocks (Config.block_classes)")

    def take(self, needs: Sequence[tuple[Tier, int]], exclude: TensorHandle | None, *,
             speculative: bool = False, home: bool = False) -> list[Buffer] | Shortfall:
        """A buffer for every (tier, nbytes) in `needs`, evicting by policy (never a copy of
        `exclude`, the tensor the buffers are for); all or nothing. On a shortfall, dirty
        copies on the tier that fell short start being written back. A `speculative` need (a
        read further ahead) does neither that nor evict a prefetched copy not used yet: it
        never pushes out data still to be used. `home`: the first need is a tensor's home (it
        lives as long as the tensor)."""
        got: list[Buffer] = []
        for i, (tier, nbytes) in enumerate(needs):
            buf = self._alloc_evicting(tier, nbytes, exclude, speculative, home and i == 0)
            if buf is None:
                for (t, _), b in zip(needs, got):
                    self.stores[t].free(b)
                if not speculative:
                    self._clean(tier, nbytes)
                return Shortfall(tier, nbytes)
            got.append(buf)
        return got

    def _alloc_evicting(self, tier: Tier, nbytes: int, exclude: TensorHandle | None,
                        speculative: bool = False, home: bool = False) -> Buffer | None:
        store = self.stores[tier]
        buf = store.alloc(nbytes, home=home)
        if buf is not None:
            return buf
        candidates = [h for (h, t) in self._lru if t is tier and h is not exclude and self._evictable(h, tier)]
        if speculative:
            candidates = [h for h in candidates if not self._unused(h, tier)]
        allowed = set(candidates)
        victims = [h for h in self.policy.order(candidates) if h in allowed]
        # prefetched copies nobody has used yet go last, whatever the policy's order: evicting
        # one wastes the read just made. The prefetcher ranks tensors of no block first (its
        # trace knows only blocks), so the packs and optimizer states read ahead were pushed
        # out by the blocks' read-ahead and read again (built-in 350m, activations on NVMe:
        # packs read back 1.5-1.8x, copied to the device 1.6x; prefetching stalled more than
        # fetching on demand)
        victims.sort(key=lambda h: self._unused(h, tier))
        picks = store.victims(nbytes, [self._buffer(h, tier) for h in victims])
        if picks is not None:  # memory in one region: only a window of it serves
            victims = [victims[i] for i in picks]
        for victim in victims:
            if not self._evictable(victim, tier):
                continue
            self._evict(victim, tier)
            buf = store.alloc(nbytes, home=home)
            if buf is not None:
                return buf
        return None

    def __repr__(self) -> str:
        return f"Room(policy={self.policy!r}, cached={len(self._lru)}, homes={self._homes})"
