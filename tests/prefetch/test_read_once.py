"""The default prefetch policy never reads a block of a frozen base on NVMe twice in one pass
(read ahead, evicted, read again before its use), and a step reads no more of it than
Lookahead does (issue 43). A tiny LoRA over a bf16 base on NVMe, with host room below the base
and device + host room above it; Adaptive is shown the times of a slow disk (each copy ten
times what it took), so that it plans as far ahead as the rooms allow, as over a 1B base."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from tierzero.hf import meta_model
from tierzero.planning import flat_tensors, least_budgets
from tierzero.prefetch import policies
import builders

peft = pytest.importorskip("peft")
STEPS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builders.saved_llama(tmp_path_factory, layers=8, dtype=torch.bfloat16)


def lora(folder: Path) -> torch.nn.Module:
    base = meta_model(folder)
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))


def reads_of(folder: Path, tmp_path: Path, policy: str) -> tuple[list[int], list[tuple[int, str]], int]:
    """Per step, the base's NVMe bytes read; the reads of a tensor again before its unit's use
    (step, tensor); the base's bytes."""
    placement = dict(params="host", grads="host", optimizer_states="host", frozen="nvme", compute_dtype="bfloat16")
    plain = tz.Config(nvme_dir=str(tmp_path / policy), **placement)
    least = least_budgets(lora(folder), plain)
    base = sum(t.nbytes for t in flat_tensors(lora(folder), plain) if t.kind == "frozen")
    cfg = tz.Config(nvme_dir=str(tmp_path / policy), nvme_budget="64MiB", host_budget=least["host"] + base // 4,
                    device_budget=least["device"] + 2 * base // 3, prefetch=tz.PrefetchConfig(policy=policy), **placement)
    model = tz.wrap(lora(folder), cfg, weights=folder)
    try:
        opt = tz.AdamW(model, lr=1e-3)
        pm = runtime.placement_manager(model)
        unit_of = {t: u for u, d in pm.telemetry.info["units"].items() for t in d["tensors"]}
        runtime.step_stats(model)
        g = torch.Generator().manual_seed(2)
        per_step, again = [], []
        for step in range(STEPS):
            start = time.perf_counter()
            x = torch.randint(0, 211, (2, 16), generator=g)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            runtime.settle(model)
            per_step.append(runtime.step_stats(model).nvme_by_kind["frozen"]["read"])
            events = [(m.start, m.tensor, unit_of[m.tensor]) for m in pm.telemetry.moves_since(start)
                      if m.src == "nvme"]
            events += [(s.start, None, s.args["unit"]) for s in pm.telemetry.spans
                       if s.track == "blocks" and s.start >= start]
            read: set[str] = set()  # tensors read since their unit's last use
            for _, tensor, unit in sorted(events, key=lambda e: e[0]):
                if tensor is None:
                    read = {t for t in read if unit_of[t] != unit}
                elif tensor in read:
                    again.append((step, tensor))
                else:
                    read.add(tensor)
        return per_step, again, base
    finally:
        runtime.close(model)


def test_adaptive_reads_no_block_twice_in_a_pass_and_no_more_than_lookahead(
        folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fetch_s = policies.BlockTimes.fetch_s
    monkeypatch.setattr(policies.BlockTimes, "fetch_s",
                        lambda self, unit, tier: 10 * (fetch_s(self, unit, tier) or 1e-3))
    assert tz.Config().prefetch.policy == "adaptive"  # the default
    adaptive, again, base = reads_of(folder, tmp_path, "adaptive")
    lookahead, _, _ = reads_of(folder, tmp_path, "lookahead")
    assert again == [], again
    later = slice(1, None)  # the first step records the trace
    assert max(adaptive[later]) <= base, (adaptive, base)
    assert sum(adaptive[later]) <= 1.1 * sum(lookahead[later]), (adaptive, lookahead)
