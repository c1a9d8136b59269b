"""Bytes per tier for a model and a Config, and the largest built-in model a machine can train.

The figures are tierzero's own state: compute-dtype parameters on `params`, fp32 gradients on
`grads`, fp32 master weights and two AdamW moments on `optimizer_states`, plus the working sets
the runtime keeps: on the device the block being computed and the blocks prefetched ahead of
it; on the host the NVMe read-ahead staging and the optimizer's streaming buffers. Activations
are the caller's and are not counted.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn

from tierzero.config import TIER_NAMES, Config, format_size, parse_size

OPTIMIZER_BYTES_PER_PARAM = 12
"""fp32 master weight + exp_avg + exp_avg_sq."""
GRAD_BYTES_PER_PARAM = 4


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
    """Params + grads + optimizer states, wherever they live."""

    def fits(self, budgets: dict[str, int]) -> bool:
        return all(self.per_tier[t] <= budgets[t] for t in TIER_NAMES)


def _compute_bytes(cfg: Config) -> int:
    if cfg.compute_dtype == "float32" or (cfg.compute_dtype == "auto" and not torch.cuda.is_available()):
        return 4
    return 2


def _largest_block(model: nn.Module) -> int:
    """Parameters of the largest repeated child (a transformer layer), else of the whole model."""
    best = 0
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            for child in module:
                best = max(best, sum(p.numel() for p in child.parameters()))
    return best or sum(p.numel() for p in model.parameters())


def estimate(model: nn.Module, cfg: Config) -> Estimate:
    """Bytes per tier that training `model` under `cfg` needs (model may be on the meta device)."""
    n = sum(p.numel() for p in model.parameters())
    block = _largest_block(model)
    cb = _compute_bytes(cfg)
    need = dict.fromkeys(TIER_NAMES, 0)
    need[cfg.params] += n * cb
    need[cfg.grads] += n * GRAD_BYTES_PER_PARAM
    # fp32 parameters on the optimizer states' tier are the master weights themselves
    optim = OPTIMIZER_BYTES_PER_PARAM - (4 if cb == 4 and cfg.params == cfg.optimizer_states else 0)
    need[cfg.optimizer_states] += n * optim
    home = dict(need)
    ahead = cfg.prefetch.depth if cfg.prefetch.policy == "lookahead" else 1
    if cfg.params != "device":
        need["device"] += block * cb * (1 + ahead)
    if cfg.params == "nvme":
        need["host"] += block * cb * cfg.prefetch.nvme_depth
    if cfg.optimizer_states == "nvme":
        # read k+1, update k, write k-1: three blocks' master + moments in flight
        need["host"] += 3 * block * (OPTIMIZER_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM)
    state = n * (cb + GRAD_BYTES_PER_PARAM + optim)
    return Estimate(params=n, largest_block_params=block, per_tier=need, home=home, state_bytes=state)


def machine_budgets(nvme_dir: str | None, headroom: float = 0.8) -> dict[str, int]:
    """What this machine offers: free GPU memory (or a quarter of RAM standing in for it),
    available RAM and free disk under nvme_dir, each times `headroom`."""
    ram = psutil.virtual_memory().available
    if torch.cuda.is_available():
        device = torch.cuda.mem_get_info()[0]
    else:
        device = ram // 4
    disk = 0
    if nvme_dir is not None:
        p = Path(nvme_dir)
        while not p.exists() and p != p.parent:
            p = p.parent
        disk = shutil.disk_usage(p).free
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
    p.add_argument("--params", default=None, choices=TIER_NAMES)
    p.add_argument("--grads", default=None, choices=TIER_NAMES, help="default: as --params")
    p.add_argument("--optimizer-states", default=None, choices=TIER_NAMES)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    machine = machine_budgets(args.nvme_dir)
    budgets = dict(machine)
    if args.device_budget:
        budgets["device"] = parse_size(args.device_budget, what="--device-budget")
    if args.host_budget:
        budgets["host"] = parse_size(args.host_budget, what="--host-budget")
    params = args.params or ("nvme" if args.nvme_dir else "host")
    cfg = Config(nvme_dir=args.nvme_dir, params=params, grads=args.grads or params,
                 optimizer_states=args.optimizer_states or params,
                 device_budget=budgets["device"], host_budget=budgets["host"])
    model = build(args.model, device="meta")
    est = estimate(model, cfg)
    largest, placement = largest_trainable(machine, args.nvme_dir)
    result = {
        "model": args.model, "params": est.params, "state_bytes": est.state_bytes,
        "placement": {"params": cfg.params, "grads": cfg.grads,
                      "optimizer_states": cfg.optimizer_states},
        "bytes": est.per_tier, "budgets": budgets, "fits": est.fits(budgets),
        "machine": machine, "largest_trainable": largest, "largest_placement": placement,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.model}: {est.params / 1e6:.1f}M parameters, training state "
          f"{format_size(est.state_bytes)}")
    for t in TIER_NAMES:
        mark = "ok" if est.per_tier[t] <= budgets[t] else "OVER BUDGET"
        print(f"  {t:6s} needs {format_size(est.per_tier[t]):>12s} of {format_size(budgets[t]):>12s}  {mark}")
    print(f"this machine (free GPU/RAM/disk x0.8: "
          f"{', '.join(f'{t} {format_size(machine[t])}' for t in TIER_NAMES)}) can train up to: "
          f"{largest or 'none of the built-in models'}"
          + (f" with {placement}" if largest else ""))
    return 0
