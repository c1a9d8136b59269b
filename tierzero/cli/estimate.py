"""`tierzero estimate`: bytes per tier for a model (a built-in one, or a transformers folder, of
which only config.json is read) and a config, the ZeRO model across ranks, the NVMe traffic of a
step and its floor, and the largest built-in model this machine can train (tierzero.planning
does the arithmetic)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tierzero.cli.flags import (add_placement_flags, add_rate_flags, add_zero_flags, placement_from_flags,
                                rates_from_flags, zero_from_flags)
from tierzero.config import TIER_NAMES, Config, format_size, machine_budgets, parse_size
from tierzero.formats import meta_model
from tierzero.models import CONFIGS, build
from tierzero.planning import estimate, largest_trainable, step_traffic


def _meta_model(name: str) -> torch.nn.Module:
    """A built-in model, or the model of a transformers folder (its config.json), on the meta device."""
    if name in CONFIGS:
        return build(name, device="meta")
    if not (Path(name) / "config.json").is_file():
        raise ValueError(f"--model: {name!r} is neither a built-in model ({', '.join(CONFIGS)}) nor a transformers "
                         "model folder (a folder holding config.json)")
    return meta_model(name)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tierzero estimate",
                                description="bytes per tier for a model and a config")
    p.add_argument("--model", default="125m", metavar="NAME|FOLDER",
                   help=f"a built-in model ({', '.join(CONFIGS)}) or a transformers model folder (only its "
                        "config.json is read: the model is built on the meta device)")
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
    try:
        model = _meta_model(args.model)
    except (ValueError, ImportError) as e:
        p.error(str(e))
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
    name = args.model if args.model in CONFIGS else f"{args.model} ({type(model).__name__})"
    print(f"{name}: {est.params / 1e6:.1f}M parameters, training state "
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
