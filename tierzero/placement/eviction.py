"""Room on the tiers: reservations taken all or nothing, evicting cached copies by policy, and
writing dirty ones home when a tier falls short.

`Room` is what the ResidencyTable asks for the buffers of a move. For each (tier, nbytes) it
needs, the tier's store allocates within the budget; when it has no room, unpinned clean
cached copies there are offered to the `EvictionPolicy` and evicted until the buffer fits. If
one need cannot be met, the buffers taken for the others go back and the answer is a
`Shortfall`, so no reservation is ever held while waiting for another; dirty copies on the
tier that fell short start being written home (`clean`), to be evictable once written. Room
keeps no residency: it reads the records' states (never writes them) and is told which copies
exist. Used under the table's lock; what a user reaches as `PlacementManager.room` (the policy,
trim, check_working_set) takes it.
"""

from __future__ import annotations

import threading
from typing import Collection, Literal, Mapping, NamedTuple, Protocol, Sequence

from tierzero.config import Tier, format_size
from tierzero.placement.handles import TensorHandle
from tierzero.placement.executor import MoveTable
from tierzero.placement.records import Content, Residency, TensorRecord
from tierzero.placement.storage.tier_store import Buffer, TierStore


class EvictionPolicy(Protocol):
    def order(self, candidates: list[TensorHandle]) -> list[TensorHandle]:
        """Victims first, from the tensors with an evictable copy on the tier that needs room."""
        ...


class CachedCopies(Protocol):
    """What Room asks of the cached copies (the ResidencyTable, under the lock)."""

    index: Mapping[TensorHandle, TensorRecord]
    """Every record: Room reads their states (never writes them)."""
    recency: Mapping[tuple[TensorHandle, Tier], None]
    """The cached copies, least recently used first."""
    moves: MoveTable

    def free(self, h: TensorHandle, tier: Tier) -> None:
        """Evict it (its free transition)."""
        ...

    def write_back(self, h: TensorHandle, tier: Tier) -> bool:
        """Start writing the copy home if it is dirty, unpinned and resident; whether it started."""
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

    def __init__(self, stores: Mapping[Tier, TierStore], copies: CachedCopies, cond: threading.Condition) -> None:
        self.stores = stores
        self._policy: EvictionPolicy = LeastRecentlyUsed()
        self._cond = cond
        self._copies = copies
        self._homes = dict.fromkeys(Tier, 0)

    # ------------------------------------------------------------- what a user may set or ask

    @property
    def policy(self) -> EvictionPolicy:
        """Chooses victims: `policy.order(candidates)` (handles, least recently used first)."""
        return self._policy

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        if not callable(getattr(policy, "order", None)):
            raise ValueError(f"eviction policy: expected an object with order(candidates), got {policy!r}")
        with self._cond:
            self._policy = policy

    def trim(self, tier: Tier, sizes: Collection[int]) -> int:
        """Give back the free buffers `tier`'s pool caches for requests of `sizes` bytes (a
        HostPool's: the device tier on the CPU, the host tier without CUDA; memory the system
        gets back) and return their bytes: for sizes the caller knows nobody asks for soon."""
        with self._cond:
            freed = self.stores[Tier.parse(tier)].trim(sizes)
            self._cond.notify_all()
        return freed

    def check_staging(self) -> None:
        """ValueError when an NVMe-homed tensor's host staging buffer can never fit beside the
        tensors now homed on the host tier: its first fetch would wait for room nothing can make.
        (register() checks each tensor against the homes registered before it; call this once
        the homes are all there: at the end of wrap, and of an optimizer's construction.)"""
        with self._cond:
            for rec in self._copies.index.values():
                if rec.home is Tier.NVME:
                    self.check_fits(rec.name, rec.nbytes, Tier.HOST,
                                    why="NVMe-homed tensors are staged through host memory")

    # ------------------------------------------------------------------ cached copies and homes

    def cached_on(self, tier: Tier) -> list[TensorHandle]:
        """Tensors with a cached copy on `tier`, least recently used first."""
        return [h for (h, t) in self._copies.recency if t is tier]

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
        buffers) can never fit beside the tensors homed there: checked at construction by a
        caller that holds them together (an optimizer's update of one block), not at its first step."""
        with self._cond:
            self._check_working_set(what, handles, extra)

    def _check_working_set(self, what: str, handles: Sequence[TensorHandle],
                           extra: Sequence[tuple[Tier, int]]) -> None:
        sizes: dict[Tier, list[int]] = {}
        for h in handles:
            if h.staging is not h.home:
                sizes.setdefault(h.staging, []).append(h.nbytes)
        for tier, nbytes in extra:
            sizes.setdefault(tier, []).append(nbytes)
        for tier, tier_sizes in sizes.items():
            limit, homed = self.stores[tier].budget.limit, self._homes[tier]
            nbytes = self.stores[tier].bytes_for(tier_sizes)
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
                    self.clean(tier, nbytes)
                return Shortfall(tier, nbytes)
            got.append(buf)
        return got

    def _alloc_evicting(self, tier: Tier, nbytes: int, exclude: TensorHandle | None,
                        speculative: bool = False, home: bool = False) -> Buffer | None:
        store = self.stores[tier]
        buf = store.alloc(nbytes, home=home)
        if buf is not None:
            return buf
        index = self._copies.index
        candidates = [h for (h, t) in self._copies.recency if t is tier and h is not exclude
                      and _evictable(index[h], tier)]
        if speculative:
            candidates = [h for h in candidates if index[h]._copies[tier].used]
        allowed = set(candidates)
        victims = [h for h in self.policy.order(candidates) if h in allowed]
        # prefetched copies nobody has used yet go last, whatever the policy's order: evicting
        # one wastes the read just made. The prefetcher ranks tensors of no block first (its
        # trace knows only blocks), so the packs and optimizer states read ahead were pushed
        # out by the blocks' read-ahead and read again (built-in 350m, activations on NVMe:
        # packs read back 1.5-1.8x, copied to the device 1.6x; prefetching stalled more than
        # fetching on demand)
        victims.sort(key=lambda h: not index[h]._copies[tier].used)
        picks = store.victims(nbytes, [index[h]._copies[tier].buffer for h in victims])
        if picks is not None:  # memory in one region: only a window of it serves
            victims = [victims[i] for i in picks]
        for victim in victims:
            if not _evictable(index[victim], tier):
                continue
            self._copies.free(victim, tier)
            buf = store.alloc(nbytes, home=home)
            if buf is not None:
                return buf
        return None

    # -------------------------------------------------------------------- dirty copies

    def clean(self, tier: Tier, nbytes: int) -> None:
        """Room on `tier` fell `nbytes` short: start writing back unpinned dirty copies there,
        least recently used first, until that many bytes are on their way to becoming
        evictable (counting those already being written back). On a tier whose memory is one
        region only a window of `nbytes` serves: see [Note: cleaning a window]."""
        if self._clean_window(tier, nbytes):
            return
        coming = sum(self.stores[tier].reserved(m.nbytes) for m in self._copies.moves.all()
                     if m.src is tier and m.dst is m.tensor.home)
        for h in self.cached_on(tier):
            if coming >= nbytes:
                return
            if self._copies.write_back(h, tier):
                coming += self.stores[tier].reserved(h.nbytes)

    # [Note: cleaning a window]
    # On a tier of one region ([Note: arena windows] in tiers.py), writing back the least
    # recently used dirty copies until `nbytes` are on their way frees bytes that need not lie
    # together: each copy written may sit between copies that stay, the request still finds no
    # window when they land, and the next shortfall writes more (on a 1.3 B model with a 4 GiB
    # host tier, gradients were written home and read back 0.7-1.2 bytes per parameter more
    # than with a pool of separate buffers). So the window is chosen among the unpinned copies
    # that are clean (they cannot open one: the room would have evicted them), being written
    # back, then dirty, each group least recently used first: the window with the least recent
    # latest member, so the fewest and oldest dirty copies are written.

    def _clean_window(self, tier: Tier, nbytes: int) -> bool:
        """`clean` on a tier of one region; False where the tier has no windows or none serves."""
        groups: dict[str, list[TensorHandle]] = {"clean": [], "writing": [], "dirty": []}
        index = self._copies.index
        for h in self.cached_on(tier):
            state = _cleaning(index[h], tier)
            if state is not None:
                groups[state].append(h)
        order = groups["clean"] + groups["writing"] + groups["dirty"]
        picks = self.stores[tier].victims(nbytes, [index[h]._copies[tier].buffer for h in order])
        if not picks:  # None: any bytes serve; []: pinned copies block every window
            return False
        if max(picks) < len(groups["clean"]):
            return False  # clean copies alone open it: not what a shortfall asks here
        for i in picks:
            self._copies.write_back(order[i], tier)
        return True

    def __repr__(self) -> str:
        return f"Room(policy={self.policy!r}, cached={len(self._copies.recency)}, homes={self._homes})"


def _evictable(rec: TensorRecord, tier: Tier) -> bool:
    """Resident, unpinned and not dirty: dropping it loses nothing."""
    copy = rec._copies[tier]
    return rec._residency[tier] is Residency.RESIDENT and copy.pins == 0 and copy.content is not Content.DIRTY


def _cleaning(rec: TensorRecord, tier: Tier) -> Literal["clean", "writing", "dirty"] | None:
    """What writing back the unpinned copy on `tier` would do: nothing ("clean"), it is being
    written ("writing"), start a write ("dirty"); None where it is pinned or fetching."""
    copy, state = rec._copies[tier], rec._residency[tier]
    if state is Residency.WRITING_BACK:
        return "writing"
    if state is Residency.RESIDENT and copy.pins == 0:
        return "dirty" if copy.content is Content.DIRTY else "clean"
    return None
