"""`tierzero estimate`: bytes per tier for a model (a built-in one, or a transformers folder, of
which only config.json is read) and a config, the ZeRO model across ranks, the NVMe traffic of a
step and its floor, the largest built-in model this machine can train, and with --batch and
--seq the activations: bytes per block call, measured by one forward on fake tensors, and the
largest batch x sequence each activation placement fits (tierzero.planning does the arithmetic)."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from tierzero import formats
from tierzero.cli.flags import (add_activation_flags, add_placement_flags, add_rate_flags, add_state_format_flags,
                                add_zero_flags, activations_from_flags, placement_from_flags, rates_from_flags,
                                state_format_from_flags, zero_from_flags)
from tierzero.cli.harness import batch_loss, with_lora
from tierzero.cli.micro_batches import add_micro_batch_flag
from tierzero.config import KINDS, TIER_NAMES, Config, format_size, machine_budgets, parse_size
from tierzero.layout import PlacementPlan
from tierzero.formats import meta_model
from tierzero.models import CONFIGS, build
from tierzero.planning import (PLACEMENTS, ActivationBytes, ActivationModel, DriveRates, Estimate, Traffic,
                               activation_model, estimate, expected_traffic, flat_tensors, largest_trainable,
                               param_counts, placement_plan, resolve_placement, step_traffic,
                               Recording, TierModel, WorkingSet, simulate, update_reads, with_split, working_set)
from tierzero.prefetch import policy_from_config


def _meta_model(name: str) -> torch.nn.Module:
    """A built-in model, or the model of a transformers folder (its config.json), on the meta device."""
    if name in CONFIGS:
        return build(name, device="meta")
    if not (Path(name) / "config.json").is_file():
        raise ValueError(f"--model: {name!r} is neither a built-in model ({', '.join(CONFIGS)}) nor a transformers "
                         "model folder (a folder holding config.json)")
    return meta_model(name)


def _parser() -> argparse.ArgumentParser:
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
    add_state_format_flags(p)  # issue 53
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (figures are per rank)")
    p.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype of the parameters (auto: bfloat16 with CUDA, float32 without)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="update each block as backward finishes it (no gradient traffic)")
    add_rate_flags(p)
    p.add_argument("--batch", type=int, default=None,
                   help="with --seq: measure the activations of a step (the global batch, as train takes it)")
    p.add_argument("--seq", type=int, default=None, help="with --batch: measure the activations of a step")
    add_activation_flags(p)
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="LoRA adapters of rank R on every linear layer of a transformers folder's model, the base "
                        "frozen (on --frozen's tier), as `tierzero train --lora R` trains them")
    add_micro_batch_flag(p)
    p.add_argument("--trace", default=None, metavar="RUN",
                   help="a run's trace.json (or its run folder) of this model from `tierzero train`: predict the "
                        "whole step, compute included, by the tier model (else the NVMe floor alone)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.lora < 0 or (args.lora and args.model in CONFIGS):
        p.error(f"--lora: expected a rank >= 1 with a transformers model folder, got --lora {args.lora} "
                f"--model {args.model}")
    if args.world_size < 1:
        p.error(f"--world-size: expected an int >= 1, got {args.world_size}")
    if (args.batch is None) != (args.seq is None) or min(args.batch or 1, args.seq or 1) < 1:
        p.error(f"--batch and --seq go together, each an int >= 1; got --batch {args.batch} --seq {args.seq}")
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
    cfg, model, ws = _config_and_model(p, args, budgets)
    est = estimate(model, cfg, args.world_size)
    assert est.per_rank is not None and est.layout_per_rank is not None and est.comm is not None
    least = est.least  # with "auto": the least budgets at which "auto" finds a placement
    auto = auto_plan(model, cfg, args.world_size)
    cfg = resolve_placement(model, cfg, args.world_size)  # "auto" as wrap would choose it
    traffic = step_traffic(est.params, cfg, world_size=args.world_size, trainable=param_counts(model, cfg).trainable,
                           micro_batches=args.micro_batches)
    fewest, most = expected_traffic(traffic, flat_tensors(model, cfg, args.world_size),
                                    {t: budgets[t] - least[t] for t in TIER_NAMES})
    floor = None if rates is None else rates.floor_s(traffic.read, traffic.write)
    predicted = None if rates is None else {k: rates.floor_s(t.read, t.write) for k, t in (("fewest", fewest), ("most", most))}
    try:
        recorded = None if args.trace is None else recorded_step(args.trace, model, cfg, args.world_size)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    largest, placement = largest_trainable(machine, args.nvme_dir)
    result = {
        "model": args.model, "params": est.params, "state_bytes": est.state_bytes,
        "placement": {"params": cfg.params, "grads": cfg.grads,
                      "optimizer_states": cfg.optimizer_states, "frozen": cfg.frozen_tier},
        "world_size": args.world_size, "zero_stage": cfg.zero_stage,
        "compute_dtype": cfg.compute_dtype_name(cuda=torch.cuda.is_available()), "grad_dtype": cfg.grad_dtype,
        "per_rank_bytes": est.per_rank.as_dict(), "per_rank_tier_bytes": est.home,
        "per_rank_layout_bytes": est.layout_per_rank.as_dict(),
        "comm_bytes_per_step": {**est.comm.as_dict(), "total": est.comm.total},
        "bytes": est.per_tier, "least_budgets": least, "budgets": budgets, "auto": _auto_json(auto),
        "over_budget": {t: least[t] for t in TIER_NAMES if least[t] > budgets[t]},
        "fits": all(least[t] <= budgets[t] for t in TIER_NAMES),
        "machine": machine, "largest_trainable": largest, "largest_placement": placement,
        "nvme_step_bytes": traffic.to_json(), "nvme_bytes_per_param": traffic.per_param(est.params),
        "nvme_expected_step_bytes": {"most": most.to_json(), "fewest": fewest.to_json()},
        "drive": None if rates is None else rates.to_json(), "nvme_floor_s": floor,
        "predicted_step_floor_s": predicted, "predicted_step": recorded,
    }
    acts = None
    if ws is not None:
        result["device_working_set"] = {"batch": ws.batch, "seq": ws.seq, "peak": ws.peak,
                                        "activations": ws.activations, "reserve": cfg.device_reserve}
    if args.batch is not None:
        acts = _activations(args, cfg, model)
        result["activations"] = _activations_json(acts, least, cfg, budgets, args.micro_batches)
    if args.json:
        print(json.dumps(result))
        return 0
    _print_state(args, model, est, cfg, least, budgets)
    _print_auto(auto)
    _print_traffic(est, traffic, (fewest, most), rates, floor)
    _print_step(args, cfg, traffic, predicted, recorded, ws)
    if acts is not None:
        _print_activations(acts, least, cfg, budgets, args.micro_batches)
    print(f"this machine (free GPU/RAM/disk x0.8: "
          f"{', '.join(f'{t} {format_size(machine[t])}' for t in TIER_NAMES)}) can train up to: "
          f"{largest or 'none of the built-in models'}"
          + (f" with {placement}" if largest else ""))
    return 0


def _config_and_model(p: argparse.ArgumentParser, args: argparse.Namespace,
                      budgets: dict[str, int]) -> tuple[Config, torch.nn.Module, WorkingSet | None]:
    """The flags' Config, the model on the meta device, and with --batch/--seq the device's
    working set (set aside in the Config when a kind is "auto")."""
    cfg = Config(nvme_dir=args.nvme_dir, device_budget=budgets["device"], host_budget=budgets["host"],
                 step_in_backward=args.step_in_backward, **state_format_from_flags(args, args.compute_dtype),
                 **placement_from_flags(args), **zero_from_flags(args), **activations_from_flags(args))
    try:
        model = _meta_model(args.model)
        if args.lora:
            model = with_lora(model, args.lora)
    except (ValueError, ImportError) as e:
        p.error(str(e))
    ws = None
    if args.batch is not None:
        try:
            cfg, ws = reserve_working_set(cfg, _measured_model(args, model), batch=_rank_rows(args), seq=args.seq,
                                          micro_batches=args.micro_batches, chunked=args.chunked_loss, always=True)
        except ValueError as e:
            p.error(str(e))
    return cfg, model, ws


def _print_step(args: argparse.Namespace, cfg: Config, traffic: Traffic, predicted: dict[str, float] | None,
                recorded: dict[str, float] | None, ws: WorkingSet | None) -> None:
    """The predicted step (the NVMe floor, the tier model's from --trace) and the working set."""
    if predicted is not None and (traffic.read or traffic.write):
        print(f"  predicted step floor for this placement (its NVMe traffic alone at the drive's rates; compute is "
              f"not in it): {predicted['fewest']:.2f} s (the spare room caching all it can) to {predicted['most']:.2f} s "
              "(caching none)" + ("" if recorded else "; give --trace RUN for the whole step"))
    if recorded is not None:
        print(f"  predicted step for this placement (tier model, from the recorded compute of {args.trace}): "
              f"{recorded['step_s']:.3f} s, of which compute {recorded['compute_s']:.3f} s and stall "
              f"{recorded['stall_s']:.3f} s")
    if ws is not None:
        print(f"  the device's working set at batch {ws.batch} x seq {ws.seq}: {format_size(ws.reserve)} (the largest "
              f"block's temporaries and the loss head's {format_size(ws.peak)}, activations kept there "
              f"{format_size(ws.activations)}), "
              + ("set aside before \"auto\" placed the state" if cfg.device_reserve else "not in any budget"))


def recorded_step(trace: str, model: torch.nn.Module, cfg: Config, world_size: int = 1) -> dict[str, float]:
    """The step of `cfg` predicted by the tier model from a run's recording: its compute, its
    block moves at the recorded rates under `cfg`'s prefetch policy, and its updates' NVMe reads
    under `cfg`'s optimizer-state placement ([Note: splits predicted from a recording])."""
    rec = Recording.load(trace)
    pred = simulate(with_split(rec, update_reads(model, cfg, world_size)), policy_from_config(cfg),
                    TierModel.calibrate(rec), nvme_depth=cfg.prefetch.nvme_depth, as_recorded=rec)
    return {"step_s": round(pred.step_s, 5), "stall_s": round(pred.stall_s, 5), "compute_s": round(rec.compute_s, 5),
            "trace": str(trace)}


def run_config(cfg: Config, model: torch.nn.Module, *, batch: int, seq: int, micro_batches: int = 1,
               chunked: bool = False, world_size: int = 1) -> Config:
    """`cfg` for a run of `model` at `batch` x `seq` rows per rank: the device's working set set
    aside when some kind is "auto", and "auto" resolved as `tz.wrap` resolves it (so that the
    run's figures and summary see the split)."""
    cfg, _ = reserve_working_set(cfg, model, batch=batch, seq=seq, micro_batches=micro_batches, chunked=chunked)
    return resolve_placement(model, cfg, world_size)


def _print_state(args: argparse.Namespace, model: torch.nn.Module, est: Estimate, cfg: Config,
                 least: dict[str, int], budgets: dict[str, int]) -> None:
    """The state's bytes and, per tier, the least budget (every tier at once, over or not)."""
    name = args.model if args.model in CONFIGS else f"{args.model} ({type(model).__name__})"
    print(f"{name}: {est.params / 1e6:.1f}M parameters, training state "
          f"{format_size(est.state_bytes)}")
    print("  placement: " + ", ".join(f"{k.replace('_', ' ')} {_placed(getattr(cfg, k))}" for k in KINDS))
    if args.world_size > 1:
        per = est.per_rank
        assert per is not None and est.comm is not None
        print(f"  per rank of {args.world_size} (ZeRO stage {cfg.zero_stage}): params {format_size(per.params)}, "
              f"grads {format_size(per.grads)}, optimizer states {format_size(per.optimizer_states)}; "
              f"collectives {format_size(est.comm.total)} per step")
    for t in TIER_NAMES:
        mark = "ok" if least[t] <= budgets[t] else "OVER BUDGET"
        print(f"  {t:6s} needs at least {format_size(least[t]):>12s} of {format_size(budgets[t]):>12s}  {mark:11s}"
              f"  (with prefetching's working sets {format_size(est.per_tier[t])})")
    over = [t for t in TIER_NAMES if least[t] > budgets[t]]
    if over:
        print("  to train, raise " + " ".join(f"--{t}-budget {least[t]}" for t in over)
              + " (bytes; every tier that falls short, at once)")


def _print_traffic(est: Estimate, traffic: Traffic, expected: tuple[Traffic, Traffic], rates: DriveRates | None,
                   floor: float | None) -> None:
    if not (traffic.read or traffic.write):
        return
    per = traffic.per_param(est.params)
    print(f"  with nothing cached one step moves {format_size(traffic.read)} from NVMe and {format_size(traffic.write)} "
          f"to it ({per['total']:.1f} bytes per parameter: "
          + ", ".join(f"{k} {v:.0f}" for k, v in per.items() if k != "total") + ")")
    fewest, most = expected
    print(f"  at these budgets a step reads {format_size(fewest.read)} to {format_size(most.read)} from NVMe "
          f"(the spare room caching all / none of it) and writes {format_size(most.write)}")
    print(f"  NVMe floor: {floor:.2f} s per step at {rates.read_gbps:.2f} GB/s read, {rates.write_gbps:.2f} GB/s "
          f"write ({rates.source})" if floor is not None and rates is not None else
          "  NVMe floor: give --bench-io FILE (from `tierzero bench-io --json`) or --read-gbps/--write-gbps")


def auto_plan(model: torch.nn.Module, cfg: Config, world_size: int = 1) -> PlacementPlan:
    """The placement plan of `cfg` with its parameters and optimizer states "auto" (its gradients
    as given: grads=None puts them where their updates run), as `tz.wrap` would choose it at
    `cfg`'s budgets ([Note: one placement plan])."""
    return placement_plan(model, cfg.replace(params="auto", optimizer_states="auto"), world_size)


_KIND_OF = {"params": "params", "grads": "grads", "master": "optimizer_states", "moments": "optimizer_states",
            "frozen": "frozen"}
"""A flat tensor's kind by the kinds `tz.tier_bytes` counts (master weights with the moments)."""


def _homes_by_kind(plan: PlacementPlan) -> dict[str, dict[str, int]]:
    """{kind: {tier: bytes}} homed under `plan`, as `tz.tier_bytes` counts a wrapped model's
    ("params", "grads", "optimizer_states": master weights and moments, "frozen" if any)."""
    out = {kind: dict.fromkeys(TIER_NAMES, 0) for kind in KINDS}
    for t in plan.tensors:
        out.setdefault(_KIND_OF[t.kind], dict.fromkeys(TIER_NAMES, 0))[t.home] += t.nbytes
    return out


def _auto_json(plan: PlacementPlan) -> dict:
    r = plan.resolved
    short = plan.short()
    return {"placement": {"params": r.params, "grads": r.grads, "optimizer_states": r.optimizer_states},
            "tier_bytes": _homes_by_kind(plan), "least_budgets": plan.least, "fits": not short, "over_budget": short,
            "nvme_step_bytes": plan.nvme_step_bytes}


def _print_auto(plan: PlacementPlan) -> None:
    """Where "auto" puts each kind at these budgets, the bytes it homes on each tier, and the
    least budgets at which it trains."""
    r, short = plan.resolved, plan.short()
    print('  "auto" (params and optimizer states auto) at these budgets: '
          + ", ".join(f"{k.replace('_', ' ')} {_placed(getattr(r, k))}" for k in KINDS)
          + ("" if not short else f" (does not fit: {', '.join(short)} over budget)"))
    for kind, homes in _homes_by_kind(plan).items():
        if any(homes.values()):
            print(f"    {kind.replace('_', ' '):16s} " + ", ".join(f"{t} {format_size(n)}" for t, n in homes.items() if n))
    print('    "auto" trains from budgets ' + ", ".join(f"{t} {format_size(plan.least[t])}" for t in TIER_NAMES)
          + (f"; a step moves {format_size(plan.nvme_step_bytes)} of NVMe bytes" if plan.nvme_step_bytes else ""))


def _placed(value: object) -> str:
    """A kind's placement in words: a tier, "where its updates run" (grads None), or a split."""
    if value is None:
        return "where its updates run"
    if isinstance(value, dict):
        return "/".join(f"{t} {f:.0%}" for t, f in value.items() if f)
    return str(value)


def _measured_model(args: argparse.Namespace, model: torch.nn.Module) -> torch.nn.Module:
    """The model a step is measured on: a built-in GPT rebuilt for twice --seq (its position
    table), a transformers folder's `model` as it is (with its adapters under --lora)."""
    if args.model in CONFIGS:
        return build(args.model, device="meta", vocab_size=formats.VOCAB_SIZE, seq_len=2 * args.seq)
    return model


def _activations(args: argparse.Namespace, cfg: Config, model: torch.nn.Module) -> ActivationModel:
    """The activations of a step of the model as `tierzero train` runs it (a built-in GPT on
    bytes of text; a transformers folder's `model`, with its adapters under --lora), measured
    at --seq and twice it."""
    loss = functools.partial(measured_loss, chunked=args.chunked_loss)
    return activation_model(_measured_model(args, model), cfg, loss, batch=_rank_rows(args), seq=args.seq,
                            device=_device())


def _rank_rows(args: argparse.Namespace) -> int:
    """Rows of one rank's step: --batch is the global batch, as `tierzero train` takes it."""
    return max(1, args.batch // args.world_size)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def reserve_working_set(cfg: Config, model: torch.nn.Module, *, batch: int, seq: int, micro_batches: int = 1,
                        chunked: bool = False, always: bool = False) -> tuple[Config, WorkingSet | None]:
    """`cfg` with `device_reserve` set to the device's working set of a step at `batch` x `seq`
    (tierzero.planning.working_set), and that working set: when some kind is "auto" (or
    `always`) and no reserve was given."""
    if cfg.device_reserve or not (always or any(getattr(cfg, k) == "auto" for k in KINDS)):
        return cfg, None
    loss = functools.partial(measured_loss, chunked=chunked)
    ws = working_set(model, cfg, loss, batch=batch, seq=seq, device=_device(), micro_batches=micro_batches)
    if not any(getattr(cfg, k) == "auto" for k in KINDS):
        return cfg, ws
    return cfg.replace(device_reserve=ws.reserve), ws


def measured_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, chunked: bool = False) -> torch.Tensor:
    """`batch_loss` as it is measured on fake tensors. transformers takes fake tensors for a
    trace: without a cache it cannot tell that the batch holds no packed sequences, and builds
    the causal mask a real batch does without (passed to every layer: what checkpointing keeps
    would read far too high). An empty cache tells it; its first update copies each layer's keys
    and values, which the attention then saves instead of views of the projection (a few
    percent more than a real step: 7 % for GPT-2 124M)."""
    return batch_loss(model, x, y, use_cache=True, chunked=chunked)


def _fits(acts: ActivationModel, least: dict[str, int], cfg: Config, budgets: dict[str, int],
          k: int) -> dict[str, dict[str, int]]:
    """Per placement (and checkpointed), the largest batch at --seq and seq at --batch whose
    activations (of `k` micro-batches, tz.accumulate) fit the budgets beside the state's least
    budgets (auto: the most frugal tier it can spill to)."""
    out = {}
    for placement in PLACEMENTS:
        for ckpt in (False, True):
            tiers = [placement] if placement != "auto" else ["device", "host"] + (["nvme"] if cfg.nvme_dir else [])

            def fits(a: ActivationBytes) -> bool:
                return any(all(least[t] + a.need(p, ckpt, micro_batches=k)[t] <= budgets[t] for t in TIER_NAMES)
                           for p in tiers)

            out[placement + (" checkpointed" if ckpt else "")] = {
                "max_batch": acts.largest(fits, vary="batch"), "max_seq": acts.largest(fits, vary="seq")}
    return out


def _activations_json(acts: ActivationModel, least: dict[str, int], cfg: Config, budgets: dict[str, int],
                      k: int) -> dict:
    a = acts.at
    return {"batch": a.batch, "seq": a.seq, "per_block": [{"block": b, "bytes": n} for b, n in a.per_call],
            "inputs": [{"block": b, "bytes": n} for b, n in a.inputs], "outside": a.outside, "after": a.after,
            "total": a.blocks + a.outside + a.after, "checkpointed_total": a.kept(True) + a.outside + a.after,
            "micro_batches": k,
            "need": {p: {"plain": a.need(p, False, micro_batches=k), "checkpointed": a.need(p, True, micro_batches=k)}
                     for p in PLACEMENTS if p != "auto"},
            "fits": _fits(acts, least, cfg, budgets, k)}


def _print_activations(acts: ActivationModel, least: dict[str, int], cfg: Config, budgets: dict[str, int],
                       k: int) -> None:
    a = acts.at
    print(f"activations of a step at batch {a.batch} x seq {a.seq} (measured by one forward on fake tensors):")
    for (block, n), (_, inp) in zip(a.per_call, a.inputs):
        print(f"  {block:24s} {format_size(n):>12s}   its input {format_size(inp):>12s} (what checkpointing keeps)")
    print(f"  outside the blocks (the head's, kept on the device): {format_size(a.outside)}"
          + (f"; the loss computed after the model's forward: {format_size(a.after)}" if a.after else ""))
    rest = a.outside + a.after
    print(f"  in all {format_size(a.blocks + rest)}; with activation checkpointing "
          f"{format_size(a.kept(True) + rest)} kept, plus one block's {format_size(a.largest)} recomputed at a time")
    print(f"  largest that fits the budgets beside the state (batch at seq {a.seq} / seq at batch {a.batch}"
          + (f", {k} micro-batches a step" if k > 1 else "") + "):")
    for name, fit in _fits(acts, least, cfg, budgets, k).items():
        print(f"    activations={name:22s} batch {fit['max_batch']:>6d} / seq {fit['max_seq']:>8d}")
