"""`tierzero bench-io` in quick mode, and io_engine.aio helpers (benchmarks/io_throughput.py: tests/benchmarks)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import tomllib

import pytest

from io_engine import aio
from tierzero import cli
from tierzero.config.config import IOConfig


def test_bench_io_quick_json(tmp_path, capsys):
    rc = cli.main(["bench-io", "--dir", str(tmp_path), "--size", "8MiB", "--quick", "--json", "--no-progress"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    data = json.loads(out.out)
    assert data["size"] == 8 << 20 and data["dir"] == str(tmp_path) and isinstance(data["direct"], bool)
    assert data["engine"] and {"round", "op", "block_size", "threads", "gbps"} <= set(data["engine"][0])
    assert {e["op"] for e in data["engine"]} == {"write", "read"}
    best = data["best"]
    assert {"threads", "block_size", "direct", "write_gbps", "read_gbps"} <= set(best)
    io = tomllib.loads(data["config"]["toml"])["io"]  # the printed settings are what Config takes
    cfg = IOConfig(**io)
    assert (cfg.threads, cfg.block_size, cfg.direct) == (best["threads"], best["block_size"], best["direct"])
    assert data["config"]["python"].startswith("tz.IOConfig(")
    assert {"write", "read"} <= set(data["checksum"]) and data["checksum"]["read"]["ratio"] > 0
    assert {"engine_write_gbps", "engine_read_gbps"} <= set(data["summary"])
    fio = data["fio"]
    assert {"available", "version", "results", "note"} <= set(fio)
    if fio["available"] and data["direct"]:
        assert fio["results"] and set(data["ratios"]) == {"write", "read"}
        assert {"ratio_write", "ratio_read", "fio_write", "fio_read"} <= set(data["rounds"][0])
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".io_engine-bench")]  # file removed


def test_bench_io_human_output(tmp_path, capsys):
    rc = cli.main(["bench-io", "--dir", str(tmp_path / "new"), "--size", "4MiB", "--quick", "--no-fio"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "<- best" in out.out and re.search(r'TOML:\s+io = \{threads = \d+, block_size = "\d+\w*", direct = ', out.out)
    assert "checksum=True vs plain" in out.out and "] " in out.err  # progress bar on stderr


def test_bench_io_bad_dir_is_a_clear_error(tmp_path, capsys):
    rc = cli.main(["bench-io", "--dir", str(tmp_path / "a" / "b"), "--size", "4MiB", "--quick"])
    err = capsys.readouterr().err
    assert rc == 1 and "does not exist" in err and str(tmp_path / "a") in err


def test_aio_metadata_helpers(tmp_path):
    async def main():
        d = tmp_path / "x" / "y"
        await aio.make_dirs(d)
        f = await aio.preallocate(d / "f.bin", 10_000)
        size = await aio.file_size(f.path)
        f.close()
        await aio.remove(f.path)
        await aio.remove(f.path)  # missing_ok
        with pytest.raises(FileNotFoundError):
            await aio.remove(f.path, missing_ok=False)
        return size

    assert asyncio.run(main()) == 10_000
