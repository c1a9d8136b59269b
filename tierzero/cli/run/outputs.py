"""What `tierzero train` checks before its first step about the folders it will write at the end:
each can be written where it will be written, and the --export folder (replaced whole by the
export) is not one that holds the run's own files.

The probe is real: a file created, written, fsynced and removed in the folder the output goes
to (for --export, the folder that will hold it: its parent, or the nearest existing folder
above), on the real mount with the real permissions, so a read-only mount, /proc, a path under
a file or a full inode table fail here and not after the last step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from tierzero.formats import check_folder_target


def check_outputs(args: argparse.Namespace, ckpt_dir: Path) -> None:
    """ValueError / OSError, before anything is built, when an output of the run cannot be
    written where it goes (see the module docstring)."""
    if args.checkpoint_every:
        probe_write(_nearest_folder(ckpt_dir.absolute(), "--checkpoint-dir"), "--checkpoint-dir", ckpt_dir)
    if args.export:
        check_export(Path(args.export), {"--nvme-dir": args.nvme_dir, "--run-dir": args.run_dir,
                                         "--checkpoint-dir": ckpt_dir if args.checkpoint_every else None})


def check_export(export: Path, others: dict[str, str | os.PathLike[str] | None]) -> None:
    """The --export folder: a model folder may go there (`check_folder_target`), it is not and
    does not contain any of `others` (flag: folder) that the export would replace, it is not a
    mount point (an export is renamed into place), and its parent can be written."""
    real = Path(os.path.realpath(export.absolute()))
    for flag, folder in others.items():
        if folder is None:
            continue
        inner = Path(os.path.realpath(Path(folder).absolute()))
        if inner == real or inner.is_relative_to(real):
            raise ValueError(f"--export {str(export)!r} {'is' if inner == real else 'contains'} {flag} {str(folder)!r}: "
                             f"the export replaces its folder whole, with what the run keeps there; give --export a "
                             f"folder outside {flag}")
    check_folder_target(export)
    if real.is_dir() and os.path.ismount(real):
        raise ValueError(f"--export {str(export)!r} is a mount point: an export is written beside its folder and "
                         "renamed into place, which a mount point cannot be; give a folder inside the mount")
    probe_write(_nearest_folder(real.parent, "--export"), "--export", export)


def _nearest_folder(path: Path, flag: str) -> Path:
    """`path`, or the nearest folder above it that exists (where its missing folders would be
    made); ValueError when that is a file."""
    for p in (path, *path.parents):
        if os.path.lexists(p):
            if not p.is_dir():
                raise ValueError(f"{flag} {str(path)!r}: {str(p)!r} is a file, not a folder; give a path in a folder")
            return p
    return Path("/")


def probe_write(folder: Path, flag: str, given: str | os.PathLike[str]) -> None:
    """OSError naming `flag` and the folder when a file cannot be created, written, fsynced and
    removed in `folder`."""
    probe = folder / f".tierzero-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"tierzero write probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as e:
        raise OSError(e.errno, f"{flag} {str(given)!r}: cannot write in {str(folder)!r} ({e.strerror}), checked "
                      f"before the first step so that the trained model is not lost at the end; give {flag} a "
                      "folder this user can write") from None
