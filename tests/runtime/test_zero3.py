"""ZeRO-3 across data-parallel ranks on gloo: parity with one process, 1/N tiers per rank, failure.

World sizes 2 and 3 train a GPT with uneven sizes (width 60, vocabulary 257), tied weights, a
frozen parameter inside a block and a frozen embedding, parameters and optimizer states on
NVMe, each rank on its slice of the same global batch; every step's global loss must equal plain
PyTorch on the whole batch in one process, and the final parameters hold tests/exactness.py's
bound (as exact as plain PyTorch data parallel in fp32, against a float64 run). The tiers of each rank
must hold about 1/N of what the same run holds in one process. A rank that is killed, stopped
(SIGSTOP: only the collective timeout can notice) or raises mid-training must make the other
rank exit with an error naming its rank within 60 s, not hang.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from exactness import assert_data_parallel_exact
from pairs import clipped_step
from tierzero.formats.corpus import VOCAB_SIZE
from tierzero.planning.estimates import estimate
from tierzero.models import build
from tierzero.config.tiernames import Tier
from dp_model import GLOBAL_BATCH, STEPS, device_budget, global_batches, make_model
from gloo import run_ranks


def train_rank(rank: int, world_size: int, out_dir: str) -> None:
    """One rank of a tierzero run (world size 1 runs in the caller's process); writes
    out_dir/rank{rank}.pt with its losses, tier bytes and (rank 0) the full state dict."""
    model = make_model()
    model.register_buffer("tag", torch.full((3,), float(rank + 1)))  # broadcast from rank 0 at wrap
    # The step inline: the counts of all-gathers started ahead below are exact only then (under the
    # overlapped step a block still updating is gathered on demand, as timing has it; that step
    # at world 2 is checked in tests/runtime/test_fast_paths.py).
    cfg = tz.Config(device_budget=device_budget(model, world_size), host_budget="64MiB",
                    nvme_dir=os.path.join(out_dir, "nvme"), nvme_budget="64MiB", params="nvme",
                    optimizer_states="nvme", grads="host", compute_dtype="float32", overlap_step=False)
    tz.wrap(model, cfg)
    assert torch.equal(model.tag, torch.ones(3)), f"rank {rank}: buffer not broadcast: {model.tag}"
    pm = runtime.placement_manager(model)
    assert os.path.isdir(os.path.join(out_dir, "nvme", f"rank{rank}")), "swap files not under nvme_dir/rank{r}"
    opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    losses, norms = [], []
    for x, y in global_batches():
        loss, norm = clipped_step(model, opt, model(x[rows], y[rows]).loss, 0.5, world_size)
        losses.append(loss)
        norms.append(norm)
    # state_dict works on every rank (a gather) and loads back into the shards
    sd = model.state_dict()
    model.load_state_dict(sd)
    full = tz.full_state_dict(model)
    homes = {t.value: sum(h.nbytes for h in pm.handles if h.home is t) for t in Tier}
    result = {"losses": losses, "norms": norms, "home_bytes": homes,
              "nvme_used": pm.bytes_used("nvme"), "device_peak": pm.peak_bytes("device"),
              "device_budget": pm.budget("device"), "full_keys": sorted(full),
              "state_dict_keys": sorted(sd), "gathered": dataclasses.asdict(runtime.state_of(model).ctx.gathers.counts)}
    model(x[rows], y[rows]).loss.backward()  # torch's clipping: p.grad stands for this rank's shard only
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    except ValueError as e:
        result["torch_clip"] = str(e)
    opt.zero_grad()
    torch.save({"result": result, "state": full}, os.path.join(out_dir, f"rank{rank}.pt"))
    runtime.close(model)


def reference(world_size: int = 1, dtype: torch.dtype = torch.float32
              ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, one process, the model in `dtype`: the whole global batch (world size 1),
    or each of `world_size` ranks' rows backpropagated in turn and their gradients summed and
    divided by the ranks (data parallel, in one process)."""
    model = make_model().to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)
    losses, norms = [], []
    for x, y in global_batches():
        total, summed = 0.0, [None] * len(params)
        for r in range(world_size):
            rows = slice(r * GLOBAL_BATCH // world_size, (r + 1) * GLOBAL_BATCH // world_size)
            loss = model(x[rows], y[rows]).loss
            loss.backward()
            total += loss.item() / world_size
            for i, p in enumerate(params):
                summed[i] = p.grad if summed[i] is None else summed[i] + p.grad
                p.grad = None
        for p, g in zip(params, summed):
            p.grad = g / world_size
        norms.append(torch.nn.utils.clip_grad_norm_(params, 0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, model.state_dict()


def run_world(tmp_path: Path, world_size: int) -> list[dict[str, Any]]:
    out = tmp_path / f"world{world_size}"
    out.mkdir()
    run_ranks(train_rank, world_size, tmp_path / f"init{world_size}", str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_world(tmp_path_factory.mktemp("zero3"), 1)[0]["result"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_and_tier_bytes(tmp_path: Path, world_size: int, one_process: dict[str, Any]) -> None:
    ranks = run_world(tmp_path, world_size)
    ref_losses, ref_norms, ref_state = reference()
    keys = sorted([*ref_state, "tag"])
    for r, entry in enumerate(ranks):
        res = entry["result"]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"rank {r}: per-step global losses: {m}")
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0,
                                   msg=lambda m: f"rank {r}: global gradient norms: {m}")
        assert res["device_peak"] <= res["device_budget"], (r, res["device_peak"], res["device_budget"])
        assert res["state_dict_keys"] == keys, r
        assert f"rank {r} of {world_size}" in res["torch_clip"] and "tz.clip_grad_norm_" in res["torch_clip"], res
        # After the first step records the trace, the prefetcher starts the all-gathers ahead (the
        # last block keeps its gathered copy from forward to backward): of 16 flat-tensor fetches
        # a step, only the root's 2 at the start of forward are left on demand.
        gathered = res["gathered"]
        assert gathered == {"ahead": 14 * (STEPS - 1), "on_demand": 16 + 2 * (STEPS - 1)}, (r, gathered)
        # each rank holds ~1/N of the one-process state (padding to N x 16 elements per flat tensor)
        for tier in ("host", "nvme"):
            whole = one_process["home_bytes"][tier]
            assert whole > 0, tier
            share = res["home_bytes"][tier] * world_size / whole
            assert 1.0 <= share < 1.02, f"rank {r}: {tier} holds {share:.4f} x 1/{world_size} of one process"
        share = res["nvme_used"] * world_size / one_process["nvme_used"]
        assert 0.95 < share < 1.25, f"rank {r}: swap extents {share:.3f} x 1/{world_size} of one process"
    assert ranks[0]["result"]["full_keys"] == keys
    assert all(e["result"]["full_keys"] == [] for e in ranks[1:]), "full_state_dict is for rank 0 only"
    state = ranks[0]["state"]
    assert torch.equal(state["tag"], torch.ones(3)), state["tag"]
    # against a float64 run and plain PyTorch data parallel: tests/exactness.py
    ratio = assert_data_parallel_exact(
        state, one_process=ref_state, data_parallel=reference(world_size)[2],
        exact=reference(dtype=torch.float64)[2], what=f"world {world_size}")
    largest = max((state[k] - r).abs().max().item() for k, r in ref_state.items())
    print(f"world {world_size}: largest difference to the one-process run {largest:.2e}; distance from exact "
          f"arithmetic at most {ratio:.2f}x plain PyTorch's")


# ------------------------------------------------------------------ tierzero train, several ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, world_size: int, steps: int, *extra: str) -> list[subprocess.Popen]:
    """`tierzero train` processes with the environment torchrun gives its workers."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
        cmd = [sys.executable, "-m", "tierzero.cli", "train", "--model", "tiny", "--steps", str(steps),
               "--batch", "4", "--seq", "32", "--nvme-dir", str(tmp_path / "nvme"),
               "--run-dir", str(tmp_path / "run"), "--no-progress", *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_train_cli_two_ranks(tmp_path: Path) -> None:
    """Two ranks of `tierzero train` at ZeRO stage 2 with bf16 gradients (the other tests here
    launch the default, stage 3): a complete run folder, and metrics.jsonl's comm_bytes per step
    are the traffic model's (reduce-scatter of bf16 gradients, all-gather of the updated fp32
    parameters; padding and the 4-byte norm all-reduce aside)."""
    procs = _launch(tmp_path, 2, 3, "--zero-stage", "2", "--grad-dtype", "bfloat16")
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        _kill_all(procs)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    model = build("tiny", device="meta", vocab_size=VOCAB_SIZE, seq_len=32)
    cfg = tz.Config(zero_stage=2, grad_dtype="bfloat16", compute_dtype="float32")
    model_comm = estimate(model, cfg, 2).comm
    psi = sum(p.numel() for p in model.parameters())
    assert model_comm is not None and model_comm.as_dict() == {"all_gather": 4 * psi, "reduce_scatter": 2 * psi,
                                                               "all_reduce": 0}
    for row in rows:
        comm = row["comm_bytes"]
        assert comm["all_reduce"] == 4, comm  # the clip's fp32 norm
        for kind in ("all_gather", "reduce_scatter"):
            # The all-gather of a step's updated parameters runs under the next step's forward (the
            # overlapped step): the first step's row has none, each later row the step before's.
            expected = 0 if kind == "all_gather" and row["step"] == 0 else getattr(model_comm, kind)
            assert expected <= comm[kind] <= 1.02 * expected, comm
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["zero_stage"] == 2 and summary["config"]["grad_dtype"] == "bfloat16"
    assert summary["world_size"] == 2 and len(summary["peak_bytes_per_rank"]) == 2
    for peaks in summary["peak_bytes_per_rank"]:
        assert all(0 < peaks[t] <= summary["budgets"][t] for t in ("device", "host", "nvme")), peaks
    assert os.listdir(tmp_path / "nvme") == []  # each rank removed its swap files and its rank folder
    assert json.loads(outs[0][0])["final_loss"] == summary["final_loss"] and outs[1][0].strip() == ""


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_lost_rank_stops_the_others(tmp_path: Path, how: str) -> None:
    """SIGKILL closes rank 1's sockets; SIGSTOP leaves them open, so only the collective
    timeout (10 s here) can end rank 0's wait."""
    procs = _launch(tmp_path, 2, 100000, "--collective-timeout", "10")
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
            assert time.monotonic() < deadline, "training did not start within 90 s"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        lost = time.monotonic()
        try:
            _, err = procs[0].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still runs 60 s after rank 1 was {how}")
        elapsed = time.monotonic() - lost
    finally:
        _kill_all(procs)
    assert procs[0].returncode != 0, err[-3000:]
    assert "rank 0:" in err, err[-3000:]
    print(f"rank 0 exited {elapsed:.1f} s after rank 1 was {how}, rc={procs[0].returncode}")


RAISING_RANK = """
import datetime, sys, torch, torch.distributed as dist
import tierzero as tz
from tierzero.models import GPT, GPTConfig
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
model = tz.wrap(GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)),
                tz.Config(device_budget="64MiB", host_budget="64MiB"))
opt = tz.AdamW(model)
for step in range(100000):
    if dist.get_rank() == 1 and step == 3:
        raise ValueError("rank 1 fails on purpose")
    x = torch.randint(0, 64, (2, 16))
    model(x, x).loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_raising_rank_stops_the_others() -> None:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RAISING_RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                  MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join(sys.path)))
             for r in range(2)]
    try:
        t0 = time.monotonic()
        errs = [p.communicate(timeout=90)[1] for p in procs]
        elapsed = time.monotonic() - t0
    finally:
        _kill_all(procs)
    assert procs[1].returncode != 0 and "rank 1 fails on purpose" in errs[1], errs[1][-2000:]
    assert procs[0].returncode != 0, errs[0][-2000:]
    # the surviving rank fails in one of tierzero's collectives, with its rank in the message
    assert "RuntimeError: rank 0: " in errs[0] and "failed" in errs[0], errs[0][-3000:]
    assert elapsed < 60, elapsed
