"""NVMe traffic: counted per step by kind, and kept to what a step needs (issue: the step at the
disk's limit). Byte counts come from the swap files' own reads and writes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from tierzero.config.config import Config
from tierzero.placement.handles import Kind
from tierzero.models import GPT
from tierzero.placement.manager import PlacementManager
from tierzero.placement.residency import Residency
from tierzero.config.tiernames import Tier
from tierzero.planning.traffic import DriveRates, rates_from_bench, step_traffic
import builders


def pm_for(tmp_path: Any) -> PlacementManager:
    cfg = Config(device_budget="64KiB", host_budget="64KiB", nvme_dir=str(tmp_path / "nvme"), nvme_budget="1MiB")
    return PlacementManager(cfg, wait_timeout_s=0.3)


def test_overwrite_acquire_reads_nothing_and_a_clean_release_drops_the_copy(tmp_path: Any) -> None:
    data = torch.arange(1024, dtype=torch.float32)
    with pm_for(tmp_path) as pm:
        h = pm.register("g", data, "nvme", kind=Kind.GRAD)
        pm.flush()
        pm.telemetry.reset_step()
        buf = pm.acquire(h, "host", overwrite=True)
        assert pm.telemetry.reset_step().nvme_read_bytes == 0
        buf.fill_(7.0)  # the caller fails before it is done: released clean
        pm.release(h, "host")
        assert pm.record(h).residency[Tier.HOST] is Residency.ABSENT  # the half-written copy is gone
        assert torch.equal(pm.read(h), data)
        buf = pm.acquire(h, "host", overwrite=True)
        buf.copy_(-data)
        pm.release(h, "host", dirty=True)
        pm.flush()
        stats = pm.telemetry.reset_step()
        assert stats.nvme_by_kind["grads"] == {"read": data.nbytes, "write": data.nbytes}  # pm.read's, and the write
        assert stats.nvme_read_bytes == data.nbytes and stats.nvme_write_bytes == data.nbytes
        assert torch.equal(pm.read(h), -data)
        assert 0 < stats.nvme_busy_s


def gpt() -> GPT:
    return builders.gpt(seq=32, layers=8, width=64, seed=None)


@pytest.mark.parametrize("step_in_backward,host,overlap", [
    (False, "2600KiB", False), (False, "2600KiB", True), (False, "16MiB", True), (True, "3500KiB", True)],
    ids=["clip-spill", "clip-spill-overlapped", "clip-roomy", "step_in_backward"])
def test_step_traffic_by_kind(tmp_path: Any, step_in_backward: bool, host: str, overlap: bool) -> None:
    """Everything on NVMe; a host budget of 2600 KiB (a little under the 3.05 MiB `tierzero
    estimate` asks) cannot keep every gradient until the step, 16 MiB keeps everything.
    step_in_backward gets 3500 KiB: its updates run on a thread beside backward, whose own reads
    compete for the room, and at 2600 KiB a loaded machine's timing can push a block's state
    out before its update reads it (read twice: more bytes, the same results). Per step the
    moments are read at most and written exactly once, the parameters written once; a gradient
    is written to NVMe only when the host budget cannot keep it until the step (never with
    room, never with step_in_backward) and read back at most once (clipping reads none: its
    norms come from backward). With the step inline the 2600 KiB run always spills a gradient;
    overlapped under the next forward, whether one is pushed out depends on when the updates
    run, so there it may or may not."""
    torch.manual_seed(0)
    model = gpt()
    n_params = sum(p.numel() for p in model.parameters())
    cfg = tz.Config(device_budget="2MiB", host_budget=host, nvme_dir=str(tmp_path), params="nvme",
                    grads="nvme", optimizer_states="nvme", compute_dtype="float32",
                    step_in_backward=step_in_backward, overlap_step=overlap)
    tz.wrap(model, cfg)
    try:
        opt = tz.AdamW(model, lr=1e-3)
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            x = torch.randint(0, 257, (2, 32), generator=g)
            model(x, x).loss.backward()
            if not step_in_backward:
                tz.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            runtime.settle(model)  # this step's updates (overlapped by default) and writes are in its traffic
            stats = runtime.step_stats(model)
        pm = runtime.placement_manager(model)
        io = {kind: sum(h.io_bytes for h in pm.handles if h.kind is kind) for kind in Kind}
        assert io[Kind.PARAM] >= 4 * n_params  # fp32, padded to whole pages
        by_kind = stats.nvme_by_kind
        assert stats.nvme_read_bytes == sum(v["read"] for v in by_kind.values())
        assert stats.nvme_write_bytes == sum(v["write"] for v in by_kind.values())
        moments = io[Kind.EXP_AVG] + io[Kind.EXP_AVG_SQ]
        # The step reads the block after next ahead speculatively; on a loaded machine the
        # update before it can push that copy out first, and it is read again: one block's
        # moments at most (measured: 1 run in 10 under two CPU hogs, on main before this bound too).
        block_moments = 2 * max(h.io_bytes for h in pm.handles if h.kind is Kind.EXP_AVG)
        assert by_kind["moments"]["write"] == moments and by_kind["moments"]["read"] <= moments + block_moments
        assert by_kind["params"]["write"] == io[Kind.PARAM]  # the updated parameters (= master weights), once
        assert by_kind["params"]["read"] <= 3 * io[Kind.PARAM]  # forward, backward, the step at most
        grads = by_kind["grads"]
        if step_in_backward or host == "16MiB":
            assert grads == {"read": 0, "write": 0}
        else:
            assert overlap or grads["write"] > 0, grads
            assert grads["write"] <= io[Kind.GRAD] and grads["read"] <= grads["write"]
    finally:
        runtime.close(model)


# ------------------------------------------------------------------------ the least traffic, the floor

@pytest.mark.parametrize("placement,sib,per_param", [
    (dict(params="nvme", grads="nvme", optimizer_states="nvme", compute_dtype="float32"), False, 40),
    (dict(params="nvme", grads="nvme", optimizer_states="nvme", compute_dtype="float32"), True, 28),
    (dict(params="host", grads="host", optimizer_states="nvme", compute_dtype="float32"), False, 24),
    (dict(params="nvme", grads="host", optimizer_states="nvme", compute_dtype="bfloat16"), False, 6 + 24),
    (dict(params="host", grads="host", optimizer_states="host", compute_dtype="float32"), False, 0),
])
def test_step_traffic_by_placement(tmp_path: Any, placement: dict, sib: bool, per_param: int) -> None:
    # params read for forward and backward and written once; grads written and read once;
    # master (or the fp32 params that double as it: read by the step unless backward's copy
    # serves it) and moments read and written once
    n = 1000
    t = step_traffic(n, Config(nvme_dir=str(tmp_path), step_in_backward=sib, **placement))
    assert t.read + t.write == per_param * n
    assert step_traffic(n, Config(nvme_dir=str(tmp_path), step_in_backward=sib, **placement),
                        world_size=4).write == t.write // 4


@pytest.mark.parametrize("k", [1, 4])
def test_step_traffic_of_micro_batches(tmp_path: Any, k: int) -> None:
    # layer by layer (tz.accumulate) the parameters are read twice a step whatever k; the plain
    # loop reads them 2k times and reads and writes the stored gradient once per micro-batch
    cfg = Config(nvme_dir=str(tmp_path), params="nvme", grads="nvme", optimizer_states="nvme", compute_dtype="float32")
    n = 1000
    one = step_traffic(n, cfg)
    assert step_traffic(n, cfg, micro_batches=k).by_kind == one.by_kind
    plain = step_traffic(n, cfg, micro_batches=k, layer_major=False).by_kind
    assert plain["params"]["read"] - one.by_kind["params"]["read"] == 2 * 4 * n * (k - 1)
    assert plain["grads"] == {"read": 4 * n * k, "write": 4 * n * k}


def test_drive_rates_from_a_bench_io_file_and_flags(tmp_path: Any) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"summary": {"engine_read_gbps": 3.5, "engine_write_gbps": 2.0}}))
    rates = rates_from_bench(bench)
    assert rates.floor_s(3.5e9, 1e9) == pytest.approx(1.5)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a `tierzero bench-io --json` result"):
        rates_from_bench(bad)
    with pytest.raises(FileNotFoundError, match="bench-io --dir"):
        rates_from_bench(tmp_path / "none.json")
    with pytest.raises(ValueError, match="positive"):
        DriveRates(0.0, 1.0, "flags")


def test_estimate_prints_the_step_traffic_and_its_floor(tmp_path: Any, capsys: Any) -> None:
    from tierzero.cli import main

    args = ["estimate", "--model", "tiny", "--nvme-dir", str(tmp_path), "--params", "nvme"]
    assert main([*args, "--json", "--read-gbps", "2", "--write-gbps", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    step = out["nvme_step_bytes"]
    assert step["read"] + step["write"] == pytest.approx(out["nvme_bytes_per_param"]["total"] * out["params"])
    assert out["nvme_floor_s"] == pytest.approx(step["read"] / 2e9 + step["write"] / 1e9)
    assert main(args) == 0
    assert "NVMe floor: give --bench-io FILE" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--read-gbps", "2"])
    assert "--read-gbps and --write-gbps go together" in capsys.readouterr().err


def test_train_summary_holds_step_over_floor(tmp_path: Any) -> None:
    from tierzero.cli import train

    assert train.main(["--model", "tiny", "--steps", "3", "--batch", "2", "--seq", "32", "--device-budget", "4MiB",
                       "--host-budget", "8MiB", "--no-progress", "--nvme-dir", str(tmp_path / "nvme"),
                       "--run-dir", str(tmp_path / "run"), "--read-gbps", "2", "--write-gbps", "1"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    nvme = json.loads((tmp_path / "run" / "summary.json").read_text())["nvme"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for r in rows:
        assert r["nvme_read_bytes"] == sum(v["read"] for v in r["nvme_bytes"].values())
        assert r["nvme_write_bytes"] == sum(v["write"] for v in r["nvme_bytes"].values())
        assert r["nvme_read_bytes"] > 0 and r["nvme_busy_s"] > 0  # 13 MB of state, 12 MiB of budgets
    # the overlapped step's updates write beside the next step; the wrap's writes are no row's
    assert all(r["nvme_write_bytes"] > 0 for r in rows[1:])
    # busy time is counted between two rows' resets, from the first step's start: within the
    # run's wall time on any machine (the wrap's writes, slower under load, are not counted)
    assert sum(r["nvme_busy_s"] for r in rows) <= summary["wall_s"]
    assert nvme["steps_measured"] == 2
    assert nvme["read_bytes"] == pytest.approx((rows[1]["nvme_read_bytes"] + rows[2]["nvme_read_bytes"]) / 2)
    assert nvme["floor_s"] == pytest.approx(nvme["read_bytes"] / 2e9 + nvme["write_bytes"] / 1e9)
    assert nvme["step_over_floor"] == pytest.approx(nvme["step_s"] / nvme["floor_s"])


def test_train_step_in_backward_needs_clip_off(tmp_path: Any, capsys: Any) -> None:
    from tierzero.cli import train

    assert train.main(["--model", "tiny", "--steps", "1", "--step-in-backward", "--run-dir", str(tmp_path)]) == 2
    assert "give --clip 0 with it" in capsys.readouterr().err


def test_estimate_predicts_the_step_floor_of_a_split(tmp_path: Any, capsys: Any) -> None:
    """The split `tierzero estimate` is given: its predicted step floor from its NVMe traffic,
    smaller for a smaller NVMe share."""
    from tierzero.cli import main

    floors = {}
    for states in ("host=0.5,nvme=0.5", "nvme"):
        args = ["estimate", "--model", "tiny", "--nvme-dir", str(tmp_path), "--optimizer-states", states,
                "--read-gbps", "2", "--write-gbps", "1"]
        assert main([*args, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        floors[states] = out["predicted_step_floor_s"]
        step = out["nvme_expected_step_bytes"]["most"]
        assert floors[states]["most"] == pytest.approx(step["read"] / 2e9 + step["write"] / 1e9)
        assert 0 < floors[states]["fewest"] <= floors[states]["most"]
        assert main(args) == 0
        text = capsys.readouterr().out
        assert "predicted step floor for this placement (its NVMe traffic alone" in text
        assert f"compute is not in it): {floors[states]['fewest']:.2f} s" in text and "give --trace RUN" in text
    assert floors["host=0.5,nvme=0.5"]["most"] < floors["nvme"]["most"]
