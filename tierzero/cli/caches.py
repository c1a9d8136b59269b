"""The caches the libraries under `tierzero` keep, kept private to the run (see [Note: private
caches])."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from io_engine import not_own, owner_gone

# [Note: private caches]
# torch's inductor (and triton under it) cache compiled kernels, code that a later run loads and
# runs; matplotlib caches its font list. By default they live in /tmp/torchinductor_<user> (made
# when torch._dynamo is first imported, which a run does even without --compile) and in the home
# folder. A world-writable /tmp/torchinductor_<user> planted by another user before the first run
# would be used as it is: that user could swap the kernels. So the `tierzero` command points every
# such cache the user has not placed (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, MPLCONFIGDIR) into
# one private folder it makes for the command (mkdtemp: 0700, this user's) and removes at its end:
# nothing is left in /tmp or the home folder, and a compiled run compiles afresh. The variables are
# set in the command's process before those libraries read them (they read them when first used,
# not at import). The folder's name carries the command's PID, so one left by a killed command
# (SIGKILL runs no cleanup) is removed by this user's next command once that PID is gone. A cache folder the user gave is theirs to place, but a run that compiles refuses
# one that is another user's, a link, or writable by group or others (`check_compile_cache`).
CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton",
                   "MPLCONFIGDIR": "matplotlib"}
"""The environment variables set for the command, and their folders in its private one."""


PREFIX = "tierzero-caches-"
"""The private folders' names: PREFIX, mkdtemp's letters, '-' and the command's PID (as
io_engine's temp_name ends them, so owner_gone reads it)."""


def _reclaim_killed() -> None:
    """Remove the private cache folders this user's killed commands left (their PID gone): only
    real folders of this user's, named as private_caches names them."""
    for entry in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            st = os.lstat(entry)
        except OSError:
            continue
        if owner_gone(entry.name) and not not_own(st, folder=True):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def private_caches() -> Iterator[Path]:
    """The command's private cache folder, each of CACHE_VARIABLES the user did not set pointing
    into it, for the duration of the block; the folder removed and the variables unset after."""
    _reclaim_killed()
    folder = Path(tempfile.mkdtemp(prefix=PREFIX, suffix=f"-{os.getpid()}"))
    ours = [var for var in CACHE_VARIABLES if var not in os.environ]
    for var in ours:
        os.environ[var] = str(folder / CACHE_VARIABLES[var])
    try:
        yield folder
    finally:
        for var in ours:
            os.environ.pop(var, None)
        shutil.rmtree(folder, ignore_errors=True)


def compile_cache() -> Path:
    """The folder torch.compile will cache kernels in: TORCHINDUCTOR_CACHE_DIR, else inductor's
    default, /tmp/torchinductor_<user> (the `tierzero` command sets the variable: [Note: private
    caches])."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(given) if given else Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"


def check_compile_cache(folder: Path) -> None:
    """ValueError when `folder` exists and is not a private folder of this user: a link, another
    user's, or writable by group or others (its compiled kernels could be swapped)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    mode = stat.S_IMODE(st.st_mode)
    why = not_own(st, folder=True) or (f"writable by others than you (mode {mode:04o})" if mode & 0o022 else "")
    if why:
        raise ValueError(f"--compile: torch.compile's cache {str(folder)!r} is {why}: whoever can write there can "
                         "swap the kernels this run would load and run. Point TORCHINDUCTOR_CACHE_DIR at a folder of "
                         "your own that only you can write (chmod 700), or unset it (the tierzero command then uses "
                         "a private folder of its own)")
