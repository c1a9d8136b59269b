"""Flags several subcommands share, each with the function that reads it back into Config
fields or planning inputs."""

from __future__ import annotations

import argparse
from typing import Callable

from tierzero.config import MASTER_DTYPES, STATE_DTYPES, TIER_NAMES, parse_placement
from tierzero.planning import DriveRates, rates_from_bench


def add_rate_flags(p: argparse.ArgumentParser) -> None:
    """--bench-io FILE, or --read-gbps and --write-gbps; read back with `rates_from_flags`."""
    p.add_argument("--bench-io", default=None, metavar="FILE",
                   help="a `tierzero bench-io --json` result: the drive's rates for the NVMe floor")
    p.add_argument("--read-gbps", type=float, default=None, help="the drive's read rate, GB/s (instead of --bench-io)")
    p.add_argument("--write-gbps", type=float, default=None, help="the drive's write rate, GB/s (instead of --bench-io)")


def rates_from_flags(args: argparse.Namespace) -> DriveRates | None:
    """The rates the flags of `add_rate_flags` give, or None (ValueError for half a pair)."""
    given = (args.read_gbps is not None, args.write_gbps is not None)
    if args.bench_io is not None:
        if any(given):
            raise ValueError("give either --bench-io or --read-gbps/--write-gbps, not both")
        return rates_from_bench(args.bench_io)
    if any(given) and not all(given):
        raise ValueError("--read-gbps and --write-gbps go together (or give --bench-io FILE)")
    return DriveRates(args.read_gbps, args.write_gbps, "flags") if all(given) else None


def add_placement_flags(p: argparse.ArgumentParser) -> None:
    """--params, --grads, --optimizer-states and --frozen; read them back with `placement_from_flags`."""
    tiers = "a tier (device, host, nvme), auto, or fractions such as device=0.25,host=0.5,nvme=0.25"
    p.add_argument("--params", default=None, type=_placement("--params"), metavar="PLACEMENT",
                   help=f"home of parameters: {tiers} (default: nvme when --nvme-dir is given, else host)")
    p.add_argument("--optimizer-states", default=None, type=_placement("--optimizer-states"), metavar="PLACEMENT",
                   help=f"fp32 master weights and moments: {tiers} (default: as --params)")
    p.add_argument("--grads", default=None, type=_placement("--grads"), metavar="PLACEMENT",
                   help=f"gradients: {tiers} (default: where each block's update runs, as Config(grads=None): the "
                        "device for optimizer states there, else the host; with auto, NVMe where the host is short)")
    p.add_argument("--frozen", default=None, choices=TIER_NAMES,
                   help="home tier of frozen parameters, such as a LoRA base (default: as --params)")


def _placement(flag: str) -> Callable[[str], str | dict[str, float]]:
    def parse(text: str) -> str | dict[str, float]:
        tiers = [part.partition("=")[0].strip() for part in text.split(",")] if "=" in text else []
        twice = sorted({t for t in tiers if tiers.count(t) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{flag}: {', '.join(twice)} given more than once in {text!r}; give "
                                             "each tier once, such as device=0.25,host=0.5,nvme=0.25")
        try:
            return parse_placement(text, what=flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def join_negative_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` with each of `flags` followed by a value that starts with "-" ("--host-budget
    -5MiB") joined into one argument ("--host-budget=-5MiB"), so that argparse reads it as that
    flag's value (which is then refused as negative) rather than as a flag."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in flags and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def placement_from_flags(args: argparse.Namespace) -> dict[str, object]:
    """The Config placement fields from the flags of `add_placement_flags` (and --nvme-dir)."""
    params = args.params or ("nvme" if args.nvme_dir else "host")
    return {"params": params, "grads": args.grads,
            "optimizer_states": args.optimizer_states or params, "frozen": args.frozen}


def add_zero_flags(p: argparse.ArgumentParser) -> None:
    """--zero-stage and --grad-dtype; read them back with `zero_from_flags`."""
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3),
                   help="what is partitioned across ranks: 1 optimizer states, 2 and gradients, "
                        "3 and parameters (default 3)")
    p.add_argument("--grad-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype gradients are reduced and kept in (default float32)")


def zero_from_flags(args: argparse.Namespace) -> dict[str, object]:
    """The Config fields of `add_zero_flags`."""
    return {"zero_stage": args.zero_stage, "grad_dtype": args.grad_dtype}


def add_state_format_flags(p: argparse.ArgumentParser) -> None:
    """--optimizer-state-dtype and --master-dtype; read them back with `state_format_from_flags`."""
    p.add_argument("--optimizer-state-dtype", default="float32", choices=STATE_DTYPES,
                   help="format of the optimizer's states on every tier and in checkpoints: float32 (default), "
                        "bfloat16 (half the bytes), int8 (blockwise, a quarter); docs/state-formats.md")
    p.add_argument("--master-dtype", default="float32", choices=MASTER_DTYPES,
                   help="master weights' dtype (default float32); bfloat16: the bf16 parameters are the master "
                        "weights, updated with stochastic rounding (computes in bfloat16)")


def state_format_from_flags(args: argparse.Namespace, compute_dtype: str = "auto") -> dict[str, object]:
    """The Config fields of `add_state_format_flags`; bf16 master weights compute in bf16."""
    if args.master_dtype == "bfloat16" and compute_dtype == "auto":
        compute_dtype = "bfloat16"
    return {"optimizer_state_dtype": args.optimizer_state_dtype, "master_dtype": args.master_dtype,
            "compute_dtype": compute_dtype}


def add_activation_flags(p: argparse.ArgumentParser) -> None:
    """--activations and --activation-checkpointing (read them back with `activations_from_flags`),
    --chunked-loss (harness.batch_loss's `chunked`)."""
    p.add_argument("--activations", default="device", choices=("device", "host", "nvme", "auto"),
                   help="where the activations saved for backward live (default device; auto: the device "
                        "while they fit its room, then host, then nvme)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each block's input and recompute the block in backward")
    p.add_argument("--chunked-loss", action="store_true",
                   help="a transformers model's loss from its hidden states a chunk of tokens at a time, never "
                        "the whole sequence's logits (tierzero.hf.causal_lm_loss: the same loss within fp32 "
                        "rounding, not bit for bit; the head's matmul once more in backward)")


def activations_from_flags(args: argparse.Namespace) -> dict[str, object]:
    """The Config fields of `add_activation_flags`."""
    return {"activations": args.activations, "activation_checkpointing": args.activation_checkpointing}
