"""The executor of moves: runs the plans' bodies on worker threads (NVMe IO, copies between
memories, and waiters for copies still landing) and commits each outcome under the table's lock;
`MoveTable`, every move in flight.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from typing import Callable, TypeVar

from tierzero.config import Tier
from tierzero.placement.handles import TensorHandle
from tierzero.placement.moves import Done, Failed, Leg, Move, Outcome, Span
from tierzero.placement.plans import FetchPlan, MoveIO, StorePlan, WritebackPlan
from tierzero.placement.storage.streams import DONE, CopyEvent


PlanT = TypeVar("PlanT", FetchPlan, WritebackPlan, StorePlan)
Body = Callable[[PlanT, MoveIO], Done]
Commit = Callable[[PlanT, Outcome], None]


class MoveTable:
    """Every move in flight, in one place, keyed by (tensor, tier of its cached copy): the tier
    a fetch fills or a write-back copies from (a store, which targets the NVMe home, is keyed by
    NVMe: no other move is). A copy has at most one move at a time, which it also keeps (its
    `move`: a tensor's moves are read off its copies; this table answers for all of them)."""

    def __init__(self) -> None:
        self._moves: dict[tuple[TensorHandle, Tier], Move] = {}

    def add(self, tier: Tier, move: Move) -> None:
        assert (move.tensor, tier) not in self._moves, f"{move.tensor.name} already moving on {tier}"
        self._moves[(move.tensor, tier)] = move

    def pop(self, handle: TensorHandle, tier: Tier) -> Move:
        return self._moves.pop((handle, tier))

    def all(self) -> tuple[Move, ...]:
        return tuple(self._moves.values())

    def __len__(self) -> int:
        return len(self._moves)


class MoveExecutor:
    """Runs move bodies on worker threads and commits their outcomes under `cond`.

    Every move is in `table`, under (tensor, key), from `submit` until its commit ran; the
    commit (a transition of ResidencyTable) runs under `cond`, which then notifies waiters.
    """

    def __init__(self, cond: threading.Condition, io: MoveIO, *, workers: int, rank: int) -> None:
        self.cond = cond
        self.io = io
        self.table = MoveTable()
        # Moves that read or write the swap files run on `workers` threads (the NVMe reads in
        # flight, sized to the read-ahead depth); copies between memories on threads of their
        # own, so that a block's copy to the device never queues behind the optimizer's or the
        # prefetcher's disk reads.
        self._nvme = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"tierzero-io-r{rank}")
        self._copier = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tierzero-copy-r{rank}")
        # With asynchronous copies, a move whose last copy is queued commits once the copy's
        # event completes, and a write-back starts once the copy into its source landed: these
        # threads wait for the events, so that no worker above sleeps on a copy stream. A worker
        # that did held an NVMe read slot idle (on the CPU's stream stand-in the NVMe workers
        # slept seconds a step that way).
        self._waiter = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tierzero-land-r{rank}")

    def submit(self, plan: PlanT, src: Tier, dst: Tier, body: Body[PlanT], commit: Commit[PlanT], *,
               key: Tier) -> Move:
        """Run `body(plan)` on a worker, then `commit(plan, outcome)` under the lock; the move,
        which the caller keeps on the copy it fills or reads (its `move`)."""
        legs: list[Leg] = []
        submitted = time.perf_counter()
        pool = self._nvme if Tier.NVME in (src, dst) else self._copier
        future: cf.Future[None] = cf.Future()  # done at the commit, which a waiter may make
        source = plan.copy.event if isinstance(plan, WritebackPlan) else DONE
        if source is DONE or source.query():
            pool.submit(self._run_body, plan, body, commit, legs, submitted, future)
        else:  # the copy into the source is still queued: a waiter starts the body once it landed
            self._run_on(self._waiter, self._start_once_landed, source, pool, plan, body, commit, legs, submitted,
                         future)
        issued = plan.issued if isinstance(plan, FetchPlan) else None
        move = Move(plan.handle, src, dst, plan.handle.nbytes, future, submitted, legs, issued)
        self.table.add(key, move)
        return move

    def close(self) -> None:
        """Join the workers (moves handed on after this run on the thread handing them)."""
        self._nvme.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self._waiter.shutdown(wait=True)

    @staticmethod
    def _run_on(pool: cf.ThreadPoolExecutor, fn: Callable[..., None], *args: object) -> None:
        """Run `fn(*args)` on `pool`, or here once the pool is shut down (close())."""
        try:
            pool.submit(fn, *args)
        except RuntimeError:
            fn(*args)

    def _start_once_landed(self, event: CopyEvent, pool: cf.ThreadPoolExecutor, *args: object) -> None:
        """(On a waiter) submit a move's body to `pool` once `event` completed; an error of the
        copy is left for the body's own wait to raise."""
        with contextlib.suppress(Exception):
            event.synchronize()
        self._run_on(pool, self._run_body, *args)

    def _run_body(self, plan: PlanT, body: Body[PlanT], commit: Commit[PlanT], legs: list[Leg], submitted: float,
                  future: cf.Future[None]) -> None:
        outcome: Outcome
        legs.append(Leg("queued", submitted, time.perf_counter()))
        try:
            outcome = body(plan, self.io)
        except BaseException as e:
            outcome = Failed(e)
        if isinstance(outcome, Done) and outcome.landing is not None and not outcome.event.query():
            self._run_on(self._waiter, self._commit_once_landed, plan, outcome, commit, legs, future)
        else:
            self._commit_once_landed(plan, outcome, commit, legs, future)

    def _commit_once_landed(self, plan: PlanT, outcome: Outcome, commit: Commit[PlanT], legs: list[Leg],
                            future: cf.Future[None]) -> None:
        """Once the body's last copy ran (a waiter waits for it), commit the move under the lock."""
        if isinstance(outcome, Done):
            outcome = _landed(outcome)
        if isinstance(outcome, Done):
            legs.extend(outcome.legs())
        error = outcome.error if isinstance(outcome, Failed) else None
        with self.cond:
            try:
                commit(plan, outcome)
            except BaseException as e:
                error = error or e
            finally:  # waiters wake even if the commit itself failed
                self.cond.notify_all()
                if isinstance(plan, FetchPlan) and not plan.issued.done():  # not issued early: now
                    if isinstance(outcome, Failed):
                        plan.issued.set_exception(outcome.error)
                    else:
                        plan.issued.set_result(DONE)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)


def _landed(done: Done) -> Outcome:
    """`done` once its last copy landed (its span then ends), or Failed if that copy failed."""
    if done.landing is None:
        return done
    try:
        done.event.synchronize()
    except BaseException as e:
        return Failed(e)
    landing = done.landing
    done.spans.append(Span(landing.src, landing.dst, landing.start, time.perf_counter()))
    return done
