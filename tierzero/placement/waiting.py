"""Waiting for room and for moves: the loop the table's calls sleep in under the lock,
and when a wait gives up (past its deadline, or when nothing can end it)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Collection, Mapping, Protocol, TypeVar

from tierzero.config import Tier, format_size
from tierzero.placement.eviction import Shortfall
from tierzero.placement.handles import TensorHandle
from tierzero.placement.records import TensorRecord
from tierzero.placement.storage.swap_dirs import exiting
from tierzero.placement.storage.tier_store import TierStore

T = TypeVar("T")
EXIT_POLL_S = 0.5
"""How often a waiting thread looks whether the program is exiting (then it fails: a thread left
waiting would keep the interpreter from exiting)."""


class Waited(Protocol):
    """What a wait reads of the table it waits on (ResidencyTable), under its lock."""

    cond: threading.Condition
    index: Mapping[TensorHandle, TensorRecord]
    scratch: Mapping[int, tuple[Tier, int]]
    stores: Mapping[Tier, TierStore]

    def in_flight(self) -> int:
        """Moves in flight, of every tensor."""
        ...


class Waits:
    """The threads waiting on the table's lock for room or a move, and the loop they wait in.

    `timeout_s` bounds any wait; a wait for room that nothing but the waiting threads could end
    (their own pins, nothing moving) fails after `stuck_after_s` without a change.
    """

    def __init__(self, table: Waited, *, timeout_s: float, stuck_after_s: float) -> None:
        self.table = table
        self.timeout_s = timeout_s
        self.stuck_after_s = stuck_after_s
        self._short: dict[int, Tier] = {}
        """Threads waiting for room on a tier (under the lock)."""
        self._abandoned: set[int] = set()
        """Threads waiting for room with one that found none can come: they fail at once."""

    def until(self, attempt: Callable[[], T | Shortfall | None], subject: TensorRecord | str, what: str) -> T:
        """Call `attempt` (under the lock) until it returns a result, sleeping until the next
        change while it returns None (waiting for a move) or a Shortfall (no room). A shortfall
        nothing can end (no move in flight, every copy pinned on that tier pinned by this thread
        or by threads that wait for room there too) raises once nothing has changed for
        stuck_after_s; any wait raises past timeout_s; both name what was missing and the budget
        that would hold it. `subject`: the tensor waited for (KeyError if another thread
        unregisters it meanwhile), or the name of a new one."""
        deadline = time.monotonic() + self.timeout_s
        me = threading.get_ident()
        try:
            return self._loop(attempt, subject, what, deadline)
        finally:
            self._short.pop(me, None)
            self._abandoned.discard(me)

    def _loop(self, attempt: Callable[[], T | Shortfall | None], subject: TensorRecord | str, what: str,
              deadline: float) -> T:
        me = threading.get_ident()
        name = subject if isinstance(subject, str) else subject.name
        stuck_since: float | None = None
        while True:
            result = attempt()  # (which checks first that the manager is open, the tensor registered)
            if result is not None and not isinstance(result, Shortfall):
                return result
            now = time.monotonic()
            remaining = deadline - now
            if isinstance(result, Shortfall):
                self._short[me] = result.tier
            else:
                self._short.pop(me, None)
            if isinstance(result, Shortfall) and self._stuck(result.tier):
                stuck_since = now if stuck_since is None else stuck_since
                if now - stuck_since >= self.stuck_after_s or me in self._abandoned:
                    # the threads waiting with this one hold the rest: they fail too, at once
                    # (a thread left waiting would keep the process from exiting)
                    self._abandoned.update(t for t, tier in self._short.items() if tier is result.tier and t != me)
                    self.table.cond.notify_all()
                    raise RuntimeError(f"{what}: {self._no_room(name, result, waited=False)}")
                remaining = min(remaining, self.stuck_after_s - (now - stuck_since))
            else:
                stuck_since = None
            if deadline - now <= 0:
                if result is None:
                    raise RuntimeError(f"{what}: nothing changed for {self.timeout_s} s")
                raise RuntimeError(f"{what}: {self._no_room(name, result, waited=True)}")
            if exiting() and threading.current_thread() is not threading.main_thread():
                raise RuntimeError(f"{what}: the program is exiting (its main thread ended) while this thread waited "
                                   f"for {'room' if isinstance(result, Shortfall) else 'a move'} ({name!r})")
            if self.table.cond.wait(min(remaining, EXIT_POLL_S)):
                stuck_since = None  # something changed (a release may come from another thread)

    def _stuck(self, tier: Tier) -> bool:
        """Under the lock: no room on `tier` can ever come while this thread waits. Nothing is
        moving (no write-back will make a copy evictable, no fetch will end), and whatever is
        pinned there (copies, scratch buffers) this very thread holds, or threads that wait for
        room on that tier themselves."""
        if self.table.in_flight():
            return False
        # The threads that will release nothing there: this one, and those waiting for room on
        # the same tier (two threads each holding what the other waits for never move again).
        blocked = {threading.get_ident(), *(t for t, short in self._short.items() if short is tier)}
        return (not self._pinned_by_others(tier, blocked)
                and all(owner in blocked for t, owner in self.table.scratch.values() if t is tier))

    def _pinned_by_others(self, tier: Tier, threads: Collection[int]) -> bool:
        """Whether a cached copy on `tier` is pinned by a thread not in `threads`, or by a move
        (which will unpin it when it ends)."""
        for rec in self.table.index.values():
            copy = rec._copies.get(tier) if tier is not rec.home else None
            if copy is not None and copy.pins and (copy.pins != len(copy.holders) or not set(copy.holders) <= threads):
                return True
        return False

    def _no_room(self, name: str, short: Shortfall, *, waited: bool) -> str:
        tier = short.tier
        pinned = [(r.name, r.pins(tier)) for r in self.table.index.values() if r.pins(tier)]
        store = self.table.stores[tier]
        b, need = store.budget, store.reserved(short.nbytes)
        why = (f"after waiting {self.timeout_s} s" if waited else
               "and none can come: nothing is moving and what is pinned there is held by this thread, or by "
               "threads waiting for room there too")
        return (f"tensor {name!r}: no room for {format_size(need)} on the {tier.value} tier {why}: "
                f"{format_size(b.used)} of {format_size(b.limit)} reserved, {self.table.in_flight()} moves in flight, "
                f"pinned copies (name, pins): {pinned[:8]}{' ...' if len(pinned) > 8 else ''}; raise "
                f"{tier.value}_budget to at least {b.used + need} bytes, or release tensors before acquiring more")
