"""The `tierzero` command: train | estimate | bench-io | export | tune.

Each subcommand lives in the module that owns its work; this file dispatches to it and holds
the flags that several subcommands share.
"""

from __future__ import annotations

import argparse
import sys

from tierzero.config import TIER_NAMES


def add_placement_flags(p: argparse.ArgumentParser) -> None:
    """--params, --grads and --optimizer-states; read them back with `placement_from_flags`."""
    p.add_argument("--params", default=None, choices=TIER_NAMES,
                   help="home tier of parameters (default: nvme when --nvme-dir is given, else host)")
    p.add_argument("--optimizer-states", default=None, choices=TIER_NAMES,
                   help="tier of fp32 master weights and moments (default: as --params)")
    p.add_argument("--grads", default=None, choices=TIER_NAMES,
                   help="tier of gradients (default: as --params)")


def placement_from_flags(args: argparse.Namespace) -> dict[str, str]:
    """The Config placement fields from the flags of `add_placement_flags` (and --nvme-dir)."""
    params = args.params or ("nvme" if args.nvme_dir else "host")
    return {"params": params, "grads": args.grads or params,
            "optimizer_states": args.optimizer_states or params}


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


def _bench_io(argv: list[str]) -> int:
    from io_engine import bench

    return bench.main(argv)


def _train(argv: list[str]) -> int:
    from tierzero import train

    return train.main(argv)


def _estimate(argv: list[str]) -> int:
    from tierzero import estimate

    return estimate.main(argv)


def _export(argv: list[str]) -> int:
    from tierzero import export

    return export.main(argv)


def _tune(argv: list[str]) -> int:
    from tierzero import tune

    return tune.main(argv)


_COMMANDS = {
    "estimate": (_estimate, "bytes per tier for a built-in model and a config"),
    "bench-io": (_bench_io, "sweep io_engine block size x threads against fio on a directory"),
    "export": (_export, "write a checkpoint's model as a safetensors file or a transformers folder"),
    "train": (_train, "train a built-in GPT with tiered state into a run folder"),
    "tune": (_tune, "measure (or predict) prefetch settings on a model and print the best as config"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tierzero", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=sorted(_COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in sorted(_COMMANDS.items())))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    return _COMMANDS[args.command][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
