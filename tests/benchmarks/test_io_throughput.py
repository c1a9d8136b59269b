"""benchmarks/io_throughput.py in quick mode, and `python -m io_engine`, the same benchmark."""

from __future__ import annotations

import json
import subprocess
import sys

from builders import REPO


def test_io_throughput_script_and_module_entry(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/io_throughput.py", "--dir", str(tmp_path), "--size", "4MiB",
                          "--quick", "--repeat", "1", "--json", "--no-progress", "--no-fio"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["size"] == 4 << 20
    out = subprocess.run([sys.executable, "-m", "io_engine", "--help"], capture_output=True, text=True, cwd="/",
                         timeout=60)
    assert out.returncode == 0 and "--dir" in out.stdout
