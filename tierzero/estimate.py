"""Bytes per tier for a model and a Config, and the largest built-in model a machine can train.

The figures are tierzero's own state: compute-dtype parameters on `params`, gradients
(Config.grad_dtype) on `grads`, fp32 master weights and two AdamW moments on
`optimizer_states`, plus the working sets the runtime keeps: on the device the root block (held
through the forward and the backward), the block being computed and the blocks prefetched
ahead of it; on the host the NVMe read-ahead staging and the
optimizer's streaming buffers. Activations are the caller's and are not counted. Across N
data-parallel ranks the state each rank holds, and the bytes its collectives move per step,
follow the ZeRO stage (tierzero.zero_model: the ZeRO paper's model).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import NamedTuple

import psutil
import torch
from torch import nn

from io_engine.files import free_disk_bytes
from tierzero.cli import add_placement_flags, add_zero_flags, placement_from_flags, zero_from_flags
from tierzero.config import TIER_NAMES, Config, format_size, parse_size
from tierzero.grouping import ROOT, blocks_of
from tierzero.sharding import CommBytes
from tierzero.traffic import add_rate_flags, rates_from_flags, step_traffic
from tierzero.zero_model import OPTIMIZER_BYTES_PER_PARAM, StateSizes, ZeroModel, param_counts


@dataclass(frozen=True)
class Estimate:
    params: int
    largest_block_params: int
    per_tier: dict[str, int]
    """Bytes needed on each tier: the state homed there plus the runtime's working sets."""
    home: dict[str, int]
    """Bytes of state homed on each tier (params, grads, optimizer states): the least each
    tier's budget must hold."""
    state_bytes: int
    """Params + grads + optimizer states, wherever they live (the whole model's, in one process)."""
    world_size: int = 1
    per_rank: StateSizes | None = None
    """What each rank holds of each kind of state (the ZeRO paper's model; `home` by tier)."""
    layout_per_rank: StateSizes | None = None
    """The same as `tz.wrap` registers it: flat tensors aligned and padded (zero_model)."""
    comm: CommBytes | None = None
    """Bytes each rank's collectives cover per step of one backward (zero_model)."""

    def fits(self, budgets: dict[str, int]) -> bool:
        return all(self.per_tier[t] <= budgets[t] for t in TIER_NAMES)


class StateBytes(NamedTuple):
    """Bytes per parameter of each kind of state."""

    params: int
    """Compute-dtype parameters."""
    grads: int
    """Gradients (Config.grad_dtype)."""
    optimizer_states: int
    """fp32 master weights and two moments (with fp32 parameters on the optimizer states'
    tier, the parameters are the master weights)."""

    def by_tier(self, cfg: Config) -> dict[str, int]:
        """Bytes per parameter on each tier, as `cfg` places the kinds."""
        out = dict.fromkeys(TIER_NAMES, 0)
        for tier, nbytes in zip((cfg.params, cfg.grads, cfg.optimizer_states), self):
            out[tier] += nbytes
        return out


def state_bytes_per_param(cfg: Config) -> StateBytes:
    compute = getattr(torch, cfg.compute_dtype_name(cuda=torch.cuda.is_available())).itemsize
    optim = OPTIMIZER_BYTES_PER_PARAM - (4 if compute == 4 and cfg.params == cfg.optimizer_states else 0)
    return StateBytes(compute, getattr(torch, cfg.grad_dtype).itemsize, optim)


def largest_block_params(model: nn.Module, cfg: Config) -> int:
    """Parameters of the largest block `tz.wrap(model, cfg)` builds besides the root (the
    whole model when it finds no blocks)."""
    blocks = blocks_of(model, cfg)
    sizes = [sum(p.numel() for _, p in params) for name, _, params in blocks if name != ROOT]
    return max(sizes, default=sum(p.numel() for _, p in blocks[-1][2]))


def estimate(model: nn.Module, cfg: Config, world_size: int = 1) -> Estimate:
    """Bytes per tier that each of `world_size` ranks needs to train `model` under `cfg` (model
    may be on the meta device)."""
    counts = param_counts(model, cfg)
    n, trainable = counts.params, counts.trainable
    block = largest_block_params(model, cfg)
    per_param = state_bytes_per_param(cfg)
    cb = per_param.params
    zm = ZeroModel.of(cfg, world_size)
    per_rank = zm.per_rank(n, trainable)
    need = per_rank.by_tier(cfg)
    home = dict(need)
    # adaptive keeps at least two blocks coming (more only where the room allows)
    policy = cfg.prefetch.policy if isinstance(cfg.prefetch.policy, str) else "object"
    ahead = {"lookahead": cfg.prefetch.depth, "adaptive": 2}.get(policy, 1)
    if cfg.params != "device" or zm.zero.gathers:
        need["device"] += (counts.root + block * (1 + ahead)) * cb
    if cfg.params == "nvme":
        need["host"] += block * cb * cfg.prefetch.nvme_depth
    if cfg.optimizer_states == "nvme":
        # read k+1, update k, write k-1: three blocks' master + moments in flight
        need["host"] += 3 * block * (OPTIMIZER_BYTES_PER_PARAM + per_param.grads)
    state = n * per_param.params + trainable * (per_param.grads + per_param.optimizer_states)
    return Estimate(params=n, largest_block_params=block, per_tier=need, home=home, state_bytes=state,
                    world_size=world_size, per_rank=per_rank, layout_per_rank=zm.layout_per_rank(model, cfg),
                    comm=zm.comm_per_step(counts))


def machine_budgets(nvme_dir: str | None, headroom: float = 0.8) -> dict[str, int]:
    """What this machine offers: free GPU memory (or a quarter of RAM standing in for it),
    available RAM and free disk under nvme_dir, each times `headroom`."""
    ram = psutil.virtual_memory().available
    if torch.cuda.is_available():
        device = torch.cuda.mem_get_info()[0]
    else:
        device = ram // 4
    disk = 0 if nvme_dir is None else free_disk_bytes(nvme_dir)
    return {"device": int(device * headroom), "host": int(ram * headroom), "nvme": int(disk * headroom)}


def placements() -> list[dict[str, str]]:
    """Placements from fastest to most frugal, as tried by `largest_trainable`."""
    return [
        dict(params="host", grads="host", optimizer_states="host"),
        dict(params="host", grads="host", optimizer_states="nvme"),
        dict(params="nvme", grads="host", optimizer_states="nvme"),
        dict(params="nvme", grads="nvme", optimizer_states="nvme"),
    ]


def largest_trainable(budgets: dict[str, int], nvme_dir: str | None) -> tuple[str | None, dict]:
    """The largest built-in model with a placement that fits `budgets`, and that placement."""
    from tierzero.models import CONFIGS, build

    best: tuple[str | None, dict] = (None, {})
    for name in CONFIGS:
        with torch.device("meta"):
            model = build(name, device="meta")
        for placement in placements():
            if "nvme" in placement.values() and nvme_dir is None:
                continue
            cfg = Config(nvme_dir=nvme_dir, **placement)
            if estimate(model, cfg).fits(budgets):
                best = (name, placement)
                break
    return best


def main(argv: list[str]) -> int:
    from tierzero.models import CONFIGS, build

    p = argparse.ArgumentParser(prog="tierzero estimate",
                                description="bytes per tier for a built-in model and a config")
    p.add_argument("--model", default="125m", choices=list(CONFIGS))
    p.add_argument("--device-budget", default=None)
    p.add_argument("--host-budget", default=None)
    p.add_argument("--nvme-dir", default=None)
    add_placement_flags(p)
    add_zero_flags(p)
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (figures are per rank)")
    p.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype of the parameters (auto: bfloat16 with CUDA, float32 without)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="update each block as backward finishes it (no gradient traffic)")
    add_rate_flags(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error(f"--world-size: expected an int >= 1, got {args.world_size}")
    try:
        rates = rates_from_flags(args)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))

    machine = machine_budgets(args.nvme_dir)
    budgets = dict(machine)
    if args.device_budget:
        budgets["device"] = parse_size(args.device_budget, what="--device-budget")
    if args.host_budget:
        budgets["host"] = parse_size(args.host_budget, what="--host-budget")
    cfg = Config(nvme_dir=args.nvme_dir, device_budget=budgets["device"], host_budget=budgets["host"],
                 compute_dtype=args.compute_dtype, step_in_backward=args.step_in_backward,
                 **placement_from_flags(args), **zero_from_flags(args))
    model = build(args.model, device="meta")
    est = estimate(model, cfg, args.world_size)
    assert est.per_rank is not None and est.layout_per_rank is not None and est.comm is not None
    traffic = step_traffic(est.params, cfg, world_size=args.world_size)
    floor = None if rates is None else rates.floor_s(traffic.read, traffic.write)
    largest, placement = largest_trainable(machine, args.nvme_dir)
    result = {
        "model": args.model, "params": est.params, "state_bytes": est.state_bytes,
        "placement": {"params": cfg.params, "grads": cfg.grads,
                      "optimizer_states": cfg.optimizer_states},
        "world_size": args.world_size, "zero_stage": cfg.zero_stage,
        "compute_dtype": cfg.compute_dtype_name(cuda=torch.cuda.is_available()), "grad_dtype": cfg.grad_dtype,
        "per_rank_bytes": est.per_rank.as_dict(), "per_rank_tier_bytes": est.home,
        "per_rank_layout_bytes": est.layout_per_rank.as_dict(),
        "comm_bytes_per_step": {**est.comm.as_dict(), "total": est.comm.total},
        "bytes": est.per_tier, "budgets": budgets, "fits": est.fits(budgets),
        "machine": machine, "largest_trainable": largest, "largest_placement": placement,
        "nvme_step_bytes": traffic.to_json(), "nvme_bytes_per_param": traffic.per_param(est.params),
        "drive": None if rates is None else rates.to_json(), "nvme_floor_s": floor,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.model}: {est.params / 1e6:.1f}M parameters, training state "
          f"{format_size(est.state_bytes)}")
    if args.world_size > 1:
        per = est.per_rank
        print(f"  per rank of {args.world_size} (ZeRO stage {cfg.zero_stage}): params {format_size(per.params)}, "
              f"grads {format_size(per.grads)}, optimizer states {format_size(per.optimizer_states)}; "
              f"collectives {format_size(est.comm.total)} per step")
    for t in TIER_NAMES:
        mark = "ok" if est.per_tier[t] <= budgets[t] else "OVER BUDGET"
        print(f"  {t:6s} needs {format_size(est.per_tier[t]):>12s} of {format_size(budgets[t]):>12s}  {mark}")
    if traffic.read or traffic.write:
        per = traffic.per_param(est.params)
        print(f"  one step moves at least {format_size(traffic.read)} from NVMe and {format_size(traffic.write)} "
              f"to it ({per['total']:.1f} bytes per parameter: "
              + ", ".join(f"{k} {v:.0f}" for k, v in per.items() if k != "total") + ")")
        print(f"  NVMe floor: {floor:.2f} s per step at {rates.read_gbps:.2f} GB/s read, {rates.write_gbps:.2f} GB/s "
              f"write ({rates.source})" if floor is not None else
              "  NVMe floor: give --bench-io FILE (from `tierzero bench-io --json`) or --read-gbps/--write-gbps")
    print(f"this machine (free GPU/RAM/disk x0.8: "
          f"{', '.join(f'{t} {format_size(machine[t])}' for t in TIER_NAMES)}) can train up to: "
          f"{largest or 'none of the built-in models'}"
          + (f" with {placement}" if largest else ""))
    return 0
