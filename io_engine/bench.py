"""`tierzero bench-io`: sweep IOEngine block size x threads on a directory, against fio.

Sequential O_DIRECT write then read of one preallocated file, per setting; the best setting is
printed as the `io` settings tierzero's Config accepts. When fio is installed, the same file is
written and read by fio (libaio, direct=1) over a small grid in the same run, and the
engine/fio ratios are printed. Before measuring, the file is written once untimed so every
measured write (engine and fio alike) overwrites allocated blocks. No fsync on either side.

    tierzero bench-io --dir /mnt/nvme --size 1GiB [--json] [--repeat 3] [--quick]
    python -m io_engine.bench ...   /   python -m io_engine ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .buffers import aligned_empty
from .engine import IOEngine
from .files import PreallocatedFile
from .progress import Progress
from .sizes import exact_size, parse_size

BLOCK_SIZES = (1 << 20, 4 << 20, 8 << 20, 16 << 20)
THREADS = (2, 4, 8, 16)
FIO_GRID = tuple((bs, depth, jobs) for bs in (1 << 20, 8 << 20) for depth in (8, 32) for jobs in (1, 4))
QUICK_BLOCK_SIZES = (1 << 20,)
QUICK_THREADS = (2, 4)
QUICK_FIO_GRID = ((1 << 20, 8, 1),)
OPS = ("write", "read")


@dataclass(frozen=True)
class EngineResult:
    round: int
    op: str
    block_size: int
    threads: int
    gbps: float
    """1e9 bytes per second."""


@dataclass(frozen=True)
class FioResult:
    round: int
    op: str
    bs: int
    iodepth: int
    numjobs: int
    gbps: float


@dataclass
class Report:
    dir: str
    size: int
    direct: bool
    repeat: int
    engine: list[EngineResult] = field(default_factory=list)
    fio: list[FioResult] = field(default_factory=list)
    fio_version: str | None = None
    fio_note: str | None = None
    head_to_head: dict | None = None
    checksum: dict | None = None


# -- measuring ----------------------------------------------------------------------------------

def engine_gbps(file: PreallocatedFile, buf: np.ndarray, op: str, *, threads: int, block_size: int,
                direct: bool, checksum: bool = False) -> float:
    """GB/s of one whole-buffer IOEngine pwrite or pread at offset 0 (thread start not timed)."""
    with IOEngine(threads=threads, block_size=block_size, direct=direct) as eng:
        call = eng.pwrite if op == "write" else eng.pread
        start = time.perf_counter()
        fut = call(file, buf, 0, checksum=checksum)
        fut.result()
        return buf.nbytes / (time.perf_counter() - start) / 1e9


def fio_command(path: str, size: int, op: str, bs: int, iodepth: int, numjobs: int) -> list[str]:
    """fio over the same file: numjobs jobs each covering size/numjobs bytes of it, O_DIRECT libaio."""
    part = size // numjobs
    return ["fio", "--name=tierzero-bench", f"--filename={path}", f"--rw={op}", f"--bs={bs}",
            f"--size={part}", f"--offset_increment={part}", f"--numjobs={numjobs}", f"--iodepth={iodepth}",
            "--ioengine=libaio", "--direct=1", "--fallocate=none", "--group_reporting",
            "--output-format=json"]


def run_fio(path: str, size: int, op: str, bs: int, iodepth: int, numjobs: int) -> float:
    """GB/s fio reports for one job group (bytes / the jobs' runtime)."""
    out = subprocess.run(fio_command(path, size, op, bs, iodepth, numjobs), capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed (exit {out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0][op]
    return job["bw_bytes"] / 1e9


def fio_version() -> str | None:
    exe = shutil.which("fio")
    if exe is None:
        return None
    return subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.strip() or "fio"


def measure(directory: str, size: int, *, block_sizes=BLOCK_SIZES, threads=THREADS, fio_grid=FIO_GRID,
            repeat: int = 1, use_fio: bool = True, checksum_reps: int = 3, progress: bool = True) -> Report:
    """Run the sweep `repeat` times (engine grid, then fio grid, per round) and the checksum check."""
    if not os.path.isdir(directory) and os.path.isdir(os.path.dirname(os.path.abspath(directory))):
        os.mkdir(directory)  # one missing level is made; a wrong parent stays a clear error below
    path = os.path.join(directory, f".io_engine-bench-{os.getpid()}.bin")
    version = fio_version() if use_fio else None
    with PreallocatedFile(path, size, remove_on_close=True) as file:
        report = Report(directory, size, file.direct, repeat, fio_version=version)
        if use_fio and version is None:
            report.fio_note = "fio not installed (apt-get install fio): no comparison"
        elif use_fio and not file.direct:
            report.fio_note = "the file system refuses O_DIRECT: fio direct=1 skipped"
        fio_grid = [g for g in fio_grid if size % (g[0] * g[2]) == 0] if version and file.direct else []
        buf = aligned_empty(size)
        _fill(buf)
        steps = (1 + repeat * (2 * len(block_sizes) * len(threads) + 2 * len(fio_grid))
                 + 4 * checksum_reps * (2 if fio_grid else 1))
        with Progress(steps, enabled=progress) as bar:
            engine_gbps(file, buf, "write", threads=4, block_size=8 << 20, direct=file.direct)
            bar.advance("untimed first write")
            for r in range(repeat):
                for bs in block_sizes:
                    for t in threads:
                        for op in OPS:
                            g = engine_gbps(file, buf, op, threads=t, block_size=bs, direct=file.direct)
                            report.engine.append(EngineResult(r, op, bs, t, g))
                            bar.advance(f"round {r + 1} engine {op} bs={exact_size(bs)} threads={t}: {g:.2f} GB/s")
                for bs, depth, jobs in fio_grid:
                    for op in OPS:
                        g = run_fio(path, size, op, bs, depth, jobs)
                        report.fio.append(FioResult(r, op, bs, depth, jobs, g))
                        bar.advance(f"round {r + 1} fio {op} bs={exact_size(bs)} iodepth={depth} "
                                    f"numjobs={jobs}: {g:.2f} GB/s")
            if checksum_reps and report.fio:
                report.head_to_head = _head_to_head(file, buf, report, checksum_reps, bar)
            if checksum_reps:
                report.checksum = _checksum_check(file, buf, best_setting(report), checksum_reps, bar)
    return report


def _fill(buf: np.ndarray) -> None:
    """Non-constant contents (a drive or file system could special-case zeros)."""
    words = buf[: buf.nbytes - buf.nbytes % 8].view(np.uint64)
    words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    buf[words.nbytes:] = 0x5A


def _best_of(results, key) -> tuple:
    """The key (a setting) with the highest mean GB/s over rounds."""
    per: dict[tuple, list[float]] = {}
    for r in results:
        per.setdefault(key(r), []).append(r.gbps)
    return max(per, key=lambda k: statistics.mean(per[k]))


def _head_to_head(file: PreallocatedFile, buf: np.ndarray, report: Report, reps: int, bar: Progress) -> dict:
    """The engine's best setting and fio's best job for each op, run alternately `reps` times:
    a comparison without the best-of-many-noisy-runs bias of the sweep maxima."""
    out = {}
    for op in OPS:
        bs, t = _best_of([e for e in report.engine if e.op == op], lambda e: (e.block_size, e.threads))
        fbs, depth, jobs = _best_of([f for f in report.fio if f.op == op], lambda f: (f.bs, f.iodepth, f.numjobs))
        eng, fio = [], []
        for _ in range(reps):
            eng.append(engine_gbps(file, buf, op, threads=t, block_size=bs, direct=file.direct))
            bar.advance(f"head to head engine {op}: {eng[-1]:.2f} GB/s")
            fio.append(run_fio(file.path, report.size, op, fbs, depth, jobs))
            bar.advance(f"head to head fio {op}: {fio[-1]:.2f} GB/s")
        e, f = statistics.median(eng), statistics.median(fio)
        out[op] = {"engine": {"block_size": bs, "threads": t}, "fio": {"bs": fbs, "iodepth": depth, "numjobs": jobs},
                   "engine_runs": [round(x, 3) for x in eng], "fio_runs": [round(x, 3) for x in fio],
                   "engine_gbps": round(e, 3), "fio_gbps": round(f, 3), "ratio": round(e / f, 3)}
    return out


def _checksum_check(file: PreallocatedFile, buf: np.ndarray, setting: dict, reps: int, bar: Progress) -> dict:
    """Plain vs checksum=True at the best setting, alternating, median of `reps` each."""
    out = {}
    for op in OPS:
        plain, summed = [], []
        for _ in range(reps):
            for flag, into in ((False, plain), (True, summed)):
                into.append(engine_gbps(file, buf, op, threads=setting["threads"], block_size=setting["block_size"],
                                        direct=file.direct, checksum=flag))
                bar.advance(f"checksum check {op} checksum={flag}: {into[-1]:.2f} GB/s")
        p, s = statistics.median(plain), statistics.median(summed)
        out[op] = {"plain_gbps": round(p, 3), "checksum_gbps": round(s, 3), "ratio": round(s / p, 3),
                   "plain_runs": [round(x, 3) for x in plain], "checksum_runs": [round(x, 3) for x in summed]}
    return out


# -- summarising --------------------------------------------------------------------------------

def best_setting(report: Report) -> dict:
    """The setting with the least total write + read time (mean GB/s per op over rounds)."""
    per: dict[tuple[int, int], dict[str, list[float]]] = {}
    for e in report.engine:
        per.setdefault((e.block_size, e.threads), {"write": [], "read": []})[e.op].append(e.gbps)
    def total_time(item):
        g = item[1]
        return sum(1 / statistics.mean(g[op]) for op in OPS)
    (bs, t), g = min(per.items(), key=total_time)
    return {"threads": t, "block_size": bs, "direct": report.direct,
            "write_gbps": round(statistics.mean(g["write"]), 3), "read_gbps": round(statistics.mean(g["read"]), 3)}


def rounds_summary(report: Report) -> list[dict]:
    """Per round: the engine's best and fio's best GB/s for each op, and engine/fio ratios."""
    out = []
    for r in range(report.repeat):
        row: dict = {"round": r}
        for op in OPS:
            eng = max((e for e in report.engine if e.round == r and e.op == op), key=lambda e: e.gbps)
            row[f"engine_{op}"] = {"gbps": round(eng.gbps, 3), "block_size": eng.block_size, "threads": eng.threads}
            fio = [f for f in report.fio if f.round == r and f.op == op]
            if fio:
                best = max(fio, key=lambda f: f.gbps)
                row[f"fio_{op}"] = {"gbps": round(best.gbps, 3), "bs": best.bs, "iodepth": best.iodepth,
                                    "numjobs": best.numjobs}
                row[f"ratio_{op}"] = round(eng.gbps / best.gbps, 3)
        out.append(row)
    return out


def config_lines(setting: dict) -> dict:
    bs = exact_size(setting["block_size"])
    direct = setting["direct"]
    return {"toml": f'io = {{threads = {setting["threads"]}, block_size = "{bs}", direct = {str(direct).lower()}}}',
            "python": f'tz.IOConfig(threads={setting["threads"]}, block_size="{bs}", direct={direct})'}


def to_json(report: Report) -> dict:
    best = best_setting(report)
    rounds = rounds_summary(report)
    ratios = {op: round(statistics.median(r[f"ratio_{op}"] for r in rounds), 3)
              for op in OPS if all(f"ratio_{op}" in r for r in rounds)}
    summary = {f"engine_{op}_gbps": round(statistics.median(r[f"engine_{op}"]["gbps"] for r in rounds), 3)
               for op in OPS}
    for op in OPS:
        if all(f"fio_{op}" in r for r in rounds):
            summary[f"fio_{op}_gbps"] = round(statistics.median(r[f"fio_{op}"]["gbps"] for r in rounds), 3)
    return {
        "dir": report.dir, "size": report.size, "direct": report.direct, "repeat": report.repeat,
        "summary": summary,
        "engine": [asdict(e) | {"gbps": round(e.gbps, 3)} for e in report.engine],
        "best": best, "config": config_lines(best),
        "fio": {"available": report.fio_version is not None, "version": report.fio_version, "note": report.fio_note,
                "results": [asdict(f) | {"gbps": round(f.gbps, 3)} for f in report.fio]},
        "rounds": rounds, "ratios": ratios, "head_to_head": report.head_to_head, "checksum": report.checksum,
    }


def format_human(report: Report) -> str:
    data = to_json(report)
    best = data["best"]
    lines = [f"io_engine sequential {'O_DIRECT' if report.direct else 'buffered (O_DIRECT refused)'} IO on "
             f"{report.dir}, file {exact_size(report.size)}, {report.repeat} round(s); GB/s = 1e9 bytes/s", ""]
    lines.append(f"{'block':>7} {'threads':>7} {'write GB/s':>11} {'read GB/s':>10}")
    per: dict[tuple[int, int], dict[str, list[float]]] = {}
    for e in report.engine:
        per.setdefault((e.block_size, e.threads), {"write": [], "read": []})[e.op].append(e.gbps)
    for (bs, t), g in per.items():
        mark = "  <- best" if (bs, t) == (best["block_size"], best["threads"]) else ""
        lines.append(f"{exact_size(bs):>7} {t:>7} {statistics.mean(g['write']):>11.2f} "
                     f"{statistics.mean(g['read']):>10.2f}{mark}")
    lines += ["", "best settings for tierzero (least write + read time):",
              f"  TOML:   {data['config']['toml']}", f"  Python: {data['config']['python']}"]
    if report.fio:
        lines += ["", "engine best vs fio best (libaio, direct=1, same file) per round:"]
        for r in data["rounds"]:
            lines.append("  round {}: write {:.2f} vs {:.2f} GB/s = {:.2f}x   read {:.2f} vs {:.2f} GB/s = {:.2f}x".format(
                r["round"] + 1, r["engine_write"]["gbps"], r["fio_write"]["gbps"], r["ratio_write"],
                r["engine_read"]["gbps"], r["fio_read"]["gbps"], r["ratio_read"]))
        lines.append(f"  median ratio: write {data['ratios']['write']:.2f}x, read {data['ratios']['read']:.2f}x")
    if report.head_to_head:
        lines += ["", "head to head (each side's best setting, run alternately, median):"]
        for op in OPS:
            h = report.head_to_head[op]
            lines.append(f"  {op}: engine bs={exact_size(h['engine']['block_size'])} threads={h['engine']['threads']} "
                         f"{h['engine_gbps']:.2f} GB/s vs fio bs={exact_size(h['fio']['bs'])} iodepth="
                         f"{h['fio']['iodepth']} numjobs={h['fio']['numjobs']} {h['fio_gbps']:.2f} GB/s = {h['ratio']:.2f}x")
    elif report.fio_note:
        lines += ["", report.fio_note]
    if report.checksum:
        lines += ["", "checksum=True vs plain at the best setting (median):"]
        for op in OPS:
            c = report.checksum[op]
            lines.append(f"  {op}: {c['checksum_gbps']:.2f} vs {c['plain_gbps']:.2f} GB/s = {c['ratio']:.2f}x")
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------------

def _sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(s, what="block size") for s in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(","))


def parser(prog: str = "tierzero bench-io") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Sweep io_engine block size x threads (sequential "
                                "O_DIRECT write then read) on a directory, against fio when installed.")
    p.add_argument("--dir", required=True, help="directory on the drive to measure (a temporary file is made there)")
    p.add_argument("--size", default="1GiB", help="file size (default 1GiB; needs as much free RAM for the buffer)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--quick", action="store_true", help="a few settings, one fio run, one checksum rep (seconds)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the whole sweep (default 1)")
    p.add_argument("--block-sizes", type=_sizes, default=None, help="comma list, e.g. 1MiB,8MiB")
    p.add_argument("--threads", type=_ints, default=None, help="comma list, e.g. 4,8")
    p.add_argument("--no-fio", action="store_true", help="skip the fio comparison")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None, *, prog: str = "tierzero bench-io") -> int:
    args = parser(prog).parse_args(argv)
    try:
        size = parse_size(args.size, what="--size")
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if size < 4096 or size % 4096:
        print(f"{prog}: error: --size must be a multiple of 4096 bytes, got {args.size!r}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print(f"{prog}: error: --repeat must be >= 1, got {args.repeat}", file=sys.stderr)
        return 2
    block_sizes = args.block_sizes or (QUICK_BLOCK_SIZES if args.quick else BLOCK_SIZES)
    threads = args.threads or (QUICK_THREADS if args.quick else THREADS)
    try:
        report = measure(args.dir, size, block_sizes=block_sizes, threads=threads,
                         fio_grid=QUICK_FIO_GRID if args.quick else FIO_GRID, repeat=args.repeat,
                         use_fio=not args.no_fio, checksum_reps=1 if args.quick else 3,
                         progress=not args.no_progress)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(to_json(report)) if args.json else format_human(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m io_engine.bench"))
