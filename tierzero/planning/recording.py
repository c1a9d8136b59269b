"""A recorded training iteration, read back from a Chrome trace, as the tier model replays it.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from tierzero.placement import ACTIVATIONS_TRACK, UPDATES_TRACK, Kind
from tierzero.prefetch import FetchPhase, TraceEvent, Unit

# [Note: what a recording holds]
# The prefetcher writes one span per block fetch to the trace (track "blocks": unit, phase, the
# units held beside it, its stall, other stalls until the next fetch) and what a reader needs in
# "otherData" (units and their tensors, device room, workers, io threads); the placement manager
# writes every move leg (tracks "src -> dst", with bytes). `Recording.from_trace` turns the
# training iterations that can be replayed (each after one with the same block order, and
# followed by another, which closes its last fetch's compute: the optimizer step) into:
#
#     slots       per fetch: event, units held, compute seconds (its span less the stalls in
#                 it), its own stall (and of it the wait for its block's update by the
#                 overlapped step), backward's wait for the block's activation pack from NVMe,
#                 the other stalls (the optimizer waiting for its states)
#     packs       per block, the bytes of its activation pack homed on NVMe (Config.activations)
#     background  move legs no policy decides (stores, write-backs, optimizer state reads),
#                 each placed by the fetch it followed and the seconds after it
#     busy        per leg kind, bytes moved and seconds such legs ran (overlaps counted once)
#
# Several iterations are merged, of one trace or of several recorded at different times
# (`from_traces`: drift of a shared machine evens out): per fetch the median of each figure, busy
# bytes and seconds summed, the background of the latest.
TRAINING_KEY = repr((True, True))
"""The prefetcher's key of a training iteration (grad enabled, module in training mode)."""
STAGED_GAP_US = 1000.0
"""A copy to the device that starts within this many microseconds of an NVMe read of the same
tensor ending was staged through that read (one move's two legs)."""


class Slot(NamedTuple):
    """One fetch of the recorded iteration."""

    event: TraceEvent
    held: tuple[str, ...]
    compute_s: float
    stall_s: float
    """The fetch's own stall, its wait for the block's update (`update_s`) included."""
    other_stall_s: float
    """Stalls after the fetch that were not this block's (the optimizer's), its pack's wait
    (`pack_s`) left out."""
    update_s: float = 0.0
    """Of `stall_s`, the wait for the overlapped step's update of the block: what no prefetch
    policy changes (the tier model adds it as recorded)."""
    host_room: int | None = None
    """Host bytes for unit copies when the fetch was asked for: the rest of the host budget
    holds the step's gradients and optimizer states, which come and go over the iteration
    (None: not recorded, the recording's `host_room` holds throughout)."""
    pack_s: float = 0.0
    """Backward's wait for the block's activation pack homed on NVMe (`Recording.packs`): the
    tier model replays it."""
    device_beside: int = 0
    """Device bytes early capture's buffers and activations homed on the device took when the
    fetch was asked for: the device room the replay has is the recording's less these."""
    room_s: float = 0.0
    """Of `stall_s`, the wait for room on a tier: for the step's own buffers to go (gradients on
    their way home), which no prefetch schedule removes (the tier model adds it as recorded)."""


class Leg(NamedTuple):
    src: str
    dst: str
    nbytes: int
    seconds: float


class Update(NamedTuple):
    """A block's update by the overlapped step before the recorded forward (the trace's
    "updates" track), in the order the step ran them."""

    block: str
    cpu_s: float
    """Its span less its waits for data."""
    reads: tuple[Leg, ...]
    """The NVMe reads of the block's tensors (master, moments, gradient) from the step on: the
    update's own, or its predecessor's read-ahead of them."""
    leaves_on_host: bool = False
    """Its reads included the block's parameters (the unit's tensors): the update leaves them in
    host memory, where the forward copies them from."""


class Background(NamedTuple):
    """A move leg no policy decides, replayed `offset_s` after the start of slot `pos`."""

    pos: int
    offset_s: float
    leg: Leg


@dataclass
class Recording:
    """One iteration of a run, as much as replaying it needs (see [Note: what a recording holds])."""

    slots: list[Slot]
    units: dict[str, Unit]
    background: list[Background]
    legs: list[Leg]
    """Every move leg of the iteration (fetches too), to calibrate the channels."""
    busy: dict[tuple[str, str], tuple[int, float]]
    """Per leg (src, dst): bytes moved and seconds such legs ran (overlaps counted once)."""
    device_room: int
    host_room: int
    workers: int
    io_threads: int
    io_block_size: int
    wraps: bool
    policy: str
    miss_overheads: list[float] = field(default_factory=list)
    """Per fetch that waited for its own copy: the wait less the copy's legs."""
    step_invalidates: bool = False
    """The optimizer step leaves no device copy valid: the recorded forward copied every block
    it fetched to the device again (parameters updated in place in their host copies: the
    device copies of the old values are dropped). The replay drops them at each step."""
    step_on_host: frozenset[str] = frozenset()
    """Units the optimizer step left on the host: it rewrote their host copies (and wrote them
    home), and the forward copied them to the device from there, without an NVMe read. The
    replay puts them on the host at each step, as no prefetch policy decides."""
    updates: list[Update] = field(default_factory=list)
    """The overlapped step's block updates before the forward, in order (empty: the step ran
    before the forward, or the trace predates the "updates" track: the fetches' recorded waits
    for them are added as they were)."""
    update_read_ahead: int = 1
    """Updates whose reads an update starts once it has its own data (the optimizer's)."""
    packs: dict[str, int] = field(default_factory=dict)
    """Per block, the bytes of the activation pack backward read back from its NVMe home (the
    trace's "activations" track): their reads and copies are not background, the tier model
    replays them with the block fetches they ride along."""
    nvme_depth: int = 0
    """Packs read ahead into host memory at each fetch of backward (Config.prefetch.nvme_depth)."""

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Recording":
        """From a trace.json, or a run folder holding one."""
        p = Path(path)
        if p.is_dir():
            p = p / "trace.json"
        if not p.is_file():
            raise FileNotFoundError(f"--trace {str(path)!r}: expected a trace.json or a run folder holding one "
                                    "(tierzero train writes it)")
        try:
            trace = json.loads(p.read_text())
        except ValueError as e:
            raise ValueError(f"--trace {str(p)!r} is not JSON: {e}") from e
        return cls.from_trace(trace, where=str(p))

    @classmethod
    def from_trace(cls, trace: Mapping[str, Any], *, last: int | None = None, where: str = "the trace") -> "Recording":
        """The training iterations of a Chrome trace the telemetry wrote that can be replayed
        (each after one with the same block order, and followed by another), the `last` latest
        of them (None: all) merged: per fetch the median compute and stalls, the channels' bytes
        and busy seconds summed, the background moves of the latest."""
        return cls._merge([cls._parts(trace, last, where)])

    @classmethod
    def from_traces(cls, traces: Sequence[Mapping[str, Any]], *, where: str = "the traces") -> "Recording":
        """The replayable iterations of several traces of the same model and settings (recorded
        at different times, so drift of the machine in between evens out), merged as above."""
        return cls._merge([cls._parts(t, None, f"{where} #{i + 1}") for i, t in enumerate(traces)])

    @classmethod
    def _merge(cls, traces: list[tuple[dict, dict[str, Unit], list["_Part"]]]) -> "Recording":
        info, units, _ = traces[-1]
        parts = [p for _, _, ps in traces for p in ps]
        if any(len(p.slots) != len(parts[0].slots) or [s.event for s in p.slots] != [s.event for s in parts[0].slots]
               for p in parts):
            raise ValueError("the recordings differ in their block order; record the same model and settings")
        slots = [Slot(ss[0].event, ss[0].held, *(statistics.median(getattr(s, f) for s in ss)
                                                  for f in ("compute_s", "stall_s", "other_stall_s", "update_s")),
                      min(s.host_room for s in ss) if all(s.host_room is not None for s in ss) else None,
                      statistics.median(s.pack_s for s in ss), max(s.device_beside for s in ss),
                      statistics.median(s.room_s for s in ss))
                 for ss in zip(*(p.slots for p in parts))]
        busy: dict[tuple[str, str], tuple[int, float]] = {}
        for p in parts:
            for leg, (n, sec) in p.busy.items():
                n0, s0 = busy.get(leg, (0, 0.0))
                busy[leg] = (n0 + n, s0 + sec)
        return cls(slots, units, parts[-1].background, [leg for p in parts for leg in p.legs], busy,
                   info["device_room"], min(p.host_room for p in parts), info["workers"], info["io_threads"],
                   info["io_block_size"], info.get("device_wraps", True), info.get("policy", "?"),
                   [o for p in parts for o in p.miss_overheads], all(p.step_invalidates for p in parts),
                   frozenset.intersection(*(p.step_on_host for p in parts)), _merge_updates(parts),
                   int(info.get("update_read_ahead", 1)), parts[-1].packs, int(info.get("nvme_depth", 0)))

    @staticmethod
    def _parts(trace: Mapping[str, Any], last: int | None, where: str) -> tuple[dict, dict[str, Unit], list["_Part"]]:
        """The trace's facts, units, and its replayable iterations (the `last` latest)."""
        info = (trace.get("otherData") or {}).get("tierzero") or {}
        events = trace.get("traceEvents", [])
        spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "blocks"
                 and e["args"].get("key") == TRAINING_KEY]
        if not info.get("units") or not spans:
            raise ValueError(f"{where}: no block fetches of a training step in it (a trace written by "
                             "tierzero with the block track: tierzero train after 3 or more steps)")
        by_it: dict[int, list[dict]] = {}
        for e in spans:
            by_it.setdefault(e["args"]["iteration"], []).append(e)
        numbers = sorted(by_it)
        full = [i for i in numbers[1:] if i + 1 in by_it and i - 1 in by_it
                and _order(by_it[i - 1]) == _order(by_it[i]) == _order(by_it[i + 1])]
        if not full:
            raise ValueError(f"{where}: needs three training steps in a row with the same block order "
                             f"(the first records it, the last closes the one replayed); it has iterations {numbers}")
        units = {name: Unit(name, tuple(u.get("tensors", ())), u["bytes"], u["nvme"]) for name, u in info["units"].items()}
        tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
        moves = [e for e in events if e.get("ph") == "X" and e.get("cat") == "move"]
        updates = [e for e in events if e.get("ph") == "X" and e.get("cat") == UPDATES_TRACK]
        fetches = [e for e in events if e.get("ph") == "X" and e.get("cat") == ACTIVATIONS_TRACK
                   and e["name"].startswith("fetch ")]
        return info, units, [_iteration(by_it[i], by_it[i - 1], by_it[i + 1], moves, tracks, units, updates, fetches)
                                    for i in full[-(last or len(full)):]]

    @classmethod
    def disk_rates_each(cls, trace: Mapping[str, Any]) -> dict[int, dict[tuple[str, str], tuple[int, float]]]:
        """Per replayable iteration of the trace (by its number), the disk's bytes and busy
        seconds of reads ("nvme", "host") and writes ("host", "nvme"): the rates it ran at."""
        _, _, parts = cls._parts(trace, None, "the trace")
        return {p.iteration: {leg: p.busy[leg] for leg in (("nvme", "host"), ("host", "nvme")) if leg in p.busy}
                for p in parts}

    @property
    def compute_s(self) -> float:
        return sum(s.compute_s for s in self.slots)

    def summary(self) -> dict[str, Any]:
        return {"fetches": len(self.slots), "units": len(self.units), "compute_s": round(self.compute_s, 4),
                "stall_s": round(sum(s.stall_s for s in self.slots), 4),
                "update_stall_s": round(sum(s.update_s for s in self.slots), 4),
                "other_stall_s": round(sum(s.other_stall_s for s in self.slots), 4),
                "pack_stall_s": round(sum(s.pack_s for s in self.slots), 4),
                "background_moves": len(self.background), "policy": self.policy, "workers": self.workers,
                "io_threads": self.io_threads, "device_room": self.device_room, "host_room": self.host_room}


def _order(spans: list[dict]) -> list[tuple[str, str]]:
    return [(e["args"]["phase"], e["args"]["unit"]) for e in sorted(spans, key=lambda e: e["args"]["pos"])]


class _Part(NamedTuple):
    slots: list[Slot]
    legs: list[Leg]
    background: list[Background]
    busy: dict[tuple[str, str], tuple[int, float]]
    host_room: int
    miss_overheads: list[float]
    step_invalidates: bool
    step_on_host: frozenset[str]
    updates: list[Update]
    packs: dict[str, int]
    iteration: int = 0
    """The iteration's number in the trace (the run's first training step is 1)."""


def _merge_updates(parts: list[_Part]) -> list[Update]:
    """Per update, the median CPU seconds; the reads of the latest iteration (as its background).
    None (an empty list) if the iterations' steps updated different blocks."""
    blocks = [u.block for u in parts[-1].updates]
    if not blocks or any([u.block for u in p.updates] != blocks for p in parts):
        return []
    return [parts[-1].updates[k]._replace(cpu_s=statistics.median(p.updates[k].cpu_s for p in parts))
            for k in range(len(blocks))]


def _iteration(spans: list[dict], before: list[dict], after: list[dict], moves: list[dict],
               tracks: dict[int, str], units: Mapping[str, Unit], update_spans: list[dict],
               pack_fetches: list[dict]) -> _Part:
    """One iteration's fetch spans (and the next's, which closes its last compute) as slots, its
    move legs, the background ones placed by the fetch they followed, its channels' busy time,
    the updates of the overlapped step before it, the activation packs backward read back from
    NVMe. Background: every leg but the copies of units' tensors to the host or the device
    (what a policy decides), the updates' reads and the NVMe packs' reads and copies to the
    device (they go with the block fetches)."""
    this = sorted(spans, key=lambda e: e["args"]["pos"])
    first_next = min(after, key=lambda e: e["args"]["pos"])
    starts = [e["ts"] for e in this]  # in order

    def slot_at(ts: float) -> int:
        """The fetch a moment at `ts` (not before the first) followed."""
        return bisect.bisect_right(starts, ts) - 1

    packs: dict[str, int] = {}
    pack_s = [0.0] * len(this)
    for e in pack_fetches:  # backward's acquires of packs homed on NVMe, by the fetch they followed
        if e["args"].get("tier") == "nvme" and starts[0] <= e["ts"] < first_next["ts"]:
            packs[e["name"].removeprefix("fetch ")] = e["args"]["bytes"]
            pack_s[slot_at(e["ts"])] += e["args"].get("stall_s", 0.0)
    slots = []
    for i, e in enumerate(this):
        a = e["args"]
        span = e["dur"] / 1e6
        other = a["other_stall_s"]
        if i == len(this) - 1:  # to the next iteration's first fetch, the optimizer step included
            span += (first_next["ts"] - e["ts"] - e["dur"]) / 1e6
            other += first_next["args"].get("gap_stall_s", 0.0)
        update = min(a["stall_s"], a.get("stall_by_source", {}).get("update", 0.0))
        other = max(0.0, other - pack_s[i])
        slots.append(Slot(TraceEvent(FetchPhase(a["phase"]), a["unit"]), tuple(a["held"]),
                          max(0.0, span - a["stall_s"] - other - pack_s[i]), a["stall_s"], other, update,
                          a.get("host_room"), pack_s[i], a.get("device_beside", 0),
                          min(a["stall_s"], a.get("stall_by_source", {}).get("room", 0.0))))
    start, end = this[0]["ts"], first_next["ts"]
    since = max(e["ts"] + e["dur"] for e in before)  # the step before this forward began after it
    updates, theirs = _updates(update_spans, moves, tracks, since, this, units)
    fetch_tensors = {t for u in units.values() for t in u.tensors}
    legs, background = [], []
    inside = [m for m in moves if start <= m["ts"] < end and _between_tiers(tracks[m["tid"]])]
    for m in inside:
        src, _, dst = tracks[m["tid"]].partition(" -> ")
        leg = Leg(src, dst, m["args"]["bytes"], m["dur"] / 1e6)
        legs.append(leg)
        if not (m["name"] in fetch_tensors and dst in ("host", "device")) and id(m) not in theirs \
                and not (pack_block(m["name"]) in packs and dst in ("host", "device")):
            pos = slot_at(m["ts"])
            background.append(Background(pos, (m["ts"] - starts[pos]) / 1e6, leg))
    forward = {s.event.unit for s in slots if s.event.phase is FetchPhase.FORWARD}
    copied = {m["name"] for m in inside if tracks[m["tid"]].endswith("-> device")}
    invalidates = bool(forward) and all(t in copied for u in forward for t in units[u].tensors)
    return _Part(slots, legs, background, _busy(inside, tracks), this[0]["args"]["host_room"],
                 _miss_overheads(this, moves, tracks, units), invalidates,
                 _step_on_host(forward, [m for m in moves if m["ts"] >= since], end, tracks, units), updates, packs,
                 this[0]["args"]["iteration"])


def _updates(spans: list[dict], moves: list[dict], tracks: dict[int, str], since: float,
             this: list[dict], units: Mapping[str, Unit]) -> tuple[list[Update], set[int]]:
    """The overlapped step's updates between the previous iteration's last fetch and this
    iteration's backward, with their reads (the NVMe reads of a tensor of the block, "BLOCK.x",
    from the step until the last update ended); and the ids of those read events."""
    backward = min((e["ts"] for e in this if e["args"]["phase"] == FetchPhase.BACKWARD.value), default=float("inf"))
    ours = sorted((e for e in spans if since <= e["ts"] < backward and e["args"].get("overlapped")),
                  key=lambda e: e["ts"])
    if not ours:
        return [], set()
    last = max(e["ts"] + e["dur"] for e in ours)
    blocks = {e["args"]["block"] for e in ours}
    reads: dict[str, list[dict]] = {}
    for m in moves:
        if since <= m["ts"] < last and tracks[m["tid"]] == "nvme -> host":
            owner = m["name"].rpartition(".")[0]
            if owner in blocks:
                reads.setdefault(owner, []).append(m)
    out = []
    for e in ours:
        block = e["args"]["block"]
        mine = reads.get(block, [])
        tensors = units[block].tensors if block in units else ()
        out.append(Update(block, max(0.0, e["dur"] / 1e6 - e["args"].get("wait_s", 0.0)),
                          tuple(Leg("nvme", "host", m["args"]["bytes"], m["dur"] / 1e6) for m in mine),
                          any(m["name"] in tensors for m in mine)))
    return out, {id(m) for ms in reads.values() for m in ms}


def _step_on_host(forward: set[str], moves: list[dict], end: float, tracks: dict[int, str],
                  units: Mapping[str, Unit]) -> frozenset[str]:
    """The forward's units that the step before it updated and whose first copy to the device
    (before `end`) was not staged through an NVMe read of its own (a read of the tensor ending as
    the copy began). Updated: its tensors written home from the host from that step on; the
    write-back of a dirty unit comes whenever its worker gets to it, before or after the forward
    fetches it, even in a later iteration. `moves`: those from the step on."""
    def track(m: dict) -> str:
        return tracks[m["tid"]]
    written = {m["name"] for m in moves if track(m) == "host -> nvme"}
    reads = {}
    for m in moves:
        if track(m) == "nvme -> host":
            reads.setdefault(m["name"], []).append(m["ts"] + m["dur"])
    out = set()
    for name in forward:
        tensors = units[name].tensors
        firsts = [min((m for m in moves if m["name"] == t and track(m) == "host -> device" and m["ts"] < end),
                      key=lambda m: m["ts"], default=None) for t in tensors]
        if not tensors or not all(t in written for t in tensors) or None in firsts:
            continue
        if not any(abs(done - m["ts"]) < STAGED_GAP_US for m in firsts for done in reads.get(m["name"], ())):
            out.add(name)
    return frozenset(out)


def pack_block(tensor: str) -> str | None:
    """The block whose activation pack a moved tensor is ("BLOCK@N.activation", see
    runtime/activations.py), else None."""
    owner, _, kind = tensor.rpartition(".")
    block, at, _ = owner.rpartition("@")
    return block if kind == Kind.ACTIVATION.value and at else None


def _between_tiers(track: str) -> bool:
    """A move track names two different tiers (a trace from an older run may hold copies within one)."""
    src, _, dst = track.partition(" -> ")
    return bool(dst) and src != dst


def _busy(moves: list[dict], tracks: dict[int, str]) -> dict[tuple[str, str], tuple[int, float]]:
    """Per leg (src, dst): bytes and busy seconds (the union of its intervals)."""
    intervals: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for e in moves:
        src, _, dst = tracks[e["tid"]].partition(" -> ")
        intervals.setdefault((src, dst), []).append((e["ts"], e["ts"] + e["dur"], e["args"]["bytes"]))
    return {leg: (sum(n for _, _, n in ivs), busy_seconds([(a, b) for a, b, _ in ivs]) / 1e6)
            for leg, ivs in intervals.items()}


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals: the time at least one ran."""
    busy, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return busy


def _miss_overheads(slots: list[dict], moves: list[dict], tracks: dict[int, str],
                    units: Mapping[str, Unit]) -> list[float]:
    """For fetches that waited for a copy they started themselves (its first leg began after the
    fetch), the wait less the copy's legs: what a move costs beside its legs."""
    by_tensor: dict[str, list[dict]] = {}
    for m in moves:
        by_tensor.setdefault(m["name"], []).append(m)
    out = []
    for s in slots:
        a = s["args"]
        if a["stall_s"] <= 0:
            continue
        t0, t1 = s["ts"], s["ts"] + a["stall_s"] * 1e6
        legs = [m for t in units[a["unit"]].tensors for m in by_tensor.get(t, ())
                if t0 <= m["ts"] <= t1 and tracks[m["tid"]].endswith(("-> host", "-> device"))]
        if legs:
            out.append(a["stall_s"] - sum(m["dur"] for m in legs) / 1e6)
    return out
