"""A script that ends right after `opt.step()`: the step's queued updates finish before the
interpreter tells waiting threads it is exiting, and nothing is printed as a failure."""

from __future__ import annotations

import os
import subprocess
import sys

from builders import REPO

SCRIPT = """
import time
from tierzero.placement.storage.swap_dirs import exiting
from tierzero.runtime.step.step_queue import StepQueue

queue = StepQueue()

def update():  # an update still running when the main thread ends (a wait for room would fail once exiting)
    time.sleep(0.5)
    print("the update saw the exit" if exiting() else "the update finished", flush=True)

queue.submit("blocks.0", "blocks.0", update)
"""


def run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_queued_update_finishes_before_the_exit_is_announced() -> None:
    proc = run(SCRIPT)
    assert proc.returncode == 0 and proc.stdout == "the update finished\n", (proc.stdout, proc.stderr)
    assert proc.stderr == ""
