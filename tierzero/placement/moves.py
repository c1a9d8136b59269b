"""Moves between tiers: a move in flight and what its body did (legs for the stall
attribution, the outcome its commit gets).

CopyStates (residency.py) plans a move under the lock, every buffer it needs reserved (a plan, plans.py),
and hands it to `MoveExecutor.submit` (executor.py) with the transition that commits it. A
worker runs the plan's body, which returns a `Done` or raises (`Failed`); the executor commits
the `Outcome` under the lock. See [Note: move legs] in plans.py.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import NamedTuple, Union

from tierzero.config import Tier
from tierzero.placement.handles import TensorHandle
from tierzero.placement.storage.streams import CopyEvent


class Leg(NamedTuple):
    """A stretch of a move's time, by what it was doing: "queued" (waiting for a worker),
    "write" (waiting for an earlier move of the tensor that writes what it reads), "read" (an
    NVMe read), "copy" (a copy between memories), "write" again for an NVMe write."""

    source: str
    start: float
    end: float


def stall_sources(legs: list[Leg], start: float, end: float) -> dict[str, float]:
    """A wait from `start` to `end` for a move with these legs, split by what the move was doing
    meanwhile (the part no leg covers, such as its commit, counts as "copy")."""
    out: dict[str, float] = {}
    for leg in legs:
        overlap = min(end, leg.end) - max(start, leg.start)
        if overlap > 0:
            out[leg.source] = out.get(leg.source, 0.0) + overlap
    rest = (end - start) - sum(out.values())
    if rest > 0:
        out["copy"] = out.get("copy", 0.0) + rest
    return out


class Move(NamedTuple):
    """One copy in flight; `future` completes when the copy is done and committed, by which
    time `legs` says where its time went (for the stall attribution of whoever waited on it)."""

    tensor: TensorHandle
    src: Tier
    dst: Tier
    nbytes: int
    future: cf.Future[None]
    start: float
    legs: list[Leg]
    issued: cf.Future[CopyEvent] | None = None
    """A fetch's: done once its last copy is queued, with that copy's event (toward the device:
    compute may order itself after it while the move waits for the copy to land)."""


class Span(NamedTuple):
    """One leg of a move, for telemetry."""

    src: Tier
    dst: Tier
    start: float
    end: float


class Landing(NamedTuple):
    """The last copy of a body, queued on a copy stream and not waited for: the move commits
    once its event completes, and its leg (`src` -> `dst`, from `start`) ends then."""

    src: Tier
    dst: Tier
    start: float


class Done(NamedTuple):
    """A body finished: the event of its last copy (complete once it returns, unless `landing`
    says the commit waits for it), its legs, the time it first waited for earlier moves of the
    tensor writing what it reads, and then for the fetch still filling its source (each
    (start, end))."""

    event: CopyEvent
    spans: list[Span]
    waited: tuple[float, float] | None = None
    source_read: tuple[float, float] | None = None
    landing: Landing | None = None

    def legs(self) -> list[Leg]:
        """Where the body's time went, as stall sources."""
        out = [Leg("write", *self.waited)] if self.waited is not None else []
        if self.source_read is not None:
            out.append(Leg("read", *self.source_read))
        for s in self.spans:
            source = "read" if s.src is Tier.NVME else "write" if s.dst is Tier.NVME else "copy"
            out.append(Leg(source, s.start, s.end))
        return out


class Failed(NamedTuple):
    """A body raised `error`; the manager commits the move as failed, then re-raises it."""

    error: BaseException


Outcome = Union[Done, Failed]
