"""The `tierzero` command: train | estimate | bench-io | export | tune.

Each subcommand is a module of tierzero.cli (bench-io is io_engine's); this file parses only
the subcommand's name and imports that one module, so that `tierzero estimate` does not load
what `tierzero train` needs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tierzero.cli.caches import private_caches

_MODULES = {"bench-io": "io_engine.bench", "train": "tierzero.cli.train", "estimate": "tierzero.cli.estimate",
            "export": "tierzero.cli.export", "tune": "tierzero.cli.tune"}
"""The module whose main(argv) runs each subcommand."""


_COMMANDS = {
    "estimate": "bytes per tier for a model and a config, what fits this machine",
    "bench-io": "sweep io_engine block size x threads against fio on a directory",
    "export": "write a checkpoint's model as a safetensors file or a transformers folder",
    "train": "train a built-in GPT or a transformers model with tiered state into a run folder",
    "tune": "measure (or predict) prefetch settings on a model and print the best as config",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tierzero", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=sorted(_COMMANDS),
                        help="; ".join(f"{k}: {v}" for k, v in sorted(_COMMANDS.items())))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    try:
        with private_caches():  # before the subcommand imports what keeps caches: [Note: private caches]
            return importlib.import_module(_MODULES[args.command]).main(argv[1:])
    except (ValueError, OSError) as e:  # bad input the subcommand did not word itself: one line
        print(f"tierzero {args.command}: error: {e}", file=sys.stderr)
        return 2
