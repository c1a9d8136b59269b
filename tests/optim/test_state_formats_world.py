"""1 and 2 ranks compute the same bits with low-bit states ([Note: shards on int8 blocks]).

Both ranks of the 2-rank runs see the whole batch, so the averaged gradient is one process's bit
for bit ((g + g) / 2 = g); no clipping (the norm's sum order differs with the world size). Then
int8 and bf16 states, at ZeRO stages 3 (the default) and 1, give the losses, parameters and
states of one process exactly, and so do fp32 states. An int8 checkpoint saved by 2 ranks loads
into one process block by block, and training goes on as the uninterrupted run."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.checkpoint.reshard import block_reshard_plan
from tierzero.config import QUANT_BLOCK
from tierzero.layout import FlatLayout, StateCodec, window_numel
from tierzero.optim.base import TieredOptimizer
from dp_model import device_budget, global_batches, make_model
from gloo import run_ranks

STEPS = 3
SAVE_AT = 2
CASES = [("int8", 3), ("bfloat16", 3), ("int8", 1), ("bfloat16", 1), ("float32", 3)]


def run_rank(rank: int, world_size: int, out_dir: str, ckpt: str, load: bool) -> None:
    for fmt, stage in [CASES[0]] if load else CASES:  # one spawn of the ranks runs the cases in turn
        model = make_model()
        cfg = tz.Config(device_budget=device_budget(model, world_size) + (8 << 20), host_budget="64MiB",
                        compute_dtype="float32", params="host", optimizer_states="host", grads=None,
                        zero_stage=stage, optimizer_state_dtype=fmt)
        tz.wrap(model, cfg)
        opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
        if load:
            tz.load_checkpoint(ckpt, model, opt)
        losses = []
        for step, (x, y) in enumerate(global_batches()[:STEPS]):
            if load and step < SAVE_AT:
                continue
            loss = model(x, y).loss  # every rank the whole batch
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if ckpt and not load and step + 1 == SAVE_AT and (fmt, stage) == CASES[0]:
                tz.save_checkpoint(ckpt, model, opt)
        runtime.settle(model)
        torch.save({"losses": losses, "states": _full_states(opt, fmt, world_size)},
                   os.path.join(out_dir, f"{fmt}-{stage}-rank{rank}.pt"))
        runtime.close(model)


def _full_states(opt: TieredOptimizer, fmt: str, world_size: int) -> dict[str, torch.Tensor]:
    """Each block's master weights and states over the whole flat tensor, as bytes: the ranks'
    shards joined; an int8 state as "codes" and "scales" (every rank's codes, then every rank's
    scales: one block's code and scale in the same place whatever the world size)."""
    out = {}
    for name, entry in opt.state_dict()["state"].items():
        for kind, v in entry.items():
            if kind == "step":
                continue
            v = v.contiguous().view(torch.uint8)
            parts = [torch.empty_like(v) for _ in range(world_size)]
            if world_size > 1:
                torch.distributed.all_gather(parts, v)
            else:
                parts = [v]
            if kind.startswith("exp_avg") and fmt == "int8":
                n = v.numel() // (QUANT_BLOCK + 4) * QUANT_BLOCK
                out[f"{name}/{kind}/codes"] = torch.cat([p[:n] for p in parts])
                out[f"{name}/{kind}/scales"] = torch.cat([p[n:] for p in parts])
            else:
                out[f"{name}/{kind}"] = torch.cat(parts)
    return out


def _run(tmp_path: Path, name: str, world_size: int, ckpt: str = "", load: bool = False) -> dict[str, dict]:
    out = tmp_path / name
    out.mkdir()
    run_ranks(run_rank, world_size, tmp_path / f"init-{name}", str(out), ckpt, load)
    return {f.name.removesuffix("-rank0.pt"): torch.load(f) for f in out.glob("*-rank0.pt")}


def _assert_same(one: dict, two: dict, what: str) -> None:
    """The same losses, and the same bytes of every master weight and state; 2 ranks pad each
    flat tensor further (to whole blocks a rank), with zeros."""
    assert one["losses"] == two["losses"], what
    assert sorted(one["states"]) == sorted(two["states"]), what
    for key, value in one["states"].items():
        other = two["states"][key]
        assert torch.equal(other[:value.numel()], value), (what, key)
        assert not other[value.numel():].any(), (what, key)


def test_one_and_two_ranks_bit_identical(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    one, two = _run(tmp_path, "one", 1), _run(tmp_path, "two", 2, ckpt)
    assert sorted(one) == sorted(two) == sorted(f"{f}-{s}" for f, s in CASES)
    for case, ref in one.items():
        _assert_same(ref, two[case], case)
    masters = [one[f"{f}-3"]["states"] for f in ("int8", "bfloat16", "float32")]
    assert all(any(not torch.equal(a[k], b[k]) for k in a if k.endswith("/master")) for a, b in zip(masters, masters[1:]))
    # an int8 checkpoint of 2 ranks loads into one process: the rest of the run as uninterrupted
    resumed = _run(tmp_path, "resumed", 1, ckpt, load=True)["int8-3"]
    assert resumed["losses"] == one["int8-3"]["losses"][SAVE_AT:]
    _assert_same({**resumed, "losses": []}, {**one["int8-3"], "losses": []}, "resumed")


def test_block_reshard_plan() -> None:
    """An int8 state's blocks move whole between world sizes: 2 ranks' shards joined into one
    and cut into 3 give each rank the flat tensor's blocks; layouts whose shards start inside a
    block, or whose parameters sit elsewhere, are refused (None)."""
    shapes = [torch.Size([710]), torch.Size([300, 3])]
    layouts = {w: FlatLayout.build(["a", "b"], shapes, w) for w in (1, 2, 3)}
    codec = StateCodec("int8")
    flat = torch.randn(layouts[1].padded_numel)
    flat[layouts[1].numel:] = 0
    stored = {}
    for w, lay in layouts.items():  # each rank's shard encoded on its own
        stored[w] = []
        for r in range(w):
            a, b = lay.shard_range(r)
            shard = torch.zeros(b - a)
            shard[:max(0, min(b, flat.numel()) - a)] = flat[a:b]
            out = codec.zeros(b - a)
            codec.encode(torch.cat([shard, torch.zeros(window_numel(0, b - a) - (b - a))]), out, b - a, 0, b - a)
            stored[w].append(out)
    for saved in (1, 2, 3):
        for new in (1, 2, 3):
            for r in range(new):
                ops = block_reshard_plan(layouts[saved], layouts[new], r)
                got = torch.zeros_like(stored[new][r])
                for op in ops:
                    got[op.dst_start:op.dst_start + op.count] = stored[saved][op.src_rank][op.src_start:op.src_start + op.count]
                assert torch.equal(got, stored[new][r]), (saved, new, r)
    unaligned = FlatLayout(layouts[2].slots, layouts[2].numel, 1600, 2)  # shards of 800: inside a block
    moved = FlatLayout.build(["a", "b"], shapes, 2, itemsize=2)
    assert [s.offset for s in moved.slots] != [s.offset for s in layouts[2].slots]
    assert block_reshard_plan(unaligned, layouts[1], 0) is None
    assert block_reshard_plan(moved, layouts[1], 0) is None
