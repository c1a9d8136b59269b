"""The tier model's replay of a recorded iteration, and `tierzero tune` end to end on a tiny GPT."""

from __future__ import annotations

import json
import statistics
from typing import Any

import pytest

from tierzero.cli import train
from tierzero.cli import tune
from tierzero.config.tiernames import Tier
from tierzero.prefetch.policies import Adaptive, Fetch, FetchPhase, Lookahead, NoPrefetch, TraceEvent, Unit
from tierzero.planning.recording import Leg, Recording, Slot, Update
from tierzero.planning import tier_model
from tierzero.planning.tier_model import Rate, TierModel, simulate

MS = 1e-3
BLOCK = 1000


def recording(compute_s: float = 10 * MS, device_blocks: int = 2) -> Recording:
    """Four NVMe-homed blocks, forward then backward, `compute_s` after each fetch."""
    names = ["b0", "b1", "b2", "b3"]
    events = [TraceEvent(FetchPhase.FORWARD, n) for n in names] + \
             [TraceEvent(FetchPhase.BACKWARD, n) for n in reversed(names)]
    slots = [Slot(ev, (), compute_s, 0.0, 0.0) for ev in events]
    units = {n: Unit(n, (f"{n}.param",), BLOCK, True) for n in names}
    return Recording(slots, units, [], [], {}, device_room=device_blocks * BLOCK, host_room=100 * BLOCK,
                     workers=2, io_threads=4, io_block_size=1 << 22, wraps=True, policy="none")


# A read of a block: 1 ms, its copy to the device: 0.1 ms, nothing else.
MODEL = TierModel({("nvme", "host"): Rate(MS / BLOCK), ("host", "nvme"): Rate(MS / BLOCK),
                   ("host", "device"): Rate(0.1 * MS / BLOCK), ("device", "host"): Rate(0.1 * MS / BLOCK)},
                  overhead_s=0.0, source="test")


def test_on_demand_fetches_wait_for_their_read_and_copy() -> None:
    p = simulate(recording(), NoPrefetch(), MODEL)
    # Every device copy is a miss that waits for its read and copy; the device keeps two blocks,
    # so the turns between forward and backward hit.
    assert 0 < p.copies < 8
    assert p.stall_s == pytest.approx(p.copies * 1.1 * MS)
    assert p.step_s == pytest.approx(8 * 10 * MS + p.stall_s)
    assert p.disk_s == pytest.approx(p.copies * MS)


def test_prefetching_hides_copies_while_compute_is_slower() -> None:
    assert simulate(recording(), Lookahead(1, nvme_depth=0), MODEL).stall_s == 0
    assert simulate(recording(), Adaptive(), MODEL).stall_s == 0


def test_faster_compute_needs_deeper_reads_and_the_disk_bounds_the_step() -> None:
    rec = recording(device_blocks=3)
    rec.host_room = 2 * BLOCK  # no room to keep blocks in host memory: reads every step
    shallow = simulate(rec, Lookahead(1, nvme_depth=0), MODEL, speedup=50)  # 0.2 ms of compute a fetch
    deep = simulate(rec, Lookahead(2, nvme_depth=4), MODEL, speedup=50)
    assert shallow.stall_s > deep.stall_s
    # The disk reads every block it brings: no step is shorter than its busy time.
    assert shallow.step_s >= shallow.disk_s == pytest.approx(2 * MS)
    assert simulate(rec, Adaptive(), MODEL, speedup=50).stall_s <= shallow.stall_s


def test_a_policy_cannot_put_the_model_over_its_rooms() -> None:
    class EverythingTwice(NoPrefetch):
        def plan(self, view):  # every unit, both tiers, every time
            return [Fetch(n, t) for n in view.units for t in (Tier.DEVICE, Tier.HOST)]

    rec = recording(device_blocks=2)
    rec.host_room = 2 * BLOCK
    p = simulate(rec, EverythingTwice(), MODEL, speedup=50)
    assert p.copies >= 4  # still trains through every block, within two blocks of room


class Everything(NoPrefetch):
    def plan(self, view):  # every unit to the device, every time
        return [Fetch(n, Tier.DEVICE) for n in view.units]


def updated(cpu_s: float) -> Recording:
    """Host-homed blocks whose overlapped-step updates each read three blocks' bytes from NVMe
    (3 ms) and compute `cpu_s`; the device keeps every block, the step invalidates its copies."""
    rec = recording(device_blocks=8)
    rec.units = {n: u._replace(nvme=False) for n, u in rec.units.items()}
    rec.step_invalidates = True
    rec.updates = [Update(n, cpu_s, (Leg("nvme", "host", BLOCK, MS),) * 3) for n in rec.units]
    return rec


def test_the_overlapped_steps_updates_race_the_forward() -> None:
    def replay(rec: Recording, policy: Any) -> Any:
        return tier_model._replay(rec, policy, MODEL, rec.workers, 1.0, 3)

    # Updates ahead of the forward: only the first block waits, for its reads (3 ms) and
    # update (5 ms); the next update's reads (its read-ahead) overlap it.
    sim, stall = replay(updated(5 * MS), NoPrefetch())[:2]
    assert sim.update_wait == pytest.approx(8 * MS) and stall == pytest.approx(8 * MS + 4 * 0.1 * MS)
    # Updates of 15 ms against 10 ms of compute: the first waits 18 ms, each next one 5 ms less
    # its copy's 0.1 ms (the compute before it began that much later).
    sim, stall = replay(updated(15 * MS), NoPrefetch())[:2]
    assert sim.update_wait == pytest.approx(18 * MS + 3 * 4.9 * MS) and stall == pytest.approx(33.1 * MS)
    # No block is copied to the device before its update ended, whatever the policy asks.
    assert replay(updated(15 * MS), Everything())[1] == pytest.approx(stall)


def test_predicted_update_waits_are_the_recorded_ones_plus_what_the_policy_adds() -> None:
    rec = updated(15 * MS)
    rec.slots = [s._replace(update_s=2 * MS) if s.event.phase is FetchPhase.FORWARD else s for s in rec.slots]
    # On demand, as recorded: the block fetches' copies, plus the recorded waits for the updates.
    assert simulate(rec, NoPrefetch(), MODEL).stall_s == pytest.approx(4 * 0.1 * MS + 4 * 2 * MS)
    # A policy reading the updated blocks ahead moves the updates' reads on the disk: its
    # predicted waits are the recorded ones plus what the replay finds it adds (the median over
    # disk rates within 2 %), never less than recorded.
    rec.units = {n: u._replace(nvme=True) for n, u in rec.units.items()}

    class ReadAll(NoPrefetch):
        def plan(self, view):
            return [Fetch(n, Tier.HOST) for n in view.units]

    def difference(policy: Any) -> float:  # over the disk rates within 2 % of the model's
        return statistics.median(
            tier_model._replay(rec, policy, tier_model._disk_scaled(MODEL, f), rec.workers, 1.0, 3)[0].update_wait
            - tier_model._replay(rec, NoPrefetch(), tier_model._disk_scaled(MODEL, f), rec.workers, 1.0, 3)[0].update_wait
            for f in tier_model.DISK_BAND)

    sim, stall = tier_model._replay(rec, ReadAll(), MODEL, rec.workers, 1.0, 3)[:2]
    assert difference(ReadAll()) == pytest.approx(-1 * MS)  # its reads ahead take the updates' reads' place
    # ... but a schedule only adds to the recorded waits: they are kept as recorded
    assert simulate(rec, ReadAll(), MODEL).stall_s == pytest.approx(stall - sim.update_wait + 4 * 2 * MS)
    rec.slots = [s._replace(update_s=0.0) for s in rec.slots]
    sim, stall = tier_model._replay(rec, ReadAll(), MODEL, rec.workers, 1.0, 3)[:2]
    assert simulate(rec, ReadAll(), MODEL).stall_s == pytest.approx(stall - sim.update_wait)


def test_an_update_that_read_the_blocks_parameters_leaves_them_on_the_host() -> None:
    rec = updated(5 * MS)
    rec.units = {n: u._replace(nvme=True) for n, u in rec.units.items()}
    read = simulate(rec, NoPrefetch(), MODEL)  # the forward reads each block again
    rec.updates = [u._replace(leaves_on_host=True) for u in rec.updates]
    kept = simulate(rec, NoPrefetch(), MODEL)
    assert kept.disk_s == pytest.approx(read.disk_s - 4 * MS) and kept.stall_s < read.stall_s


def test_update_reads_compete_with_the_policys_reads_for_the_disk() -> None:
    rec = updated(5 * MS)
    rec.units = {n: u._replace(nvme=True) for n, u in rec.units.items()}
    alone = simulate(rec, NoPrefetch(), MODEL)
    rec.updates = []  # the same on-demand reads without the updates' 12 ms of reads on the disk
    assert simulate(rec, NoPrefetch(), MODEL).disk_s == pytest.approx(alone.disk_s - 12 * MS)


def test_calibration_from_busy_time_and_bench_io_threads() -> None:
    rec = recording()
    rec.busy = {("nvme", "host"): (4 * BLOCK, 8 * MS), ("host", "device"): (8 * BLOCK, 0.8 * MS)}
    rec.miss_overheads = [0.3 * MS, 0.1 * MS, 0.2 * MS]
    model = TierModel.calibrate(rec)
    assert model.leg_seconds("nvme", "host", BLOCK) == pytest.approx(2 * MS)
    assert model.leg_seconds("host", "device", BLOCK) == pytest.approx(0.1 * MS)
    assert model.overhead_s == pytest.approx(0.2 * MS)
    bench = {"engine": [{"op": "read", "threads": t, "block_size": 1 << 22, "gbps": g} for t, g in ((2, 1.0), (4, 2.0))]
             + [{"op": "write", "threads": 8, "block_size": 1 << 22, "gbps": 9.0}]}
    # Recorded with 2 workers reading one piece each (blocks are smaller than io pieces): 2 at once.
    assert TierModel.calibrate(rec, bench, io_threads=8).leg_seconds("nvme", "host", BLOCK) == pytest.approx(2 * MS)
    faster = TierModel.calibrate(rec, bench, io_threads=8, workers=6)  # nearest measured: 4 at once
    assert faster.leg_seconds("nvme", "host", BLOCK) == pytest.approx(1 * MS)
    slower = TierModel.calibrate(rec, bench, io_threads=1, workers=6)  # nearest measured: 2 at once
    assert slower.leg_seconds("nvme", "host", BLOCK) == pytest.approx(2 * MS)
    with pytest.raises(ValueError, match="no engine read results"):
        TierModel.calibrate(rec, {"engine": []}, io_threads=8, workers=6)


# ------------------------------------------------------------------------------ the command


def tiny_args(tmp_path: Any, *extra: str) -> list[str]:
    return ["--model", "tiny", "--n-layer", "3", "--device-budget", "2MiB", "--host-budget", "64MiB",
            "--nvme-dir", str(tmp_path / "nvme"), "--params", "nvme", "--grads", "host",
            "--optimizer-states", "host", "--batch", "2", "--seq", "32", "--no-progress", *extra]


def test_tune_runs_candidates_and_picks_the_least_stall(tmp_path: Any, capsys: Any) -> None:
    rc = tune.main(tiny_args(tmp_path, "--steps", "2", "--policies", "none,lookahead:1,bytes:1GiB",
                             "--nvme-depths", "0", "--io-threads", "2", "--json"))
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    *rows, refused = report["candidates"]
    assert "prefetch reserve" in refused["error"] and refused["stall_s"] is None
    assert [(r["policy"], r["settings"]) for r in rows] == [
        ("none", {"nvme_depth": 0, "io_threads": 2}), ("lookahead", {"depth": 1, "nvme_depth": 0, "io_threads": 2})]
    for r in rows:
        assert r["stall_s"] >= 0 and r["step_s"] > 0 and r["predicted_stall_s"] >= 0
        assert len(r["stall_s_each"]) == 2
    assert report["best"] in rows
    least = min(rows, key=lambda r: r["stall_s"])
    noise = max(0.005, *((r["stall_range_s"][1] - r["stall_range_s"][0]) / 2 for r in (least, report["best"])))
    assert report["best"]["stall_s"] - least["stall_s"] <= noise  # within noise of the least stall
    equivalent = [r for r in rows if r.get("equivalent_to_best")]
    assert report["best"] == equivalent[0]  # the simplest of them (none first)
    assert 'policy = "' + report["best"]["policy"] + '"' in report["snippets"]["toml"]
    assert report["wall_s"] > 0 and report["peak_rss_bytes"] > 0
    for r in rows:  # each measured candidate predicted again at the disk rates of its own run
        if "measured_disk_gbps" in r:
            assert r["measured_disk_gbps"]["read"] > 0 and r["predicted_stall_at_its_disk_rate_s"] >= 0
            # one per measured step: the closing step makes the last one replayable too
            assert len(r["measured_disk_gbps_each"]) == len(r["predicted_stall_at_its_disk_rate_each_s"]) == 2


def test_kept_traces_are_the_recordings_and_each_measured_candidates_and_replay(tmp_path: Any, capsys: Any) -> None:
    keep = tmp_path / "traces"
    assert tune.main(tiny_args(tmp_path, "--steps", "2", "--policies", "none,lookahead:1", "--nvme-depths", "0",
                               "--io-threads", "2", "--measure-top", "1", "--keep-traces", str(keep), "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    measured = [r for r in report["candidates"] if r["stall_s"] is not None]
    names = sorted(p.name for p in keep.iterdir())
    assert len(measured) == 1 and len(names) == 3
    assert names[1:] == ["recording-after.json", "recording-before.json"]
    assert names[0].startswith(f"candidate-{measured[0]['policy']}-")
    assert tune.main(["--simulate", "--trace", str(keep / "recording-before.json"), "--policies", "none",
                      "--nvme-depths", "0", "--io-threads", "2", "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["candidates"][0]["predicted_stall_s"] >= 0


def test_a_candidate_is_predicted_again_at_the_disk_rate_its_own_run_had(tmp_path: Any, capsys: Any) -> None:
    """A shared disk's rate drifts: a candidate measured while the disk ran at half the recording's
    rate is predicted again at that rate, so the model's own error shows apart from the drift.
    The rates come from the candidate's trace as the tier model calibrates them."""
    run = tmp_path / "run"
    assert train.main(["--model", "tiny", "--steps", "4", "--batch", "2", "--seq", "32", "--device-budget", "4MiB",
                       "--host-budget", "8MiB", "--nvme-dir", str(tmp_path / "nvme"), "--run-dir", str(run),
                       "--no-progress"]) == 0
    capsys.readouterr()
    trace = json.loads((run / "trace.json").read_text())
    rec = Recording.from_trace(trace)
    each = tune.disk_rates(trace)
    assert [step for step, _ in each] == [1, 2]  # of 4 steps, those with a step before and after
    busy = Recording.disk_rates_each(trace)
    for step, rates in each:  # iterations are numbered from 1
        assert set(rates) == {("nvme", "host"), ("host", "nvme")}
        nbytes, seconds = busy[step + 1][("nvme", "host")]
        assert rates[("nvme", "host")] == Rate(seconds / nbytes)
    assert tune.disk_rates(trace, since_step=2) == each[1:]  # the measured steps only
    assert tune.disk_rates({"traceEvents": []}) == []  # nothing to calibrate from: no figure
    c = tune.Candidate("none", None, 0, 2)
    args = tune.parser().parse_args(["--trace", str(run / "trace.json")])
    recorded = {leg: Rate(rec.busy[leg][1] / rec.busy[leg][0]) for leg in (("nvme", "host"), ("host", "nvme"))}
    at_recording = tune._predict(c, rec, None, args, None, [recorded])
    assert at_recording["predicted_stall_at_its_disk_rate_s"] == pytest.approx(at_recording["predicted_stall_s"])
    slower = {leg: Rate(r.seconds_per_byte * 2) for leg, r in recorded.items()}
    at_half = tune._predict(c, rec, None, args, None, [slower])
    assert at_half["predicted_stall_s"] == at_recording["predicted_stall_s"]
    assert at_half["predicted_stall_at_its_disk_rate_s"] > at_recording["predicted_stall_s"]
    # one step at each rate: a prediction per step, and their median
    both = tune._predict(c, rec, None, args, None, [recorded, slower])
    assert both["predicted_stall_at_its_disk_rate_each_s"] == [at_recording["predicted_stall_at_its_disk_rate_s"],
                                                               at_half["predicted_stall_at_its_disk_rate_s"]]
    assert both["predicted_stall_at_its_disk_rate_s"] == pytest.approx(
        statistics.mean(both["predicted_stall_at_its_disk_rate_each_s"]), abs=1e-5)


def test_simulate_replays_a_run_folders_trace(tmp_path: Any, capsys: Any) -> None:
    run = tmp_path / "run"
    assert train.main(["--model", "tiny", "--steps", "4", "--batch", "2", "--seq", "32", "--device-budget", "1MiB",
                       "--host-budget", "64MiB", "--nvme-dir", str(tmp_path / "nvme"), "--run-dir", str(run),
                       "--no-progress"]) == 0
    capsys.readouterr()
    rec = Recording.load(run)
    assert [s.event.unit for s in rec.slots][:2] == ["root", "blocks.0"] and rec.compute_s > 0
    # The parameters live on NVMe; the step rewrote them in host memory, where the forward found them.
    assert rec.step_invalidates and rec.step_on_host == set(rec.units)
    # The overlapped step updated every block before the forward, in the forward's order.
    forward = [s.event.unit for s in rec.slots if s.event.phase is FetchPhase.FORWARD]
    assert [u.block for u in rec.updates] == forward and all(u.cpu_s > 0 for u in rec.updates)
    assert tune.main(["--simulate", "--trace", str(run), "--compute-speedup", "50", "--policies",
                      "none,adaptive", "--nvme-depths", "4", "--io-threads", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "predictions for compute 50x faster" in out and "<- chosen" in out and "[prefetch]" in out


@pytest.mark.parametrize("argv,match", [
    (["--simulate"], "--model is required"),
    (["--model", "huge"], "expected a built-in model"),
    (["--model", "tiny", "--policies", "sometimes"], "unknown policy 'sometimes'"),
    (["--model", "tiny", "--policies", "lookahead"], "lookahead:DEPTH"),
    (["--model", "tiny", "--warmup", "1"], "--warmup: expected >= 2"),
    (["--model", "tiny", "--compute-speedup", "0"], "--compute-speedup: expected a number > 0"),
    (["--simulate", "--trace", "no/such/run"], "expected a trace.json or a run folder"),
    (["--model", "tiny", "--keep-traces", "tests"], "expected a new or empty folder"),
    (["--model", "tiny", "--keep-traces", "no/such/parent/traces"], "its parent folder does not exist"),
])
def test_bad_flags_are_refused(argv: list[str], match: str, capsys: Any) -> None:
    assert tune.main(argv + ["--no-progress"]) == 2
    assert match in capsys.readouterr().err


def test_bad_list_flags_are_usage_errors(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        tune.main(["--model", "tiny", "--io-threads", "0"])
    assert "expected ints >= 1" in capsys.readouterr().err


def test_measure_top_measures_only_the_best_predicted_and_tears_each_down(tmp_path: Any, capsys: Any,
                                                                          monkeypatch: Any) -> None:
    """--measure-top 1: every candidate predicted, one measured; each candidate's run leaves no
    placement manager open and its model collected before the next one starts."""
    import gc
    import weakref

    from tierzero.placement.storage import swap_dirs

    models: list[weakref.ref] = []
    real_run = tune.Trainer.run

    def run(self: Any, cfg: Any, steps: int, step_done: Any) -> Any:
        assert not [m for m in models if m() is not None], "a model of an earlier run is still alive"
        assert not list(swap_dirs._OPEN), "a placement manager of an earlier run is still open"
        real_wrap = tune.tz.wrap
        monkeypatch.setattr(tune.tz, "wrap", lambda m, *a, **k: models.append(weakref.ref(m)) or real_wrap(m, *a, **k))
        try:
            return real_run(self, cfg, steps, step_done)
        finally:
            monkeypatch.setattr(tune.tz, "wrap", real_wrap)

    monkeypatch.setattr(tune.Trainer, "run", run)
    rc = tune.main(tiny_args(tmp_path, "--steps", "2", "--policies", "none,lookahead:1,lookahead:2",
                             "--nvme-depths", "0", "--io-threads", "2", "--measure-top", "1", "--json"))
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    measured = [r for r in report["candidates"] if r["stall_s"] is not None]
    assert len(measured) == 1 and all(r["predicted_stall_s"] is not None for r in report["candidates"])
    gc.collect()
    assert len(models) == 3 and not [m for m in models if m() is not None]  # 2 recordings + 1 candidate
    assert not list(swap_dirs._OPEN)


def test_blocks_the_step_left_on_the_host_are_copied_without_a_read() -> None:
    rec = recording()
    rec.step_invalidates = True
    cold = simulate(rec, NoPrefetch(), MODEL)
    rec.step_on_host = frozenset(rec.units)
    warm = simulate(rec, NoPrefetch(), MODEL)
    assert warm.disk_s == 0 < cold.disk_s
    assert warm.copies == cold.copies and warm.stall_s == pytest.approx(warm.copies * 0.1 * MS)


def test_host_copies_the_step_left_are_given_up_where_backwards_gradients_take_the_host_room() -> None:
    """The step leaves every block's parameters in host memory; in backward the gradients take
    the host room (recorded at each fetch), and the runtime's placement manager evicts those
    cached copies for them, so the last blocks of backward are read from NVMe again."""
    rec = recording()
    rec.step_invalidates = True
    rec.step_on_host = frozenset(rec.units)
    roomy = simulate(rec, NoPrefetch(), MODEL)
    assert roomy.disk_s == 0  # backward copies b1 and b0 from their host copies
    rec.slots = [s._replace(host_room=0) if s.event.phase is FetchPhase.BACKWARD else s for s in rec.slots]
    full = simulate(rec, NoPrefetch(), MODEL)
    # b3 and b2 are still on the device (two blocks of room); b1 and b0 are read, 1 ms each
    assert full.disk_s == pytest.approx(2 * MS)
    assert full.stall_s == pytest.approx(roomy.stall_s + 2 * MS)
    # In the forward the copies the step rewrote are not the host room's: the recorded room
    # counts clean cached copies only, and a dirty one is not evicted before it is written home.
    rec.slots = [s._replace(host_room=0) for s in rec.slots]
    assert simulate(rec, NoPrefetch(), MODEL).stall_s == pytest.approx(full.stall_s)


def test_the_recorded_waits_for_room_are_added_whatever_the_policy() -> None:
    """The recording's waits for room are waits for the step's own buffers to go (gradients on
    their way home): fetched ahead or on demand, someone waits for them ([Note: waits for room no
    schedule removes]), so they are added as recorded, once, also where the replay finds no room."""
    rec = recording()
    rec.slots = [s._replace(host_room=0) if s.event.phase is FetchPhase.BACKWARD else s for s in rec.slots]
    without = {p: simulate(rec, p(), MODEL).stall_s for p in (NoPrefetch, Everything)}
    rec.slots = [s._replace(room_s=5 * MS) if s.event.phase is FetchPhase.BACKWARD else s for s in rec.slots]
    for p, stall in without.items():
        assert simulate(rec, p(), MODEL).stall_s == pytest.approx(stall + 4 * 5 * MS), p


def test_update_waits_at_a_slower_disk_are_moved_from_the_recordings_own_replay() -> None:
    """The recorded waits for the updates happened at the recording's disk rate; a candidate
    predicted at the slower disk its own run had waits longer by what the replay at that rate
    adds over the replay at the recorded rate (with one model for both, the drift cancels)."""
    rec = updated(5 * MS)
    rec.slots = [s._replace(update_s=2 * MS) if s.event.phase is FetchPhase.FORWARD else s for s in rec.slots]
    slow = TierModel({**MODEL.rates, ("nvme", "host"): Rate(4 * MS / BLOCK)}, overhead_s=0.0, source="test")
    same = simulate(rec, NoPrefetch(), slow)
    moved = simulate(rec, NoPrefetch(), slow, recorded_model=MODEL)
    at_slow = tier_model._replay(rec, NoPrefetch(), slow, rec.workers, 1.0, 3)[0].update_wait
    at_recorded = tier_model._replay(rec, NoPrefetch(), MODEL, rec.workers, 1.0, 3)[0].update_wait
    assert at_slow > at_recorded
    assert same.stall_s == pytest.approx(4 * 0.1 * MS + 4 * 2 * MS)  # the recorded waits, as recorded
    assert moved.stall_s == pytest.approx(same.stall_s + at_slow - at_recorded)


def test_tune_places_activations_as_train_does(tmp_path: Any, capsys: Any) -> None:
    """--activations nvme: every run places its activations there (the last block's kept on the
    device, a copy within one tier that the recording leaves out)."""
    rc = tune.main(tiny_args(tmp_path, "--device-budget", "16MiB", "--activations", "nvme", "--steps", "2",
                             "--policies", "none,lookahead:1", "--nvme-depths", "0", "--io-threads", "2",
                             "--measure-top", "1", "--json"))
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["activations"] == "nvme"
    assert sum(r["stall_s"] is not None for r in report["candidates"]) == 1


def test_io_thread_counts_get_the_disk_rate_a_sweep_of_the_nvme_folder_measured(tmp_path: Any, capsys: Any,
                                                                              monkeypatch: Any) -> None:
    """Without --bench-io, tune sweeps the NVMe folder at each --io-threads count after the first
    recording, and each count's prediction takes the disk rate measured at it; the sweep's file
    is gone after it."""
    swept = []
    real_sweep = tune._disk_sweep

    def sweep(args: Any, trainer: Any) -> Any:
        bench = real_sweep(args, trainer)
        swept.append(bench)
        assert [p.name for p in (tmp_path / "nvme").iterdir() if p.name.startswith(".io_engine")] == []
        return bench

    monkeypatch.setattr(tune, "_disk_sweep", sweep)
    rc = tune.main(tiny_args(tmp_path, "--policies", "none", "--nvme-depths", "2", "--io-threads", "1,2",
                             "--simulate", "--json"))
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    (bench,) = swept
    reads = {r["threads"]: r["gbps"] for r in bench["engine"] if r["op"] == "read"}
    assert set(reads) == {1, 2} and len([r for r in bench["engine"] if r["op"] == "read"]) == 2 * tune.DISK_SWEEP_REPEAT
    one, two = report["candidates"]
    # the recording read with the first count (1): its own rate; 2 threads: scaled by the sweep
    assert one["model"]["disk_rate_from"] == "the recording"
    assert "scaled by bench-io" in two["model"]["disk_rate_from"]
    ratio = two["model"]["disk_read_gbps"] / one["model"]["disk_read_gbps"]
    at = statistics.mean(r["gbps"] for r in bench["engine"] if r["op"] == "read" and r["threads"] == 1)
    to = statistics.mean(r["gbps"] for r in bench["engine"] if r["op"] == "read" and r["threads"] == 2)
    # the report rounds each rate to 1 MB/s: on a slow (shared) disk that alone moves the ratio
    rounding = 0.0005 * (1 / one["model"]["disk_read_gbps"] + ratio / one["model"]["disk_read_gbps"])
    assert ratio == pytest.approx(to / at, rel=0.01, abs=rounding)


def test_one_io_thread_count_needs_no_sweep(tmp_path: Any, capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(tune.bench, "measure", lambda *a, **k: pytest.fail("swept the disk for one io thread count"))
    assert tune.main(tiny_args(tmp_path, "--policies", "none", "--nvme-depths", "2", "--io-threads", "2",
                               "--simulate", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["candidates"][0]["model"]["disk_rate_from"] == "the recording"


def test_backwards_packs_on_nvme_ride_with_the_block_fetches_ahead() -> None:
    """Activation packs homed on NVMe: backward waits for each block's pack. On demand every
    pack is read and copied when backward reaches it; a policy fetching blocks ahead brings
    their packs along, and read-ahead (nvme_depth) brings the next packs into host memory. A
    recording without packs adds their recorded waits as they were."""
    rec = recording(device_blocks=4)
    rec.slots = [s._replace(pack_s=2 * MS) if s.event.phase is FetchPhase.BACKWARD else s for s in rec.slots]
    as_recorded = simulate(rec, NoPrefetch(), MODEL).stall_s
    rec.packs = {n: BLOCK for n in rec.units}
    sim, blocks = tier_model._replay(rec, NoPrefetch(), MODEL, rec.workers, 1.0, 3)[:2]
    rec.packs = {}
    no_packs = tier_model._replay(rec, NoPrefetch(), MODEL, rec.workers, 1.0, 3)[1]
    assert as_recorded == pytest.approx(no_packs + 4 * 2 * MS)  # the recorded waits, as they were
    rec.packs = {n: BLOCK for n in rec.units}
    # On demand: each of the four packs is read (1 ms) and copied (0.1 ms) when backward needs it.
    assert blocks == pytest.approx(no_packs + 4 * 1.1 * MS)
    assert simulate(rec, NoPrefetch(), MODEL).stall_s == pytest.approx(blocks)
    # Blocks fetched one ahead bring their packs: only the first block of backward waits for its
    # own, read behind the pack of the block after it (fetched ahead first, as the runtime does).
    assert simulate(rec, Lookahead(1, nvme_depth=0), MODEL).stall_s == pytest.approx(2.1 * MS)
    # Packs read ahead into host memory wait only for their copies, but for the first.
    assert simulate(rec, NoPrefetch(), MODEL, nvme_depth=2).stall_s == pytest.approx(no_packs + 1.1 * MS + 3 * 0.1 * MS)


def test_the_device_room_early_capture_took_at_a_fetch_is_not_the_replays_to_give_packs() -> None:
    """A recording names, per fetch, the device bytes early capture's buffers (and activations
    homed on the device) took then (`Slot.device_beside`): the replay's device room is the
    recording's less those. Beside a block and its pack in use, with two blocks' worth taken, a
    block fetched ahead brings no pack, and every pack waits as when fetching on demand."""
    rec = recording(device_blocks=4)
    rec.packs = {n: BLOCK for n in rec.units}
    free = simulate(rec, Lookahead(1, nvme_depth=0), MODEL).stall_s
    on_demand = simulate(rec, NoPrefetch(), MODEL).stall_s
    assert free == pytest.approx(2.1 * MS) and on_demand == pytest.approx(4 * 1.1 * MS)
    stalls = []
    for beside in (BLOCK, 2 * BLOCK):
        rec.slots = [s._replace(device_beside=beside) if s.event.phase is FetchPhase.BACKWARD else s
                     for s in rec.slots]
        stalls.append(simulate(rec, Lookahead(1, nvme_depth=0), MODEL).stall_s)
        assert simulate(rec, NoPrefetch(), MODEL).stall_s == pytest.approx(on_demand)
    assert free < stalls[0] < on_demand and stalls[1] == pytest.approx(on_demand)


def test_a_recording_of_placed_activations_names_the_packs_backward_read_back(tmp_path: Any, capsys: Any) -> None:
    run = tmp_path / "run"
    assert train.main(["--model", "tiny", "--steps", "4", "--batch", "2", "--seq", "32", "--device-budget", "2MiB",
                       "--host-budget", "64MiB", "--nvme-dir", str(tmp_path / "nvme"), "--run-dir", str(run),
                       "--activations", "nvme", "--no-progress"]) == 0
    capsys.readouterr()
    trace = json.loads((run / "trace.json").read_text())
    rec = Recording.from_trace(trace)
    assert rec.packs and set(rec.packs) <= set(rec.units) and all(n > 0 for n in rec.packs.values())
    fetches = [e for e in trace["traceEvents"] if e.get("cat") == "activations" and e["name"].startswith("fetch ")]
    assert {e["name"].removeprefix("fetch ") for e in fetches if e["args"]["tier"] == "nvme"} >= set(rec.packs)
    # their waits are the slots' pack_s, not their other stalls, and only backward has them
    assert all(s.pack_s == 0 for s in rec.slots if s.event.phase is FetchPhase.FORWARD)
    # the packs' reads and copies to the device are the replay's, not background
    sizes = set(rec.packs.values())
    assert not any(b.leg.nbytes in sizes and b.leg.dst in ("host", "device") for b in rec.background)
    assert any(b.leg.nbytes in sizes and b.leg.dst == "nvme" for b in rec.background)  # their writes are
    assert simulate(rec, Lookahead(1, nvme_depth=2), TierModel.calibrate(rec), nvme_depth=2).stall_s >= 0
    spans = [e for e in trace["traceEvents"] if e.get("cat") == "blocks"]
    assert spans and all(isinstance(e["args"]["device_beside"], int) for e in spans)
