"""Checkpoints: crash-safe folders of every rank's shards, loadable at another world size, and
exports to plain weights.

    format.py     the folder's format: manifest, rank files, checksums, numbering
    chunk_io.py   streaming shards to and from files through io_engine, double-buffered
    reshard.py    which saved ranges a rank of another world size reads
    save_load.py  tz.save_checkpoint / tz.load_checkpoint
    export.py     tz.export_checkpoint (safetensors file or transformers folder), tz.load_weights
"""

from tierzero.checkpoint.export import export_checkpoint, load_weights
from tierzero.checkpoint.format import (MANIFEST, PREFIX, TMP_PREFIX, TRASH_PREFIX, CheckpointError, checkpoints,
                                        latest_checkpoint, not_own_checkpoint, open_checkpoint)
from tierzero.checkpoint.save_load import load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "export_checkpoint", "load_weights", "CheckpointError",
           "latest_checkpoint", "open_checkpoint", "not_own_checkpoint", "checkpoints", "MANIFEST", "PREFIX",
           "TMP_PREFIX", "TRASH_PREFIX"]
