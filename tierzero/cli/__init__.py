"""The `tierzero` command (dispatch.py dispatches; each subcommand is a module here):

    dispatch.py  dispatch: train | estimate | bench-io | export | tune
    flags.py     flags several subcommands share
    harness.py   building a model and its data the way train and tune both do
    train.py     `tierzero train`: a run folder (metrics.jsonl, trace.json, tiers.png, summary.json)
    tune.py      `tierzero tune`: prefetch settings measured and predicted
    estimate.py  `tierzero estimate`: bytes per tier, traffic, what fits
    export.py    `tierzero export`: a checkpoint as safetensors or a transformers folder
    run/         one run's parts: its folder, steps, end files, exports, tiers.png, stop signals
    micro_batches.py  --micro-batches: checked against memory, one step's forward and backward
    caches.py    the libraries' caches kept private to the command
"""

from tierzero.cli.dispatch import main

__all__ = ["main"]
