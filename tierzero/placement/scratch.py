"""Scratch buffers: bytes a caller fills and computes on itself (a block gathered from every
rank's shards), reserved within a tier's budget like any copy."""

from __future__ import annotations

import threading

import torch

from tierzero.config import Tier
from tierzero.placement.eviction import Shortfall
from tierzero.placement.residency import ResidencyTable
from tierzero.placement.storage.tier_store import as_memory


class Scratch:
    """`PlacementManager.scratch`: reserve() and free() scratch buffers on the device or host tier."""

    def __init__(self, table: ResidencyTable) -> None:
        self._table = table

    def reserve(self, nbytes: int, tier: Tier | str = Tier.DEVICE, *, what: str,
                wait: bool = True) -> torch.Tensor | None:
        """A uint8 buffer of at least `nbytes` on `tier`, reserved within the tier's budget like
        any copy (evicting unpinned cached copies, waiting up to the manager's wait_timeout_s for
        releases; wait=False: None when there is no room now); give it back with free(). The
        calling thread's compute stream is recorded as its user, so its memory is not handed out
        again before that compute is done. `what` names it in errors."""
        tier = Tier.parse(tier, what=f"scratch.reserve({what!r}) tier")
        if tier is Tier.NVME:
            raise ValueError(f"scratch.reserve({what!r}, 'nvme'): scratch buffers live on 'device' or 'host'")
        table = self._table
        with table.cond:
            table.check(what)
            table.room.check_fits(what, nbytes, tier)
            if wait:
                (buf,) = table.until(lambda: table.room.take([(tier, nbytes)], None), what,
                                     f"scratch.reserve({what!r}, {tier.value!r})")
            else:
                got = table.room.take([(tier, nbytes)], None, speculative=True)
                if isinstance(got, Shortfall):
                    return None
                (buf,) = got
            scratch = as_memory(buf)
            table.scratch[scratch.data_ptr()] = (tier, threading.get_ident())
        if tier is Tier.DEVICE:
            table.streams.lend(scratch, what)
            table.streams.compute_wait(None, scratch)
        return scratch

    def free(self, buf: torch.Tensor, tier: Tier | str = Tier.DEVICE) -> None:
        """Give back a buffer from reserve()."""
        table = self._table
        with table.cond:
            table.scratch.pop(buf.data_ptr(), None)
            table.states.stores[Tier.parse(tier)].free(buf)
            table.cond.notify_all()
