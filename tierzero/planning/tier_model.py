"""A model of the tiers that replays a recorded iteration under any prefetch policy, without IO:
`simulate` predicts a candidate's stall and step from a `Recording` (recording.py), at the rates
of a `TierModel` (tier_rates.py), by a `Replay` (replay.py) of three iterations, the last one
measured. Stalls the recording saw outside block fetches are added as they were (no policy
changes them). `tierzero tune` prints predictions beside measured figures so the model's error
is visible.
"""

from __future__ import annotations

import dataclasses
import statistics

from tierzero.planning.recording import Background, Recording, busy_seconds
from tierzero.planning.replay import Prediction, Replay
from tierzero.planning.tier_rates import CHANNELS, Rate, TierModel, read_concurrency
from tierzero.prefetch import NoPrefetch, PrefetchPolicy


# [Note: update waits as a difference] The replayed updates are slower than the real ones by what
# the replay leaves out of them (one update's reads run concurrently, the disk sweep's rate is
# above the rate its busy time gives: a replayed update is measurably slower than the real one),
# so a candidate's waits for the updates are predicted as the recorded waits plus
# the difference between its replay and the replay of the recorded setting (on demand, the
# recording's workers): what is left out cancels, what the candidate changes (its reads in the
# updates' way, its workers) remains. Predicted at rates other than the recording's (a candidate's
# own run, where the shared disk slowed down), the recorded setting's replay stays at the
# recording's rates (`recorded_model`): the waits then move by what the slower disk adds to the
# updates (a shared disk can lose much of its rate within one run, and the updates' waits grow
# many times over); with one model for both replays that drift would cancel. The
# replay's update waits jump at thresholds (an update's read queued before or after a fetch's
# read, and the updates after it late by that read): a disk a fraction of a percent slower can
# more than double the on-demand replay's waits. So the difference is the median of those at disk rates within 2 % of the model's
# (`DISK_BAND`); a real disk's rate varies more than that from step to step anyway. And it only
# adds: a schedule puts reads in the updates' way, it does not take away the reads the recorded
# run had there (measured: the updates' waits were those of fetching on demand within noise for
# every candidate where the disk held its rate); a replay whose on-demand setting
# waited longer (past a threshold, as above) predicted waits that no run had. A
# recording without the "updates" track (an older trace) adds the recorded waits as they were.
#
# [Note: waits for room no schedule removes] The recording's waits for room (`Slot.room_s`, the
# "room" stall source of its fetches) are added as recorded, as the other stalls are: they are
# waits for the step's own buffers to go (dirty gradients written home one at a time as the host
# budget fills in backward), and a schedule only moves who waits. Fetching on demand, the
# fetches of the last blocks wait for a gradient's write-back; fetched ahead, the block's room is
# taken sooner and the gradient stored after it waits instead: measured, the "room" stall a step
# is about the same for every policy (in fetches or after them). The replay does not wait for it again
# where it finds no room.


def simulate(rec: Recording, policy: PrefetchPolicy, model: TierModel, *, workers: int | None = None,
             speedup: float = 1.0, iterations: int = 3, nvme_depth: int | None = None,
             recorded_model: TierModel | None = None, as_recorded: Recording | None = None) -> Prediction:
    """Replay `rec` under `policy` (see the module docstring); the last iteration's figures.
    `nvme_depth`: packs read ahead at each fetch of backward (None: the recording's).
    `recorded_model`: the rates the recording ran at, where `model` has others (a disk that
    slowed down): the recorded setting's replay for the update waits is made at those.
    `as_recorded`: the recording as it ran, where `rec` is changed from it (the updates' reads of
    another split, `split_tuning.with_split`): the recorded setting's replay is of it."""
    if speedup <= 0:
        raise ValueError(f"speedup: expected > 0, got {speedup}")
    depth = rec.nvme_depth if nvme_depth is None else nvme_depth
    sim, stall, step, disk, copies = _replay(rec, policy, model, workers or rec.workers, speedup, iterations, depth)
    other = sum(s.other_stall_s + s.room_s + (0.0 if sim.packs else s.pack_s) for s in rec.slots)
    recorded = sum(s.update_s for s in rec.slots)
    if sim.updates:  # see [Note: update waits as a difference]
        diffs = []
        for f in DISK_BAND:
            cand = sim if f == 1.0 else _replay(rec, policy, _disk_scaled(model, f), workers or rec.workers, speedup,
                                                iterations, depth)[0]
            base = _replay(as_recorded or rec, NoPrefetch(), _disk_scaled(recorded_model or model, f), rec.workers, speedup,
                           iterations, rec.nvme_depth)[0]
            diffs.append(cand.update_wait - base.update_wait)
        waits = recorded + max(0.0, statistics.median(diffs))
        stall += waits - sim.update_wait
        step += waits - sim.update_wait
    else:  # the replay's clock went on by them where they were recorded
        other += recorded
    return Prediction(stall + other, step, disk, copies)


DISK_BAND = (0.98, 0.99, 1.0, 1.01, 1.02)
"""Disk rates (factors of the model's) the update waits' difference is taken over, its median:
see [Note: update waits as a difference]."""


def _disk_scaled(model: TierModel, factor: float) -> TierModel:
    """`model` with the disk's reads and writes `factor` times as fast."""
    return dataclasses.replace(model, rates={leg: Rate(r.seconds_per_byte / factor, r.latency_s) if "nvme" in leg else r
                                             for leg, r in model.rates.items()})


def _replay(rec: Recording, policy: PrefetchPolicy, model: TierModel, workers: int, speedup: float,
            iterations: int, nvme_depth: int = 0) -> tuple[Replay, float, float, float, int]:
    """The last of `iterations` replayed: the replay, its block stall (backward's waits for
    the packs it replays included), step, disk busy seconds, device copies (the stall without
    the recorded other stalls, and without updates to replay, without the recorded waits for
    them)."""
    sim = Replay(rec, policy, model, workers, speedup, nvme_depth)
    background: dict[int, list[Background]] = {}
    for b in rec.background:
        background.setdefault(b.pos, []).append(b)
    stall = 0.0
    for _ in range(iterations):
        start, disk0, copies0 = sim.now, len(sim.disk), sim.device_copies
        stall = sim.iteration(background)
    return sim, stall, sim.now - start, busy_seconds(sim.disk[disk0:]), sim.device_copies - copies0


__all__ = ["CHANNELS", "Rate", "TierModel", "Prediction", "simulate", "read_concurrency"]

