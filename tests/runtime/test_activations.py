"""Placed activations (Config.activations) and tierzero's activation checkpointing: the same
losses and parameters, bit for bit, as the same run with activations left on the device, on the
built-in GPT (uneven shapes, a tied weight, a frozen parameter, a block called twice), on
transformers Llama and GPT-2 (their own checkpointing on too) and on 2 ranks at ZeRO stages 1, 2
and 3; budgets kept, bytes counted by tier, fetched ahead of backward by the prefetcher, nothing
left registered, and clear errors."""

from __future__ import annotations

from collections import Counter
import dataclasses
import gc
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tierzero as tz
from tierzero import runtime
from tierzero.config import Tier
from tierzero.planning import least_budgets
from tierzero.placement import Kind, Residency, TensorHandle
import builders
import hf_models
from gloo import run_ranks

STEPS = 2
PLACED = [("host", False), ("nvme", False), ("auto", False), ("device", True), ("nvme", True), ("auto", True)]


def gpt() -> nn.Module:
    model = builders.gpt(seq=24, layers=3)
    model.blocks[1].ln_1.weight.requires_grad_(False)
    return model


class Twice(nn.Module):
    """Its middle layer runs twice per step: two calls of one block, two packs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(53, 20)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(20), nn.Linear(20, 36), nn.GELU(), nn.Linear(36, 20))
                                    for _ in range(3))
        self.head = nn.Linear(20, 53)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i in (0, 1, 1, 2):
            x = x + self.layers[i](x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def batches(vocab: int, n: int = STEPS, rows: int = 2, seq: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(model, Twice):
        return model(x, x)
    if hasattr(model, "config") and hasattr(model.config, "use_cache"):  # transformers
        return model(input_ids=x, labels=x, use_cache=False).loss
    return model(x, x).loss


def train(make: Callable[[], nn.Module], cfg: tz.Config, xs: list[torch.Tensor],
          ) -> tuple[list[float], dict[str, torch.Tensor], list[dict[str, int]], nn.Module]:
    """Train a fresh model (AdamW, clipping, the overlapped step); its losses, master weights,
    activation bytes per step; the model (closed)."""
    torch.manual_seed(0)
    model = tz.wrap(make(), cfg)
    try:
        opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
        losses, placed = [], []
        for x in xs:
            loss = loss_of(model, x)
            loss.backward()
            tz.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            placed.append(runtime.step_stats(model).activation_bytes)
        weights = builders.master_weights(model)
        state = runtime.state_of(model)
        state.activations.collect(wait=True)
        assert not [h.name for h in state.pm.handles if h.kind is Kind.ACTIVATION]
        for t in ("device", "host", "nvme"):
            assert state.pm.peak_bytes(t) <= state.pm.budget(t), t
        return losses, weights, placed, model
    finally:
        runtime.close(model)


def config(tmp_path: Path, name: str, **kw: Any) -> tz.Config:
    return builders.tier_config(tmp_path / name, tier="nvme", **{"device_budget": "2MiB", **kw})


def assert_same(got: tuple, want: tuple, what: str) -> None:
    assert got[0] == want[0], f"{what}: losses {got[0]} vs {want[0]}"
    builders.assert_state_equal(got[1], want[1], what)


@pytest.mark.parametrize("make,placed", [(gpt, PLACED), (Twice, [("nvme", False), ("nvme", True)])],
                         ids=["gpt", "twice"])
def test_placed_activations_train_bit_for_bit_as_on_the_device(tmp_path: Path, make: Callable[[], nn.Module],
                                                               placed: list[tuple[str, bool]]) -> None:
    vocab = 257 if make is gpt else 53
    xs = batches(vocab)
    want = train(make, config(tmp_path, "device"), xs)
    for acts, ckpt in placed:
        got = train(make, config(tmp_path, f"{acts}{ckpt}", activations=acts, activation_checkpointing=ckpt), xs)
        assert_same(got, want, f"{acts}, checkpointing={ckpt}")
        for step, placed in enumerate(got[2]):
            device_only = want[2][step]["device"]  # everything, counted on the device
            if acts in ("host", "nvme"):
                assert placed[acts] > 0 and placed["device"] < device_only, (acts, placed)
            if ckpt:  # only the blocks' inputs are kept: less in all than without checkpointing
                assert sum(placed.values()) < device_only, placed


@pytest.mark.parametrize("kind", ["llama-tied", "gpt2"])
def test_transformers_models_with_their_own_checkpointing_on_or_off(tmp_path: Path, kind: str) -> None:
    cls, hf_config = hf_models.MODELS[kind]()

    def make(own: bool = False) -> nn.Module:
        model = hf_models.build(cls, hf_config).train()
        if own:
            model.activation_checkpointing_enable()
        return model

    xs = hf_models.token_batches(hf_config.vocab_size, n=STEPS)
    want = train(make, config(tmp_path, "device"), xs)
    for acts, ckpt in [("nvme", False), ("auto", True)]:
        got = train(make, config(tmp_path, f"{acts}{ckpt}", activations=acts, activation_checkpointing=ckpt), xs)
        assert_same(got, want, f"{kind} {acts} checkpointing={ckpt}")
    with pytest.warns(UserWarning, match="checkpoints its own layers"):
        got = train(lambda: make(own=True), config(tmp_path, "own", activations="nvme"), xs)
    assert_same(got, want, f"{kind} with its own gradient checkpointing and activations on nvme")


class _Drifting(nn.Module):
    """A layer whose forward depends on how often it ran: its recompute saves other shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x).sin() if self.calls % 2 else self.lin(x).sin().flatten(0)[:-1].sin().sum() + x


def _ranks_main(rank: int, world_size: int, folder: str) -> None:
    cls, hf_config = hf_models.MODELS["llama-untied"]()
    xs = [x[rank::world_size] for x in hf_models.token_batches(hf_config.vocab_size, n=STEPS, rows=4)]
    (Path(folder) / f"r{rank}").mkdir()
    for stage in (1, 2, 3):
        def cfg(name: str, **kw: Any) -> tz.Config:
            return config(Path(folder) / f"r{rank}", f"{stage}{name}", zero_stage=stage, **kw)

        want = train(lambda: hf_models.build(cls, hf_config).train(), cfg("device"), xs)
        for acts, ckpt in [("nvme", True)] + ([("nvme", False)] if stage == 3 else []):
            got = train(lambda: hf_models.build(cls, hf_config).train(),
                        cfg(f"{acts}{ckpt}", activations=acts, activation_checkpointing=ckpt), xs)
            assert_same(got, want, f"rank {rank}, stage {stage}, {acts} checkpointing={ckpt}")


def test_two_ranks_at_zero_stages_1_2_3(tmp_path: Path) -> None:
    hf_models.hf()
    run_ranks(_ranks_main, 2, tmp_path / "init", str(tmp_path))


def test_activations_come_back_ahead_of_backward(tmp_path: Path) -> None:
    """From the second step on, the prefetcher's fetch of each block ahead of its backward also
    started its activations' copy to the device; with policy "none" each one waits, but for the
    last block's: the trace says its backward comes next, so they stay on the device."""
    for policy, ahead in (("lookahead", [True, True, True]), ("none", [True, False, False])):
        model = tz.wrap(gpt(), config(tmp_path, policy, activations="nvme", prefetch=tz.PrefetchConfig(policy=policy)))
        try:
            pm = runtime.placement_manager(model)
            for i, x in enumerate(batches(257)):
                start = len(pm.telemetry.spans)
                loss_of(model, x).backward()
            fetches = [s for s in list(pm.telemetry.spans)[start:] if s.track == "activations"
                       and s.name.startswith("fetch")]
            assert [s.name for s in fetches] == ["fetch blocks.2", "fetch blocks.1", "fetch blocks.0"]
            assert [s.args["ahead"] for s in fetches] == ahead, [(s.name, s.args) for s in fetches]
            assert [s.args["tier"] for s in fetches] == ["device", "nvme", "nvme"]
            moves = {(m.src, m.dst) for m in pm.telemetry.moves if m.tensor.endswith(".activation")}
            assert {("device", "host"), ("host", "nvme"), ("host", "device")} <= moves, moves
        finally:
            runtime.close(model)


def test_auto_keeps_what_fits_on_the_device_and_spills_first_what_backward_needs_last(tmp_path: Path) -> None:
    model = tz.wrap(gpt(), config(tmp_path, "auto", activations="auto", device_budget="1536KiB"))
    try:
        pm = runtime.placement_manager(model)
        for x in batches(257, rows=3):
            start = len(pm.telemetry.spans)
            loss_of(model, x).backward()
            placed = runtime.step_stats(model).activation_bytes
            tiers = {s.name: s.args["tier"] for s in list(pm.telemetry.spans)[start:] if s.track == "activations"
                     and s.name.startswith("fetch")}
            assert placed["device"] > 0 and placed["host"] > 0, placed
            assert pm.peak_bytes(Tier.DEVICE) <= pm.budget(Tier.DEVICE)
        # planned from the step before: the last blocks (backward's first) stay, the first spills
        assert tiers["fetch blocks.2"] == "device" and tiers["fetch blocks.0"] == "host", tiers
    finally:
        runtime.close(model)


@pytest.mark.parametrize("mode", ["nvme", "auto"])
def test_backward_leaves_no_device_buffers_of_the_packs_sizes_cached(tmp_path: Path, mode: str) -> None:
    """The packs' device copies freed in backward go back to the system, not to the device
    pool's cache: the next forward would hold them for nothing (on the CPU, process memory)."""
    model = tz.wrap(gpt(), config(tmp_path, mode, activations=mode, device_budget="1536KiB"))
    try:
        pm = runtime.placement_manager(model)
        for x in batches(257, rows=3):
            start = len(pm.telemetry.spans)
            loss_of(model, x).backward()
            sizes = {s.args["bytes"] for s in list(pm.telemetry.spans)[start:] if s.track == "activations"
                     and s.name.startswith("fetch")}
            assert len(sizes) == 1, sizes  # the blocks are alike: their packs too
            assert pm.room.trim(Tier.DEVICE, sizes) == 0
    finally:
        runtime.close(model)


def test_a_graph_dropped_without_backward_leaves_nothing_placed(tmp_path: Path) -> None:
    model = tz.wrap(gpt(), config(tmp_path, "drop", activations="nvme", activation_checkpointing=True))
    try:
        state = runtime.state_of(model)
        loss = loss_of(model, batches(257)[0])
        assert [h for h in state.pm.handles if h.kind is Kind.ACTIVATION]
        del loss
        gc.collect()
        state.activations.collect(wait=True)
        assert not [h for h in state.pm.handles if h.kind is Kind.ACTIVATION]
    finally:
        runtime.close(model)


def test_budgets_too_small_for_the_activations_are_clear_errors(tmp_path: Path) -> None:
    model = tz.wrap(gpt(), config(tmp_path, "dev", activations="nvme", device_budget="600KiB"))
    try:
        with pytest.raises(ValueError, match=r"activations that block 'blocks.0' saved .* raise device_budget to at "
                                             r"least \d+ bytes"):
            loss_of(model, batches(257, rows=6)[0])
    finally:
        runtime.close(model)
    # 1 MiB, or the plan's least where the host is one pinned region (the asynchronous stand-in's
    # windows): wrap accepts it, the activations do not fit. In the pinned region the activations
    # taken first leave a later fetch's staging no window: that refusal names the host budget too.
    model = gpt()
    cfg = config(tmp_path, "host", activations="host", host_budget="1MiB")
    cfg = dataclasses.replace(cfg, host_budget=max(cfg.host_budget, least_budgets(model, cfg)["host"]))
    pinned = cfg.stream_settings().mode == "async"
    model = tz.wrap(model, cfg)
    try:
        with pytest.raises((ValueError, RuntimeError) if pinned else ValueError,
                           match=r"raise host_budget to at least \d+" if pinned
                           else "raise host_budget.*activation_checkpointing=True"):
            loss_of(model, batches(257, rows=6)[0])
    finally:
        runtime.close(model)


class _Exp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(self.lin(x))  # exp saves its output
        y.add_(1.0)  # ... which this changes: autograd's error in backward
        return y


@pytest.mark.parametrize("layer,kw,match", [
    (_Drifting, dict(activations="nvme", activation_checkpointing=True),
     "recomputed '0.1' and it saved .* where its forward saved"),
    (_Exp, dict(activations="host"), "modified by an inplace operation"),
], ids=["recompute-differs", "changed-in-place"])
def test_what_autograd_would_refuse_is_refused(tmp_path: Path, layer: type, kw: dict, match: str) -> None:
    """A recompute that saves other shapes than its forward, and a saved tensor changed in place
    before backward: errors in backward, as torch's determinism check and autograd make them."""
    model = tz.wrap(nn.Sequential(nn.Sequential(layer(), layer())), config(tmp_path, "bad", **kw))
    try:
        loss = model(torch.randn(3, 8)).sum()
        with pytest.raises(RuntimeError, match=match):
            loss.backward()
    finally:
        runtime.close(model)


def test_no_pack_is_read_back_during_the_forward_that_wrote_it(tmp_path: Path) -> None:
    """The NVMe read-ahead of packs serves the backward: during the forward the packs written so
    far are needed last, and reading them then only takes the disk from the step's updates and
    host room from the blocks (they were pushed out and read again). A host budget too small to
    keep the packs' host copies, so that they are read from NVMe (1.25 MiB: what a block's
    update needs in the stand-in's one pinned region, [Note: working set windows])."""
    cfg = config(tmp_path, "small", activations="nvme", host_budget="1.25MiB",
                 prefetch=tz.PrefetchConfig(policy="lookahead", depth=1, nvme_depth=8))
    model = tz.wrap(builders.gpt(seq=24, layers=6), cfg)
    try:
        pm = runtime.placement_manager(model)
        opt = tz.AdamW(model, lr=1e-3)
        for x in batches(257, n=3):
            began = time.perf_counter()
            loss = loss_of(model, x)
            forward_ended = time.perf_counter()
            loss.backward()
            opt.step()
            opt.zero_grad()
            early = [m.tensor for m in list(pm.telemetry.moves) if m.tensor.endswith(".activation")
                     and (m.src, m.dst) == ("nvme", "host") and began <= m.start < forward_ended]
            assert not early, early
        assert any(m.tensor.endswith(".activation") and m.src == "nvme" for m in pm.telemetry.moves)  # read back
    finally:
        runtime.close(model)


def test_backward_reads_no_pack_into_host_memory_that_is_on_its_way_to_the_device(tmp_path: Path) -> None:
    """A pack on its way to the device (fetched ahead with its block) is not read into host
    memory again by the read-ahead of the next packs: on the built-in 350m a second read of 67
    MB queued before the next block's pack (the one backward then waited for)."""
    cfg = config(tmp_path, "small", activations="nvme", host_budget="2MiB",
                 prefetch=tz.PrefetchConfig(policy="lookahead", depth=1, nvme_depth=8))
    model = tz.wrap(builders.gpt(seq=24, layers=6), cfg)
    try:
        pm = runtime.placement_manager(model)
        asked, prefetch = [], pm.prefetch

        def spy(handles: Any, tier: Any = Tier.DEVICE, **kw: Any) -> bool:
            for x in (handles,) if isinstance(handles, TensorHandle) else handles:
                h, at = (x, tier) if isinstance(x, TensorHandle) else x  # a handle, or (handle, tier)
                if h.name.count("@") and Tier(at) is Tier.HOST:
                    asked.append((h.name, pm.record(h).residency[Tier.DEVICE]))
            return prefetch(handles, tier, **kw)

        pm.prefetch = spy
        opt = tz.AdamW(model, lr=1e-3)
        for x in batches(257, n=3):
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
        assert asked, "no pack was read ahead"
        assert all(r is Residency.ABSENT for _, r in asked), [a for a in asked if a[1] is not Residency.ABSENT]
    finally:
        runtime.close(model)


def test_packs_brought_ahead_count_against_the_device_room_so_none_is_pushed_out_before_use(tmp_path: Path) -> None:
    """A policy bringing many blocks ahead (bytes) is asked again at every fetch; the packs it
    brought before are on the device and not used yet, so their room is taken. Counted as free,
    every call brought more, the blocks' fetches pushed them out, and backward brought them
    again (here 6 of 11 packs copied to the device two or three times a step; built-in 350m: 16
    of 24 packs read from NVMe again, 1.0 s of waits a step). Each pack now comes once.

    The policy's device plans are clipped to the room beside those packs too, so the blocks'
    own fetches do not push them out (without that, under the asynchronous stand-in 3 of the 11
    packs still came twice). Under the stand-in one pack still comes twice a step: at the
    forward's end the packs of blocks that backward reaches late are brought first (they are
    written first), and the pack of a nearer block, acquired on demand, pushes one out. So only
    the synchronous run asserts the outcome."""
    cfg = config(tmp_path, "bytes", activations="nvme", host_budget="4MiB",
                 prefetch=tz.PrefetchConfig(policy="bytes", reserve="1200KiB", nvme_depth=2))
    model = tz.wrap(builders.gpt(seq=64, layers=12), cfg)
    try:
        pm = runtime.placement_manager(model)
        opt = tz.AdamW(model, lr=1e-3)
        for step, x in enumerate(batches(257, n=3)):
            t0 = time.perf_counter()
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
            if step > 0:  # (the first backward follows no trace)
                to_device = Counter(m.tensor for m in pm.telemetry.moves_since(t0) if "@" in m.tensor
                                    and m.dst == "device")
                assert len(to_device) >= 10, to_device  # backward found its packs through the device
                if not pm.streams.asynchronous:
                    assert max(to_device.values()) == 1, to_device
    finally:
        runtime.close(model)
