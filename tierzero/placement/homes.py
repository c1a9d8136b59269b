"""The calls on placed tensors' home copies: register, unregister, relabel, store and read.

`Homes` carries out each in one method, as the ResidencyTable (residency.py) does the calls on
cached copies: under the table's lock, its checks, its waits and its transitions (to_home:
unregistered -> HOME; forget: every tier -> ABSENT). A home holds the tensor for its whole
life; its bytes stay reserved from register to unregister (or close).
"""

from __future__ import annotations

import torch

from io_engine import aligned_empty
from tierzero.config import Tier
from tierzero.placement.storage.cow_home import CheckpointHome
from tierzero.placement.eviction import Shortfall
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.storage.nvme import SwapRegion
from tierzero.placement.plans import StorePlan, run_store
from tierzero.placement.records import Content, Copy, Residency, TensorRecord
from tierzero.placement.residency import ResidencyTable, check_home, home_written, staging_needs
from tierzero.placement.storage.tier_store import Buffer, as_memory, region, typed


class Homes:
    """The home copies of the table's records, and the calls that write or read them."""

    def __init__(self, table: ResidencyTable) -> None:
        self.table = table

    def register(self, h: TensorHandle, data: torch.Tensor, *, lazy: bool,
                 borrowed: CheckpointHome | None) -> TensorHandle:
        """PlacementManager.register once `h` is made: checked, its room waited for, written."""
        table = self.table
        with table.cond:
            table.check(h.name)
            if h.name in table.states.names:
                raise ValueError(f"register: a tensor named {h.name!r} is already registered; "
                                 "unregister it first, or give another owner or kind")
            if h.home is Tier.NVME and table.states.io.swap is None:
                raise ValueError(f"register({h.name!r}, home='nvme'): config.nvme_dir is not set; "
                                 "give nvme_dir or choose another home tier")
            table.room.check_fits(h.name, h.nbytes, h.home)
            staging = [] if data.is_meta or borrowed is not None else staging_needs(None, h.home, h.nbytes)
            for tier, nbytes in staging:
                table.room.check_fits(h.name, nbytes, tier, why="NVMe-homed tensors are staged through host memory")
            needs = [(h.home, h.nbytes)] + staging
            buf, *staged = table.until(lambda: table.room.take(needs, h, home=True), h.name,
                                             f"register({h.name!r})")
            self._to_home(h, data, buf, staged[0] if staged else None, lazy, borrowed)
            return h

    def unregister(self, rec: TensorRecord) -> None:
        """PlacementManager.unregister: its moves waited for, then forgotten."""
        h, table = rec.handle, self.table
        with table.cond:
            table.check(rec)
            if rec.in_flight:
                table.until(lambda: None if rec.in_flight else True, rec,
                            f"unregister({h.name!r}) waiting for its moves")
            pinned = {t.value: rec.pins(t) for t in Tier if rec.pins(t)}
            if pinned:
                raise RuntimeError(f"unregister({h.name!r}): copies are still pinned (tier: pins) {pinned}; "
                                   "release() every acquire() first")
            self._forget(rec)
            table.cond.notify_all()

    def relabel(self, rec: TensorRecord, kind: Kind) -> TensorHandle:
        """The record under a new handle of another kind; its cached copies dropped first."""
        h, table = rec.handle, self.table
        for tier in (Tier.DEVICE, Tier.HOST):
            if tier is not h.home:
                table.drop(rec, tier)
        with table.cond:
            table.check(rec)
            new = TensorHandle(h.owner, kind, h.shape, h.dtype, h.home)
            if new.name in table.states.names:
                raise ValueError(f"relabel({h.name!r}): a tensor named {new.name!r} is already registered")
            if rec.in_flight or any(rec.pins(t) for t in Tier):
                raise RuntimeError(f"relabel({h.name!r}): the tensor is pinned or moving; relabel it between steps")
            assert set(rec._copies) == {h.home}, h.name
            del table.states.index[h], table.states.names[h.name]
            rec.handle = table.states.names[new.name] = new
            rec.name = new.name
            table.states.index[new] = rec
            return new

    def store(self, h: TensorHandle, data: torch.Tensor) -> None:
        """Overwrite the home (an NVMe home asynchronously, from a host staging buffer) and the
        cached copies: an unpinned device copy is dropped (the next fetch brings the new values
        on the copy stream); a device home or pinned device copy is written from `data` on the
        device, else through the staging buffer on the copy stream."""
        table = self.table
        with table.cond:
            rec = table.record_of(h, "store")
            take = lambda: None if rec.in_flight else table.room.take(  # noqa: E731
                [(Tier.HOST, h.nbytes)] if self._store_staged(rec, data) else [], h)
            bufs = take()
            if bufs is None or isinstance(bufs, Shortfall):
                bufs = table.until(take, rec, f"store({h.name!r}) waiting for its moves")
            staging = as_memory(bufs[0]) if bufs else None
            home = rec._copies[rec.home]
            try:
                if staging is not None:
                    typed(staging, h).copy_(data)
                self._overwrite_copies(rec, data, staging)
            except BaseException:
                if staging is not None:
                    table.states.pool.free(staging)
                raise
            if home.tensor is None:
                self._write_home(h, home, staging)
            else:
                rec._home_error = None
                if staging is not None:
                    table.states.pool.free(staging)
            table.cond.notify_all()

    def _overwrite_copies(self, rec: TensorRecord, data: torch.Tensor, staging: torch.Tensor | None) -> None:
        table, pending = self.table, []
        for tier, copy in list(rec._copies.items()):
            if tier is Tier.NVME:
                continue
            if tier is not rec.home and tier is Tier.DEVICE and copy.pins == 0:
                table.states.free(rec.handle, tier)
                continue
            copy.event.synchronize()  # a copy still landing in it would overwrite the new values
            if tier is Tier.DEVICE and not table.states.streams.is_device(data) and staging is not None:
                copy.event = table.states.streams.copy(copy.tensor, typed(staging, rec.handle))
                pending.append(copy.event)
            else:
                copy.tensor.copy_(data)
                table.states.streams.compute_wait(None, copy.tensor)  # written on the compute stream
            copy.content = Content.CURRENT
        for event in pending:  # the staging buffer is freed or written to NVMe next
            event.synchronize()

    def _store_staged(self, rec: TensorRecord, data: torch.Tensor) -> bool:
        """Whether store() writes through a host staging buffer: an NVMe home's write, or a
        device home or pinned device copy written from host data on the copy stream (CUDA's
        non-blocking copies need pinned memory)."""
        if rec.home is Tier.NVME:
            return True
        streams = self.table.states.streams
        on_device = rec.home is Tier.DEVICE or rec.pins(Tier.DEVICE) > 0
        return streams.asynchronous and not streams.is_device(data) and on_device

    def read(self, h: TensorHandle, out: torch.Tensor | None) -> torch.Tensor:
        """The home's contents on the CPU (after its write-backs): fresh, or in `out` (flat
        uint8, page-aligned)."""
        table = self.table
        with table.cond:
            rec = table.record_of(h, "read")
            if home_written(rec) is None:
                table.until(lambda: home_written(rec), rec, f"read({h.name!r}) waiting for its write-backs")
            dirty = next((c for c in rec._copies.values() if c.content is Content.DIRTY), None)
            if dirty is not None:  # newer than the home
                dirty.event.synchronize()
                return dirty.tensor.detach().to("cpu", copy=True) if out is None else typed(out, h).copy_(dirty.tensor)
            check_home(rec)
            home = rec._copies[rec.home]
            home.event.synchronize()
            if home.tensor is not None:
                return home.tensor.detach().to("cpu", copy=True) if out is None else typed(out, h).copy_(home.tensor)
            where = region(home.buffer)
            buf = torch.from_numpy(aligned_empty(where.length)) if out is None else out
            table.states.io.nvme().read(where, buf.numpy(), h.name, h.traffic)
            return typed(buf, h)

    def location(self, rec: TensorRecord) -> SwapRegion:
        """The NVMe region holding the tensor's home bytes."""
        with self.table.cond:
            where = rec._copies[rec.home].buffer
        assert isinstance(where, SwapRegion), where
        return where

    def close(self) -> None:
        """Join the workers, then take every tensor to ABSENT (pinned copies too)."""
        self.table.close()
        with self.table.cond:
            for rec in tuple(self.table.states.index.values()):
                self._forget(rec)

    # ---------------------------------------------------------------------- transition methods

    def _to_home(self, h: TensorHandle, data: torch.Tensor, buf: Buffer, staging: Buffer | None, lazy: bool,
                 borrowed: CheckpointHome | None) -> TensorRecord:
        """(unregistered) -> HOME: write `data` into the reserved home `buf` (an NVMe home through
        the host `staging` buffer, by a worker: its error goes to flush(); with `lazy` the staging
        buffer stays as a dirty cached host copy, HOST -> RESIDENT, and nothing is written yet;
        with `borrowed`, checkpoint bytes equal to `data`, the NVMe home is adopted unwritten,
        nothing copied); nothing for a meta `data`."""
        table = self.table
        rec = TensorRecord(h)
        staging = None if staging is None else as_memory(staging)
        home = Copy(buf, table.states.stores[h.home].view(buf, h))
        try:
            if data.is_meta or borrowed is not None:
                pass  # room reserved, nothing to write (a borrowed home holds the bytes)
            elif home.tensor is not None:
                home.tensor.copy_(data)
                table.states.streams.compute_wait(None, home.tensor)  # written on the compute stream
            else:
                typed(staging, h).copy_(data)
        except BaseException:
            table.states.stores[h.home].free(buf)
            if staging is not None:
                table.states.pool.free(staging)
            raise
        rec._copies[h.home] = home
        table.room.add_home(h)
        table.states.index[h] = rec
        table.states.names[h.name] = h
        if borrowed is not None:
            table.states.io.nvme().adopt(region(buf), borrowed, h.name)
        if staging is not None and lazy:
            host = table.states.stores[Tier.HOST]
            rec._copies[Tier.HOST] = Copy(staging, host.view(staging, h), Content.DIRTY, used=True)
            table.states.recency[(h, Tier.HOST)] = None
            rec._residency[Tier.HOST] = Residency.RESIDENT
        elif staging is not None:  # the NVMe write runs on a worker, as a store's does
            self._write_home(h, home, staging)
        rec._residency[h.home] = Residency.HOME
        return rec

    def _forget(self, rec: TensorRecord) -> None:
        """Every tier -> ABSENT: drop the cached copies, free the home, forget the handle."""
        h, table = rec.handle, self.table
        for tier in [t for t in rec._copies if t is not h.home]:
            table.states.free(h, tier)
        assert rec._residency[h.home] is Residency.HOME, rec
        home = rec._copies.pop(h.home)
        home.event.synchronize()
        table.states.stores[h.home].free(home.buffer)
        table.room.remove_home(h)
        del table.states.index[h], table.states.names[h.name]
        rec._residency[h.home] = Residency.ABSENT

    def _write_home(self, h: TensorHandle, home: Copy, staging: torch.Tensor) -> None:
        """Submit the write of the host `staging` bytes to the NVMe `home` (a worker runs it)."""
        home.move = self.table.states.executor.submit(StorePlan(h, home, staging), Tier.HOST, Tier.NVME,
                                                      run_store, self._finish_store, key=Tier.NVME)

    def _finish_store(self, plan: StorePlan, outcome: object) -> None:
        table = self.table
        table.states.moves.pop(plan.handle, Tier.NVME)
        plan.home.move = None
        table.states.pool.free(plan.staging)
        table.states.commit_home(plan.handle, outcome)  # type: ignore[arg-type]

