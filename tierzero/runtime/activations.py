"""Saved activations on a tier (Config.activations): what autograd saves inside a block call,
packed into one placed tensor per call, written during forward, fetched back before backward.
The packs themselves: activation_pack.py."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
import time
import warnings
from typing import Any, Sequence

import torch

from tierzero.config import Config, Tier, format_size
from tierzero.layout import ROOT
from tierzero.placement import ACTIVATIONS_TRACK, Kind, Residency
from tierzero.prefetch import Unit
from tierzero.runtime.activation_pack import ActivationPack, PackState, SavedTensors
from tierzero.runtime.step.step_context import StepContext

MAX_UNWRITTEN = 2
"""Sealed packs the writer may be behind by before a forward waits for it (their device
tensors stay alive until written)."""

TRACK = ACTIVATIONS_TRACK
"""The Chrome trace track of activation writes and of waits for activations (the tier model
reads backward's "fetch" spans: planning/recording.py)."""


# [Note: placed activations]
# During the root module's forward the saved-tensor hooks (activation_pack.SavedTensors) hand every
# tensor autograd saves to the innermost block call running, its *scope*. Views of parameters
# stay references into the block ([Note: saved parameter views]); the rest are the call's
# activations. An `ActivationPack` gathers them, one segment per storage they view
# (tierzero.layout.PackLayout), and gives autograd a small `SavedActivation` record instead of
# each tensor. At the block's post-forward the pack is sealed: one tensor of Kind.ACTIVATION (its
# bytes) is registered with the placement manager, homed on the tier Config.activations names
# ("auto": the device while it fits the room the blocks leave, else host, else NVMe), and the
# writer thread copies the segments into it (device tensors on the copy stream; an NVMe home
# through a host copy, which stays cached while the host budget allows) and drops the
# originals, whose device memory is then free. Compute goes on meanwhile; a forward more than
# `MAX_UNWRITTEN` packs ahead of the writer waits for it.
#
# Backward: when the prefetcher starts a block's fetch ahead of its backward (the policy's choice,
# from the recorded trace), the block's pending pack is copied to the device too, within the
# device room, and NVMe-homed packs further back are read into host memory (`prefetch`); a pack
# the writer has not finished yet is copied by the writer as soon as it has. The first
# unpack acquires the device copy (waiting if it is not there yet) and each tensor comes back as a
# view into it with its own strides. A pack is freed (copy released, tensor unregistered) when
# autograd drops its last record, at the block call's post-backward, or at the end of backward,
# whichever comes first; the placement work is done at the next safe point (`collect`), never in
# a finalizer, which may run on any thread at any time. At the end of backward the device tier
# gives back the free buffers it cached for the packs' sizes: nothing asks the device for those
# again before the next forward's last blocks, and kept they would hold device room (and, with the
# device on the CPU, the process's memory) through the forward. (The host tier keeps its own: the
# next forward's packs are written through them.)
#
# Tensors saved outside every block (the loss head's), tensors of another device or layout, and
# all of them under activations="device" stay as autograd made them; every one is counted
# (StepStats.activation_bytes), so "device" is today's behaviour, measured.


class Activations:
    """The placed activations of one wrapped model: the scopes of the running block calls, the
    packs waiting for backward, the writer thread (see [Note: placed activations])."""

    def __init__(self, ctx: StepContext, config: Config, *, root_bytes: int, largest_block: int) -> None:
        self.ctx = ctx
        self.pm = ctx.pm
        self.mode = config.activations
        self.checkpointing = config.activation_checkpointing
        self.nvme_depth = config.prefetch.nvme_depth
        self.device = ctx.pm.device
        self.root_bytes = root_bytes
        self.largest_block = largest_block
        self.dead: collections.deque[ActivationPack] = collections.deque()
        """Packs given up whose placement is still to undo (appended from any thread)."""
        self._pending: list[ActivationPack] = []
        """Placed packs not yet freed, in the order they were sealed."""
        self._unwritten: collections.deque[cf.Future[None]] = collections.deque()
        self._writer: cf.ThreadPoolExecutor | None = None
        self._count = 0
        self._sizes: list[int] = []
        """This iteration's placed packs' bytes, in seal order (auto plans the next from them)."""
        self._keep_from: int | None = None
        """auto: packs from this index on in seal order stay on the device (None: not planned)."""
        self._warned = False
        self._backward = False
        """The forward is over: its packs are read back ahead (see `prefetch`)."""
        self.lock = threading.Lock()
        """Orders a pack's `landed` (the writer) against `wanted` (the prefetcher)."""
        self.saved = SavedTensors(self, ctx.copies, ctx.compute_dtype)
        """The saved-tensor hooks of the root's forward and the scopes of its block calls."""
        if self.placed:
            ctx.account.ahead = self.bytes_ahead

    @property
    def placed(self) -> bool:
        return self.mode != "device"

    # ---------------------------------------------------------------------------- scopes

    def note_own_checkpointing(self, block: str) -> None:
        """The model checkpoints `block` itself (transformers' gradient checkpointing): torch's
        hooks then take what the block saves, and its input stays on the device."""
        if self._warned or not (self.placed or self.checkpointing):
            return
        self._warned = True
        warnings.warn(
            f"tierzero: the model checkpoints its own layers ({block!r} has gradient_checkpointing=True), so "
            "torch.utils.checkpoint keeps each layer's input on the device and recomputes the rest: Config."
            f"activations={self.mode!r} / activation_checkpointing={self.checkpointing} place nothing inside them. "
            "Turn the model's off (transformers: model.activation_checkpointing_disable()) and use "
            "Config(activation_checkpointing=True) to keep only each block's input, placed per Config.activations",
            stacklevel=3)

    def new_pack(self, block: str) -> ActivationPack:
        return ActivationPack(self, block, placed=self.placed)

    def begin_iteration(self) -> None:
        """A root forward with grad starts: plan auto's placement from the last iteration."""
        self.collect()
        self.saved.begin()
        self._backward = False
        if self._sizes:
            self._keep_from = None if self.mode != "auto" else self._plan(self._sizes)
        self._sizes = []

    def end_forward(self) -> None:
        """The root forward is over (or raised): count what it saved outside the blocks; packs
        of block calls a raise left open are dropped."""
        self.pm.recorder.record_activations(Tier.DEVICE, self.saved.end_forward())
        self._backward = True

    # ------------------------------------------------------------------------ placement

    def seal(self, pack: ActivationPack) -> None:
        """A block call's forward ended: OPEN -> SEALED, its pack placed on its tier and written
        (only counted, on the device, when nothing of it is placed)."""
        assert pack.state is PackState.OPEN, pack
        self._raise_failed_writes()
        nbytes = pack.finish()
        if pack.placed and pack.entries:
            self.place(pack, self._home(pack))
        else:
            pack.drop_storages()
            self.pm.recorder.record_activations(Tier.DEVICE, nbytes)
        pack.state = PackState.SEALED

    def _home(self, pack: ActivationPack) -> Tier:
        nbytes = pack.nbytes
        self._check_device_fits(pack)
        # room for the blocks coming next and for one pack coming back in backward
        fits = nbytes <= self.ctx.account.free_bytes() - 2 * self.largest_block - nbytes
        prefetcher = self.ctx.prefetcher
        upcoming = [u for u in prefetcher.next_units(2) if u != ROOT][:1] if prefetcher is not None else []
        if fits and upcoming == [pack.block]:
            return Tier.DEVICE  # the trace says the block's backward comes next: it would come right back
        if self.mode != "auto":
            return Tier(self.mode)
        if fits and (self._keep_from is None or len(self._sizes) >= self._keep_from):
            return Tier.DEVICE
        free = self.pm.host_room()
        if nbytes <= free:
            return Tier.HOST
        return Tier.NVME if self.pm.config.nvme_dir is not None else Tier.HOST

    def _plan(self, sizes: list[int]) -> int:
        """auto: the first pack (in seal order) of the longest run at the end that `_home` will
        keep on the device when it comes (beside the root, the block held and two coming, and
        one pack coming back), planned before a forward: the packs backward needs first stay."""
        room = self.ctx.account.free_bytes() - self.root_bytes - 3 * self.largest_block - max(sizes)
        keep = len(sizes)
        while keep > 0 and sizes[keep - 1] <= room:
            keep -= 1
            room -= sizes[keep]
        return keep

    def _check_device_fits(self, pack: ActivationPack) -> None:
        """ValueError when the pack can never be on the device beside the root block and its
        own block, as its backward needs."""
        room = self.pm.budget(Tier.DEVICE) - self.ctx.account.homes
        need = pack.nbytes + self.root_bytes + self.largest_block
        if need > room:
            raise ValueError(
                f"the activations that block {pack.block!r} saved take {format_size(pack.nbytes)} ({pack.nbytes} "
                f"bytes); its backward needs them on the device beside the root block and the block itself: "
                f"{format_size(need)} ({need} bytes), but the device budget leaves {format_size(room)} beside the "
                f"tensors homed there; raise device_budget to at least {need + self.pm.budget(Tier.DEVICE) - room} "
                "bytes, use Config(activation_checkpointing=True) (only the block's input is kept), or a smaller "
                "batch x sequence")

    def place(self, pack: ActivationPack, home: Tier) -> None:
        """Register the sealed pack's bytes on `home` and have the writer fill them."""
        self._count += 1
        meta = torch.empty(pack.nbytes, dtype=torch.uint8, device="meta")
        handle = None
        try:
            handle = self.pm.register(f"{pack.block}@{self._count}", meta, home, kind=Kind.ACTIVATION)
            if home is Tier.NVME:
                self.pm.room.check_working_set(f"writing the activations of {pack.block!r}", [handle])
        except ValueError as e:
            if handle is not None:
                self.pm.unregister(handle)
            raise ValueError(f"{e} (activations placed on {home.value}; Config.activations={self.mode!r}: "
                             "activation_checkpointing=True keeps only each block's input, and a smaller "
                             "batch x sequence less)") from e
        pack.handle = handle
        if home is Tier.DEVICE:
            self.ctx.account.add_activations(pack.nbytes, home=True)
        self._sizes.append(pack.nbytes)
        self._pending.append(pack)
        self.pm.recorder.record_activations(home, pack.nbytes)
        while len(self._unwritten) >= MAX_UNWRITTEN:
            self._wait(self._unwritten.popleft(), f"write {pack.block}")
        if self._writer is None:
            self._writer = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tierzero-act-r{self.ctx.rank}")
        ready = self.pm.copies.compute_ready()  # the forward's work that made the tensors
        pack.written = self._writer.submit(self._write, pack, pack.pieces(), ready)
        self._unwritten.append(pack.written)

    def _write(self, pack: ActivationPack, pieces: list[tuple[int, torch.Tensor]], ready: Any) -> None:
        """The writer thread: copy the segments into the home (an NVMe home through a fresh host
        copy, written home by the release), drop them, then start the copy to the device the
        prefetcher asked for meanwhile (within this job: whoever waits for the write finds it
        on its way)."""
        handle = pack.handle
        assert handle is not None
        tier = Tier.HOST if handle.home is Tier.NVME else handle.home
        dst = self.pm.acquire(handle, tier, overwrite=handle.home is Tier.NVME)
        done = False
        try:
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"tierzero::save_activations {handle.name}"):
                if tier is Tier.DEVICE:  # device to device: on this thread's stream, after the forward's work
                    self.pm.copies.compute_wait(ready, dst)
                    for o, src in pieces:
                        dst[o:o + src.numel()].copy_(src)
                    events = [self.pm.copies.compute_ready()]
                else:
                    events = [self.pm.copies.copy(dst[o:o + src.numel()], src, after=ready) for o, src in pieces]
                for event in events:
                    event.synchronize()
            t1 = time.perf_counter()
            if tier is not Tier.DEVICE:  # a copy within the device moves nothing between tiers
                self.pm.recorder.record_move(handle.name, str(Tier.DEVICE), str(tier), handle.nbytes, t0, t1)
            self.pm.recorder.record_span(TRACK, f"save {handle.owner}", t0, t1,
                                          {"bytes": handle.nbytes, "tier": handle.home.value})
            done = True
        finally:
            pieces.clear()
            self.pm.release(handle, tier, dirty=done)
        with self.lock:
            pack.landed = True
            wanted = pack.wanted
        if wanted and pack.state is PackState.SEALED:
            self.pm.prefetch(handle, Tier.DEVICE)

    def acquire(self, pack: ActivationPack) -> torch.Tensor:
        """The pack's device copy for backward, pinned until the pack is freed."""
        self.collect()
        assert pack.handle is not None and pack.written is not None, pack
        t0 = time.perf_counter()
        self._wait(pack.written, f"write {pack.block}", record=False)
        ahead = self.pm.record(pack.handle).residency[Tier.DEVICE] is not Residency.ABSENT
        copy = self.pm.acquire(pack.handle, Tier.DEVICE)
        pack.acquired = True
        if pack.handle.home is not Tier.DEVICE:
            self.ctx.account.add_activations(pack.nbytes)
        waited = time.perf_counter() - t0
        self.pm.recorder.record_activation_stall(waited)
        self.pm.recorder.record_span(TRACK, f"fetch {pack.block}", t0, t0 + waited,
                                      {"bytes": pack.nbytes, "stall_s": waited, "tier": pack.handle.home.value,
                                       "ahead": ahead})
        return copy

    def _wait(self, future: cf.Future[None], what: str, *, record: bool = True) -> None:
        t0 = time.perf_counter()
        future.result()
        if record and (waited := time.perf_counter() - t0) > 0:
            self.pm.recorder.record_activation_stall(waited)
            self.pm.recorder.record_span(TRACK, f"wait {what}", t0, t0 + waited, {"stall_s": waited})

    def _raise_failed_writes(self) -> None:
        while self._unwritten and self._unwritten[0].done():
            self._unwritten.popleft().result()

    # ------------------------------------------------------------------------- backward

    def prefetch(self, units: Sequence[Unit]) -> None:
        """The prefetcher started fetching `units` ahead: copy their pending packs to the device
        where the room left beside those blocks allows (newest first: backward's order), and,
        once the forward is over, read the next `nvme_depth` NVMe-homed packs further back into
        host memory. Not during the forward: the packs written so far are the ones backward
        needs last, so reading them then only took the disk from the overlapped step's updates
        and host room from the blocks, and pushed out, they were read again (built-in 350m,
        nvme_depth 8: 2.9x the packs' bytes read back, the updates 2-3x slower)."""
        names = {u.name for u in units}
        room = self.ctx.account.free_for_prefetch() - sum(u.nbytes for u in units if u.name not in self.ctx.account.held)
        ahead = []
        for pack in reversed(self._pending):
            if pack.acquired:
                continue
            assert pack.handle is not None
            if pack.block in names and pack.handle.home is not Tier.DEVICE and not self._coming(pack) \
                    and pack.nbytes <= room:
                self._to_device(pack)
                room -= pack.nbytes
            elif (self._backward and pack.handle.home is Tier.NVME and _written(pack) and len(ahead) < self.nvme_depth
                  and not self._coming(pack)):
                ahead.append(pack.handle)  # (one on its way to the device was read once: not again)
        if ahead:
            self.pm.prefetch(ahead, Tier.HOST, speculative=True)

    def bytes_ahead(self) -> int:
        """Bytes of the packs brought (or coming) to the device ahead of backward and not used
        yet: the device account leaves them out of the prefetcher's room ([Note: the device
        account] in device_account.py)."""
        return sum(p.nbytes for p in list(self._pending) if not p.acquired and self._coming(p))

    def _coming(self, pack: ActivationPack) -> bool:
        """A device copy of the pack (homed elsewhere) is there, on its way, or asked for once
        its write lands."""
        h = pack.handle
        return (h is not None and h.home is not Tier.DEVICE
                and (pack.wanted and not pack.landed or self.pm.record(h).residency[Tier.DEVICE] is not Residency.ABSENT))

    def _to_device(self, pack: ActivationPack) -> None:
        """Start the pack's copy to the device: now if its write landed, else by the writer when
        it lands (on a GPU the forward's last packs are often still being written when backward
        starts; the copy must not start before them)."""
        with self.lock:
            if not pack.landed:
                pack.wanted = True
                return
        assert pack.handle is not None
        self.pm.prefetch(pack.handle, Tier.DEVICE)

    def end_backward(self) -> None:
        """Backward is over: free what is left of its packs and give back the device's cached
        buffers of their sizes (see [Note: placed activations])."""
        self.collect()
        if self._sizes:
            self.pm.room.trim(Tier.DEVICE, set(self._sizes))

    def collect(self, *, wait: bool = False) -> None:
        """Undo the placement of freed packs: release device copies, unregister the tensors
        whose moves are over (all of them with `wait`)."""
        keep = []
        while self.dead:
            pack = self.dead.popleft()
            if not self._undo(pack, wait):
                keep.append(pack)
        self.dead.extend(keep)

    def _undo(self, pack: ActivationPack, wait: bool) -> bool:
        h = pack.handle
        if h is None:
            return True
        if pack.written is not None and not pack.written.done():
            if not wait:
                return False
            cf.wait([pack.written])
        if pack.acquired:
            self.pm.release(h, Tier.DEVICE)
            pack.acquired = False
            if h.home is not Tier.DEVICE:
                self.ctx.account.add_activations(-pack.nbytes)
        if self.pm.record(h).in_flight and not wait:
            return False
        self.pm.unregister(h)
        if h.home is Tier.DEVICE:
            self.ctx.account.add_activations(-pack.nbytes, home=True)
        pack.handle = None
        self._pending.remove(pack)
        return True

    def close(self) -> None:
        """Free every pack and stop the writer (runtime.close)."""
        for pack in list(self._pending):
            pack.free()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self.collect(wait=True)

    def __repr__(self) -> str:
        return (f"Activations({self.mode!r}, checkpointing={self.checkpointing}, pending={len(self._pending)}, "
                f"dead={len(self.dead)})")


def _written(pack: ActivationPack) -> bool:
    return pack.written is not None and pack.written.done() and pack.written.exception() is None
