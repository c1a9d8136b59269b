"""One replay of a recorded iteration under a prefetch policy on a model of the tiers (`Replay`):
its clock, copies, workers and channels; `tier_model.simulate` runs and measures it."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import NamedTuple, Sequence

from tierzero.config import Tier
from tierzero.planning.recording import Background, Recording
from tierzero.planning.tier_rates import CHANNELS, COPY_WORKERS, TierModel
from tierzero.prefetch import BlockTimes, FetchPhase, PrefetchPolicy, PrefetchView, Unit, fitting, next_use_order


class Prediction(NamedTuple):
    stall_s: float
    """Predicted stall per step: block fetches waiting, plus the recorded other stalls."""
    step_s: float
    disk_s: float
    """Seconds the disk is busy per step."""
    copies: int
    """Device copies per step."""


# [Note: dirty host copies] The recorded host room at a fetch is the budget less what is used,
# plus the units' clean cached copies (the prefetcher's own count). The copies the step rewrote
# in host memory (`Recording.step_on_host`, an update that read the block's parameters) are dirty
# until written home: outside that room and not evictable. The replay holds them apart from the
# room until backward begins (the write-backs run beside the forward), and from then on counts
# them as cached copies: at each fetch it evicts cached copies, in the policy's victims order,
# while they exceed the room recorded there. In backward the gradients fill the host budget (the
# room falls to almost nothing over the last fetches), the recorded run's placement manager evicted the cached copies for them, and the last
# blocks were read from NVMe again; a replay that kept them predicted none of those reads, and
# about half the stall each policy measured. Where a
# fetch then finds no host room for its read's staging and no copy of the replay's is in flight to
# free some, the step's own buffers hold it.


class _Copy:
    __slots__ = ("ready", "pins", "used", "dirty")

    def __init__(self, ready: float, used: bool = False, dirty: bool = False) -> None:
        self.ready = ready
        self.pins = 0
        self.used = used
        """Fetched for, or read by, a block's compute (a speculative fetch evicts only these)."""
        self.dirty = dirty
        """A host copy the step rewrote, not written home yet: outside the recorded host room
        (which counts only clean cached copies) and not evictable. See [Note: dirty host copies]."""


# [Note: what the replay leaves out] Compute slowed down by copies and updates competing for the
# CPU or memory bandwidth (the update's CPU seconds are the recorded ones, under the recorded
# contention); the disk shared unevenly between concurrent reads; the updates' waits for host
# room and for write-backs (of their waits, only their reads are replayed).
# `tierzero tune` prints predictions beside measured figures so the model's error is visible.


class Replay:
    """The state of one replay: copies per tier, workers, channels, clock.

    How a policy is replayed (`simulate`): the recorded fetches in order, three iterations (the
    last one is measured, caches warm), the policy asked at every fetch with the same
    `PrefetchView` a real run gives it (rooms and cached tiers from the model; times: the model's),
    its plan clipped to the rooms as the prefetcher does, room taken before a move starts and made
    by evicting unpinned cached copies in the policy's `victims` order (for the units after a
    plan's first, only copies a block used already, as the prefetcher's speculative fetches); the
    background moves submitted when they happened. The host room at each fetch is the one recorded
    there (the rest of the host budget holds the step's gradients and optimizer states, which come
    and go over the iteration), and so is the device room: the recording's less what early
    capture's buffers and activations homed on the device took then (`Slot.device_beside`). At each
    step the device copies are dropped when the recorded step rewrote the parameters, and the units
    the step left on the host (`Recording.step_on_host`) are put there.
    A fetch whose copy is not there waits: that wait is the predicted stall. Stalls the recording
    saw outside block fetches are added as they were (no policy changes them).

    The overlapped step (`Recording.updates`) is replayed too, for it races the forward: each block's
    update reads its master, moments and gradient from NVMe (the reads start once the update before
    it has its own data, its read-ahead) through the same workers and disk as the policy's reads,
    starts when the one before it ends, and computes its recorded CPU seconds; a forward fetch of
    the block waits for it, and no policy prefetches a block before its update ends: the policy
    is asked again as each update ends, as the runtime asks it (StepContext.update_done). Where the
    updates pace the forward (350m: ~200 MB read and ~150 MB written per block update against
    ~0.2 s of compute), reading ahead competes with them.

    Activation packs homed on NVMe (`Recording.packs`) are replayed in backward as the runtime's
    activations store moves them: a block fetched ahead toward the device brings its pack where the
    device room left beside the blocks and the packs brought before allows, the next `nvme_depth`
    packs are read into host memory where it is free, and backward waits for each block's pack
    before its compute (on demand: its read and copy then). Their reads share the disk and workers
    with the blocks', their host copies and staging buffers the host room (a recording of on-demand
    fetching has none read ahead in its recorded room). On 350m with activations on NVMe this is
    most of what prefetching hides (fetching on demand: 1.0-1.2 s of pack waits per step; one block
    ahead: 0.1-0.4 s), so a recording's pack waits cannot be added as recorded.
    """

    def __init__(self, rec: Recording, policy: PrefetchPolicy, model: TierModel, workers: int, speedup: float,
                 nvme_depth: int) -> None:
        self.rec, self.policy, self.model, self.speedup = rec, policy, model, speedup
        self.trace = tuple(s.event for s in rec.slots)
        self.uses: dict[str, list[int]] = {}
        for i, ev in enumerate(self.trace):
            self.uses.setdefault(ev.unit, []).append(i)
        self.copies: dict[Tier, OrderedDict[str, _Copy]] = {Tier.DEVICE: OrderedDict(), Tier.HOST: OrderedDict()}
        self.staging: list[tuple[float, int]] = []
        """Host staging buffers of NVMe -> device moves: (freed at, bytes)."""
        self.unpins: list[tuple[float, _Copy]] = []
        """Host copies read by a device copy in flight: (unpinned at, copy)."""
        self.workers = [0.0] * max(1, workers)
        self.copiers = [0.0] * COPY_WORKERS
        self.free_at = dict.fromkeys(CHANNELS.values(), 0.0)
        self.now = 0.0
        self.pos = -1
        self.held: frozenset[str] = frozenset()
        self.disk: list[tuple[float, float]] = []
        """The disk's busy intervals (reads and writes overlap on it)."""
        self.device_copies = 0
        fetch = {}
        for name, u in rec.units.items():
            fetch[(name, Tier.DEVICE)] = model.leg_seconds("host", "device", u.nbytes) + model.overhead_s
            fetch[(name, Tier.HOST)] = model.leg_seconds("nvme", "host", u.nbytes) + model.overhead_s
        self.times = BlockTimes([s.compute_s / speedup for s in rec.slots], fetch)
        self.updates = rec.updates if all(u.block in rec.units for u in rec.updates) else []
        """The overlapped step's updates, replayed (else their recorded waits are added)."""
        self.update_of = {u.block: k for k, u in enumerate(self.updates)}
        n = len(self.updates)
        self.reads_at: list[float | None] = [None] * n
        """Per update: when its reads start (None: not known yet)."""
        self.read: list[float | None] = [None] * n
        """Per update: when its reads are done (None: not started yet)."""
        self.updated: dict[str, float] = {}
        """Per block of this iteration's updates: when its update ends, once the replay knows."""
        self.next_update = n
        self.update_wait = 0.0
        """This iteration's forward fetches' waits for their updates (since `step`)."""
        self.update_from = 0.0
        """When the next update may start (the one before it ended)."""
        self.packs = rec.packs if all(b in rec.units for b in rec.packs) else {}
        """Per block, its activation pack's bytes on NVMe, replayed (else their recorded waits are added)."""
        self.pack_order = [s.event.unit for s in rec.slots
                           if s.event.phase is FetchPhase.BACKWARD and s.event.unit in self.packs]
        self.nvme_depth = nvme_depth
        self.pack_copies: dict[Tier, dict[str, _Copy]] = {Tier.DEVICE: {}, Tier.HOST: {}}
        self.pack_done: set[str] = set()
        """This backward's packs acquired so far."""
        self.backward = False

    # ------------------------------------------------------------------------ rooms, views

    def cap(self, tier: Tier) -> int:
        slot = self.rec.slots[max(0, self.pos)]
        if tier is Tier.DEVICE:  # less what early capture and device-homed activations took then
            return self.rec.device_room - slot.device_beside
        room = slot.host_room
        return self.rec.host_room if room is None else room

    def used(self, tier: Tier) -> int:
        n = sum(self.rec.units[u].nbytes for u, c in self.copies[tier].items() if not c.dirty)
        packs = self.pack_copies[tier]  # not evicted: on their way to backward
        n += sum(self.packs[b] for b in packs)
        if tier is Tier.HOST:
            n += sum(b for t, b in self.staging if t > self.now)
        return n

    def room(self, tier: Tier) -> int:
        if tier is Tier.DEVICE:  # beside the held blocks and every pack there, as the runtime counts
            return self.cap(Tier.DEVICE) - sum(self.rec.units[u].nbytes for u in self.held) - sum(
                self.packs[b] for b in self.pack_copies[Tier.DEVICE])
        return self.cap(Tier.HOST) - sum(b for t, b in self.staging if t > self.now)

    def where(self, name: str) -> frozenset[Tier]:
        return frozenset(t for t in (Tier.DEVICE, Tier.HOST) if name in self.copies[t])

    def view(self) -> PrefetchView:
        return PrefetchView(self.trace, self.pos, self.rec.units, self.held, self.rec.wraps, self.times,
                            self.room, self.where, self.uses)

    # --------------------------------------------------------------------------------- moves

    def move(self, t: float, legs: Sequence[tuple[str, str, int]]) -> float:
        """Submit a move at `t`; when it is done."""
        pool = self.workers if any("nvme" in (src, dst) for src, dst, _ in legs) else self.copiers
        start = max(t, heapq.heappop(pool))
        for src, dst, nbytes in legs:
            ch = CHANNELS[(src, dst)]
            begin = max(start, self.free_at[ch])
            start = begin + self.model.leg_seconds(src, dst, nbytes)
            self.free_at[ch] = start
            if ch in ("read", "write"):
                self.disk.append((begin, start))
        done = start + self.model.overhead_s
        heapq.heappush(pool, done)
        return done

    def make_room(self, tier: Tier, nbytes: int, exclude: str, *, over: bool = False,
                  speculative: bool = False) -> bool:
        cap = self.cap(tier)
        if over or self.used(tier) + nbytes <= cap:
            return True
        copies = self.copies[tier]
        candidates = [n for n, c in copies.items() if n != exclude and c.pins == 0 and c.ready <= self.now
                      and not c.dirty and n not in (self.held if tier is Tier.DEVICE else ())
                      and (c.used or not speculative)]
        view = self.view()
        if speculative:  # nor copies used before the unit it brings, as the prefetcher's order
            due = view.next_use(exclude)
            candidates = [n for n in candidates if due is None or (d := view.next_use(n)) is None or d > due]
        victims = getattr(self.policy, "victims", None)
        order = list(victims(view, candidates) if callable(victims) else next_use_order(view, candidates))
        order += [n for n in candidates if n not in order]
        for name in order:
            if name in candidates and name in copies:
                del copies[name]
                if self.used(tier) + nbytes <= cap:
                    return True
        return False

    def fetch(self, name: str, tier: Tier, *, over: bool = False, speculative: bool = False) -> bool:
        """Start a copy of the unit toward `tier` now if there is room (`over`: regardless;
        `speculative`: evicting only copies used already); True if it is there or on its way."""
        unit = self.rec.units[name]
        copies = self.copies[tier]
        if name in copies:
            copies.move_to_end(name)
            return True
        if not self.make_room(tier, unit.nbytes, name, over=over, speculative=speculative):
            return False
        host = self.copies[Tier.HOST].get(name)
        if tier is Tier.HOST:
            done = self.move(self.now, [("nvme", "host", unit.nbytes)])
        elif host is not None:
            host.pins += 1
            host.used = True
            done = self.move(max(self.now, host.ready), [("host", "device", unit.nbytes)])
            self.unpins.append((done, host))
        elif unit.nvme:  # through a host staging buffer, reserved as a copy's room is
            if not self.make_room(Tier.HOST, unit.nbytes, name, over=over, speculative=speculative):
                return False
            done = self.move(self.now, [("nvme", "host", unit.nbytes), ("host", "device", unit.nbytes)])
            self.staging.append((done, unit.nbytes))
        else:
            done = self.move(self.now, [("host", "device", unit.nbytes)])
        if tier is Tier.DEVICE:
            self.device_copies += 1
        copies[name] = _Copy(done)
        return True

    def settle(self) -> None:
        """Unpin host copies whose device copy is done, forget finished staging."""
        keep = []
        for t, copy in self.unpins:
            if t <= self.now:
                copy.pins -= 1
            else:
                keep.append((t, copy))
        self.unpins = keep
        self.staging = [(t, b) for t, b in self.staging if t > self.now]

    def fit_host(self) -> None:
        """Evict clean host copies (in the policy's victims order) while they exceed the host room
        recorded now: the room the step's gradients and states took from cached copies in the
        recorded run, as its placement manager evicted them (see [Note: dirty host copies])."""
        if self.used(Tier.HOST) > self.cap(Tier.HOST):
            self.make_room(Tier.HOST, 0, "")

    # -------------------------------------------------------------------- activation packs

    def plan_packs(self, units: Sequence[Unit]) -> None:
        """Backward's packs, as the runtime's activations store moves them when blocks are
        fetched ahead: the packs of those blocks toward the device where the room left beside
        them allows, the next `nvme_depth` others read into host memory."""
        names = {u.name for u in units}
        device = self.pack_copies[Tier.DEVICE]
        room = self.room(Tier.DEVICE) - sum(u.nbytes for u in units)  # (beside the packs brought earlier)
        ahead = 0
        for block in self.pack_order:
            if block in self.pack_done:
                continue
            if block in names and block not in device and self.packs[block] <= room:
                self.fetch_pack(block, Tier.DEVICE)
                room -= self.packs[block]
            elif ahead < self.nvme_depth and block not in device:
                ahead += 1
                self.fetch_pack(block, Tier.HOST)

    def fetch_pack(self, block: str, tier: Tier, *, need: bool = False) -> _Copy | None:
        """Start a copy of the block's pack toward `tier` unless one is there or on its way (that
        copy; None: no room): to the host, an NVMe read into free host room (speculative: it
        evicts nothing); to the device, a copy from its host copy, else a read staged through
        host room, made as a block fetch makes it (`need`, backward's own acquire: regardless)."""
        nbytes = self.packs[block]
        device, host = self.pack_copies[Tier.DEVICE], self.pack_copies[Tier.HOST]
        if block in device or tier is Tier.HOST and block in host:
            return device.get(block) or host[block]
        if tier is Tier.HOST:
            if self.used(Tier.HOST) + nbytes > self.cap(Tier.HOST):
                return None
            host[block] = _Copy(self.move(self.now, [("nvme", "host", nbytes)]))
            return host[block]
        there = host.pop(block, None)
        if there is not None:
            done = self.move(max(self.now, there.ready), [("host", "device", nbytes)])
        elif self.make_room(Tier.HOST, nbytes, block, over=need):
            done = self.move(self.now, [("nvme", "host", nbytes), ("host", "device", nbytes)])
            self.staging.append((done, nbytes))
        else:
            return None
        device[block] = _Copy(done)
        return device[block]

    # --------------------------------------------------------------- the overlapped step

    def step(self) -> None:
        """The optimizer step, now: its updates queued, one after another (`advance`)."""
        self.updated.clear()
        self.update_wait = 0.0
        self.next_update = 0
        self.update_from = self.now
        self.reads_at = [self.now] + [None] * (len(self.updates) - 1) if self.updates else []
        self.read = [None] * len(self.updates)

    def advance(self, until: float) -> None:
        """Replay the updates as far as their reads start by `until`. The first update's reads
        start with the step; once an update has its data, it starts the reads of the next
        `update_read_ahead` updates (those not started yet), which compete for workers and the
        disk with everything else. An update starts once the one before it ended and computes
        on the CPU once its data is there (its recorded seconds: compute speedups are the
        device's)."""
        ahead = max(1, self.rec.update_read_ahead)
        while True:
            for j, at in enumerate(self.reads_at):
                if at is not None and at <= until and self.read[j] is None:
                    self.read[j] = max([self.move(at, [("nvme", "host", leg.nbytes)]) for leg in self.updates[j].reads],
                                       default=at)
            k = self.next_update
            if k >= len(self.updates) or self.read[k] is None:
                return
            data = max(self.update_from, self.read[k])
            block = self.updates[k].block
            self.updated[block] = self.update_from = data + self.updates[k].cpu_s
            if block in self.rec.step_on_host or self.updates[k].leaves_on_host:  # it rewrote its host copy
                self.copies[Tier.HOST].pop(block, None)
                self.copies[Tier.HOST][block] = _Copy(self.update_from, used=True, dirty=True)
            for j in range(k + 1, min(k + 1 + ahead, len(self.updates))):
                if self.reads_at[j] is None:
                    self.reads_at[j] = data
            self.next_update += 1

    def updating(self, name: str) -> bool:
        """The unit's update is queued or running (it is not prefetched yet, as the prefetcher
        does not)."""
        k = self.update_of.get(name)
        return k is not None and (k >= self.next_update or self.updated[name] > self.now)

    def replan_at_update_ends(self, end: float) -> None:
        """The policy asked again as each update ends before `end` (the runtime's
        StepContext.update_done): a block of the plan that was updating at the fetch is brought
        then."""
        if not self.updates or self.backward:
            return
        self.advance(end)
        for t in sorted(t for t in self.updated.values() if self.now < t < end):
            self.now = t
            self.settle()
            self.plan()

    def wait_update(self, name: str) -> None:
        """A forward fetch waits for its block's update."""
        while name not in self.updated and self.next_update < len(self.updates):
            at = self.reads_at[self.next_update]  # known: the update before it set it
            assert at is not None
            self.advance(at)
        self.now = max(self.now, self.updated.get(name, 0.0))

    # ----------------------------------------------------------------------------- the step

    def plan(self) -> None:
        device: list[Unit] = []
        host: list[Unit] = []
        for f in self.policy.plan(self.view()):
            unit, tier = self.rec.units[f[0]], Tier(f[1])
            chosen = device if tier is Tier.DEVICE else host
            if unit.name not in self.held and unit not in chosen and not self.updating(unit.name):
                chosen.append(unit)
        fitting_units = fitting(device, self.room(Tier.DEVICE))
        for i, u in enumerate(fitting_units):  # the first for sure, the rest speculatively, as the prefetcher
            self.fetch(u.name, Tier.DEVICE, speculative=i > 0)
        if self.backward and self.packs:
            self.plan_packs(fitting_units)
        host = [u for u in host if u.nvme and (u not in fitting_units or Tier.HOST in self.where(u.name))]
        room = self.room(Tier.HOST)  # free bytes and the units' host copies, as the prefetcher counts
        for k, u in enumerate(host):
            if u.nbytes > room:
                break
            room -= u.nbytes
            self.fetch(u.name, Tier.HOST, speculative=k > 0 or self.view().next_use(u.name) != 1)

    def iteration(self, background: dict[int, list[Background]]) -> float:
        """One iteration from now; its block stall seconds."""
        if self.rec.step_invalidates:  # the step rewrote the parameters: no old device copy is valid
            self.copies[Tier.DEVICE].clear()
        host = self.copies[Tier.HOST]
        for name in self.rec.step_on_host:  # the step's update left them there, newest last
            host.pop(name, None)
            if name not in self.update_of:  # else when its update ends (`advance`)
                host[name] = _Copy(self.now, used=True, dirty=True)
        self.step()
        self.backward = False
        self.pack_done.clear()
        for copies in self.pack_copies.values():
            copies.clear()
        stall = 0.0
        pending = []
        for pos, slot in enumerate(self.rec.slots):
            self.pos = pos
            if not self.backward and slot.event.phase is FetchPhase.BACKWARD:
                self.backward = True
                for copy in self.copies[Tier.HOST].values():  # written home by now
                    copy.dirty = False
            self.held = frozenset(slot.held) | {slot.event.unit}
            self.advance(self.now)
            for t, b in pending:  # background legs due by now, at their own times
                if t <= self.now:
                    self.move(t, [(b.leg.src, b.leg.dst, b.leg.nbytes)])
            pending = [(t, b) for t, b in pending if t > self.now]
            self.settle()
            self.fit_host()
            self.plan()
            name = slot.event.unit
            start = self.now
            if slot.event.phase is FetchPhase.FORWARD and self.updates:
                self.wait_update(name)
                self.update_wait += self.now - start
                self.settle()
            while not self.fetch(name, Tier.DEVICE):  # no room: wait for a copy in flight to land
                later = [c.ready for t in self.copies.values() for c in t.values() if c.ready > self.now]
                later += [t for t, _ in self.staging if t > self.now]
                if not later:  # the room is held by the step's own buffers, not by copies: the
                    # recorded run found it when they went, at a wait the recorded room waits
                    # hold (added to every slot: [Note: waits for room no schedule removes])
                    self.fetch(name, Tier.DEVICE, over=True)
                    break
                self.now = min(later)
                self.settle()
            self.now = max(self.now, self.copies[Tier.DEVICE][name].ready)
            self.copies[Tier.DEVICE][name].used = True
            if self.backward and name in self.packs:  # its pack, for backward's compute
                pack = self.fetch_pack(name, Tier.DEVICE, need=True)
                assert pack is not None
                self.now = max(self.now, pack.ready)
                self.pack_done.add(name)
            stall += self.now - start
            pending += [(start + b.offset_s / self.speedup, b) for b in background.get(pos, ())]
            end = self.now + (slot.compute_s / self.speedup + slot.other_stall_s + slot.room_s
                              + (0.0 if self.updates else slot.update_s) + (0.0 if self.packs else slot.pack_s))
            self.replan_at_update_ends(end)
            self.now = end
            self.pack_copies[Tier.DEVICE].pop(name, None)  # freed after the block's backward
        self.advance(float("inf"))
        for t, b in pending:
            self.move(t, [(b.leg.src, b.leg.dst, b.leg.nbytes)])
        return stall




__all__ = ["Prediction", "Replay"]
