"""The step at the disk's limit: how close a step whose whole training state lives on NVMe gets
to the time the drive needs for the bytes it moves, and how many bytes per parameter it moves.

Per model size and mode (clip: AdamW with gradient clipping; step_in_backward: each block
updated during backward, no clipping), a child process trains the built-in GPT in fp32 with
params, gradients and optimizer states homed on NVMe under fixed device and host budgets, and
reports per step: the wall time, the bytes the process read from and wrote to the disk (from
/proc/self/io, outside tierzero's own counters; they include O_DIRECT), the time the disk had
a request in flight (/sys/block/DEV/stat io_ticks) and, where the code under test counts
them, tierzero's bytes by kind; and the same clocks (wall, CPU, bytes) per phase of the step:
forward (with the wait for the last step's overlapped updates), backward, clip + opt.step(),
zero_grad. Each step's updates run under the next step's forward (Config.overlap_step), so
every step after the first carries exactly one step's updates (the first step's among them);
the last step's updates land after the last step, timed apart ("final_settle_s"), not counted.
The drive is measured in the same run with io_engine
(sequential O_DIRECT write and read of a file at tierzero's IO settings) before the models
train. Then, per steady step (the first is left out):

    bytes/param  (read + written) / parameters
    floor        read bytes / read rate + written bytes / write rate (the rounds' medians)
    step/floor   the step's time over the floor (1.0 = the drive's limit); "(best)": over the
                 floor at the best round's rates, the drive's real rate when another process's
                 IO slowed some rounds
    least/param  the least traffic the placement needs (tierzero.traffic), for reference
    CPU s/core   the process's CPU time per step (every thread, user + sys) over the cores: a
                 second floor, the one a machine whose cores cannot keep up with its drive meets
    minor faults the process's page faults per step: fresh memory touched (temporaries), which
                 costs CPU time on the CPU and allocations on a GPU

`--streams async` runs the children on the CPU's asynchronous stream stand-in (copies on their
own workers, events; `--poison` adds its poisoning), `sync` (the default) copies at once.
`--tree PATH` runs the children on another checkout (e.g. the code before a change) while the
drive measurement and the report stay this one's. Peak RSS of each child is measured from
outside (wait4's ru_maxrss).

    .venv/bin/python benchmarks/nvme_floor.py --nvme-dir runs/nvme-floor [--sizes 1b,3b]
        [--modes clip,step_in_backward] [--steps 3] [--host-budget 4GiB] [--streams sync|async]
        [--optimizer-state-dtype float32|bfloat16|int8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

SIZES = {"1b": {}, "3b": {}}
"""Named sizes are the built-in GPTs; "L{layers}x{width}" builds a custom one (16 heads)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/nvme_floor.py", description=__doc__.splitlines()[0])
    p.add_argument("--nvme-dir", default="runs/nvme-floor")
    p.add_argument("--sizes", default="1b,3b", help="comma list: built-in names or L{layers}x{width}")
    p.add_argument("--modes", default="clip,step_in_backward")
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is not counted")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32, help="short, so compute stays under the IO time")
    p.add_argument("--device-budget", default="2GiB")
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--drive-bytes", default="4GiB", help="file size for the drive measurement")
    p.add_argument("--io-threads", type=int, default=4, help="Config.io.threads of the runs (the drive "
                   "measurement keeps tierzero's default)")
    p.add_argument("--no-overlap-step", action="store_true", help="Config(overlap_step=False): opt.step() "
                   "updates every block before it returns (the default runs the updates under the next forward)")
    p.add_argument("--streams", default="sync", choices=("sync", "async"), help="the CPU's copy streams: at "
                   "once, or the asynchronous stand-in for the GPU's")
    p.add_argument("--poison", action="store_true", help="with --streams async: the stand-in's poisoning too")
    p.add_argument("--optimizer-state-dtype", default="float32", choices=("float32", "bfloat16", "int8"),
                   help="Config.optimizer_state_dtype of the runs (docs/state-formats.md)")
    p.add_argument("--tree", default=None, help="run the children on the tierzero checkout at PATH")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------- the drive

def measure_drive(nvme_dir: Path, nbytes: int, reps: int = 3) -> dict:
    """Sequential O_DIRECT write then read of one file with io_engine at tierzero's default IO
    settings (those the runs use); the median GB/s of `reps` rounds each."""
    from io_engine import PreallocatedFile, aligned_empty, bench
    from tierzero.config.config import IOConfig

    io = IOConfig()
    nvme_dir.mkdir(parents=True, exist_ok=True)
    path = nvme_dir / "drive.bin"
    buf = aligned_empty(nbytes)
    buf[:] = 7
    out: dict[str, list[float]] = {"write": [], "read": []}
    with PreallocatedFile(str(path), nbytes) as f:
        bench.engine_gbps(f, buf, "write", threads=io.threads, block_size=io.block_size, direct=True)  # allocate
        for _ in range(reps):
            for op in ("write", "read"):
                out[op].append(bench.engine_gbps(f, buf, op, threads=io.threads, block_size=io.block_size, direct=True))
    path.unlink()
    return {"write_gbps": statistics.median(out["write"]), "read_gbps": statistics.median(out["read"]),
            "runs": {k: [round(x, 3) for x in v] for k, v in out.items()}, "threads": io.threads,
            "block_size": io.block_size, "file_bytes": nbytes}


# ------------------------------------------------------------------------------- the child

def _proc_io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if line)
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _disk_of(path: Path) -> str | None:
    """The block device (whole disk) holding `path`, for its io_ticks."""
    dev = os.stat(path).st_dev
    sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysdev.exists():
        return None
    real = sysdev.resolve()
    disk = real.parent if (real / "partition").exists() else real
    return disk.name


def _io_ticks_s(disk: str | None) -> float | None:
    if disk is None:
        return None
    return int(Path(f"/sys/block/{disk}/stat").read_text().split()[9]) / 1000


class _Mark(NamedTuple):
    name: str
    t: float
    io: tuple[int, int]
    ticks: float | None
    cpu: float


def _mark(name: str, disk: str | None) -> _Mark:
    """The clocks at the end of a phase of a step: wall, process IO, disk io_ticks, CPU time."""
    return _Mark(name, time.perf_counter(), _proc_io(), _io_ticks_s(disk), time.process_time())


def child(spec: dict) -> None:
    """Train one size in one mode; one JSON line per step on stdout, then a final one."""
    import torch

    import tierzero as tz
    from tierzero import runtime
    from tierzero.models import GPT, GPTConfig, gpt_config

    torch.manual_seed(0)
    name = spec["size"]
    if name.startswith("L"):
        layers, width = (int(v) for v in name[1:].split("x"))
        gcfg = GPTConfig(vocab_size=50304, seq_len=spec["seq"], n_layer=layers, n_head=16, n_embd=width)
    else:
        gcfg = gpt_config(name, seq_len=spec["seq"])
    model = GPT(gcfg, device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    sib = spec["mode"] == "step_in_backward"
    cfg = tz.Config(device_budget=spec["device_budget"], host_budget=spec["host_budget"],
                    nvme_dir=spec["nvme_dir"], nvme_budget="1TiB", params="nvme", grads="nvme",
                    optimizer_states="nvme", compute_dtype="float32", step_in_backward=sib,
                    io=tz.IOConfig(threads=spec["io_threads"]),
                    **({"overlap_step": spec["overlap_step"]} if "overlap_step" in tz.Config.__dataclass_fields__ else {}),
                    **({"streams": spec["streams"], "stand_in": {"poison": spec["poison"]}}
                       if "streams" in tz.Config.__dataclass_fields__ else {}),
                    **({"optimizer_state_dtype": spec["optimizer_state_dtype"]}
                       if spec.get("optimizer_state_dtype", "float32") != "float32" else {}))
    Path(spec["nvme_dir"]).mkdir(parents=True, exist_ok=True)
    disk = _disk_of(Path(spec["nvme_dir"]))
    t0 = time.perf_counter()
    tz.wrap(model, cfg)
    opt = tz.AdamW(model, lr=1e-4)
    runtime.placement_manager(model).flush()
    print(json.dumps({"params": n_params, "wrap_s": time.perf_counter() - t0}), flush=True)
    g = torch.Generator().manual_seed(0)
    for step in range(spec["steps"]):
        x = torch.randint(0, gcfg.vocab_size, (spec["batch"], spec["seq"]), generator=g).to(model.wte.weight.device)
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        marks = [_mark("start", disk)]
        loss = model(x, x).loss
        marks.append(_mark("forward", disk))
        loss.backward()
        marks.append(_mark("backward", disk))
        if not sib:
            tz.clip_grad_norm_(model, 1.0)
        opt.step()
        marks.append(_mark("step", disk))
        opt.zero_grad()
        marks.append(_mark("flush", disk))
        (_, t0, io0, ticks0, cpu0), (_, t1, io1, ticks1, cpu1) = marks[0], marks[-1]
        stats = runtime.step_stats(model)
        row = {"step": step, "loss": loss.item(), "step_s": t1 - t0, "read_bytes": io1[0] - io0[0],
               "write_bytes": io1[1] - io0[1], "disk_busy_s": None if disk is None else ticks1 - ticks0,
               "stall_s": sum(stats.stall_s.values()), "cpu_s": cpu1 - cpu0,
               "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0,
               "phases": {b.name: {"s": b.t - a.t, "cpu_s": b.cpu - a.cpu, "read_bytes": b.io[0] - a.io[0],
                                   "write_bytes": b.io[1] - a.io[1]} for a, b in zip(marks, marks[1:])}}
        if hasattr(stats, "nvme_by_kind"):  # tierzero's own counters, where the code has them
            row["tz_by_kind"] = stats.nvme_by_kind
            row["tz_busy_s"] = stats.nvme_busy_s
        print(json.dumps(row), flush=True)
    # the last step's updates land here, outside the steps (see the module docstring)
    t0, io0 = time.perf_counter(), _proc_io()
    settle(model)
    io1, stats = _proc_io(), runtime.step_stats(model)
    print(json.dumps({"settle_s": time.perf_counter() - t0, "read_bytes": io1[0] - io0[0],
                      "write_bytes": io1[1] - io0[1], "tz_by_kind": getattr(stats, "nvme_by_kind", None)}),
          flush=True)
    runtime.close(model)


def settle(model) -> None:
    """Wait for the overlapped step's updates (where the code under test has them), then for
    every write."""
    from tierzero import runtime

    if hasattr(runtime, "settle"):
        runtime.settle(model)
    else:  # code from before the overlapped step
        runtime.placement_manager(model).flush()


def run_child(args: argparse.Namespace, size: str, mode: str) -> dict:
    nvme = Path(args.nvme_dir).resolve() / f"{size}-{mode}"
    spec = {"size": size, "mode": mode, "steps": args.steps, "batch": args.batch, "seq": args.seq,
            "device_budget": args.device_budget, "host_budget": args.host_budget, "nvme_dir": str(nvme),
            "io_threads": args.io_threads, "overlap_step": not args.no_overlap_step, "streams": args.streams,
            "poison": args.poison, "optimizer_state_dtype": args.optimizer_state_dtype}
    env = dict(os.environ)
    if args.tree:
        env["PYTHONPATH"] = str(Path(args.tree).resolve())
    cwd = args.tree or None
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, env=env, cwd=cwd, text=True)
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(json.loads(line))
        if "step" in lines[-1]:
            r = lines[-1]
            print(f"  {size} {mode} step {r['step']}: {r['step_s']:.1f} s, read {r['read_bytes'] / 1e9:.1f} GB, "
                  f"wrote {r['write_bytes'] / 1e9:.1f} GB", file=sys.stderr, flush=True)
    _, status, usage = os.wait4(proc.pid, 0)
    shutil.rmtree(nvme, ignore_errors=True)
    if status != 0:
        raise RuntimeError(f"child {size} {mode} failed (status {status})")
    head, settle = lines[0], lines[-1] if "settle_s" in lines[-1] else None  # --tree: older children have none
    steps = [line for line in lines[1:] if "step" in line]
    return {"size": size, "mode": mode, "params": head["params"], "wrap_s": head["wrap_s"], "steps": steps,
            "settle": settle, "peak_rss": usage.ru_maxrss * 1024}


# ------------------------------------------------------------------------------- the report

def summarise(run: dict, drive: dict, args: argparse.Namespace) -> dict:
    from tierzero.config.config import Config
    from tierzero.config import parse_size
    from tierzero.planning.traffic import DriveRates, step_traffic

    rates = DriveRates(drive["read_gbps"], drive["write_gbps"], "measured in this run")
    best = DriveRates(max(drive["runs"]["read"]), max(drive["runs"]["write"]), "best round in this run")
    steady = run["steps"][1:] or run["steps"]
    n = run["params"]
    mean = lambda k: statistics.mean(s[k] for s in steady)  # noqa: E731
    read, write, step_s = mean("read_bytes"), mean("write_bytes"), mean("step_s")
    floor = rates.floor_s(read, write)
    least = step_traffic(n, Config(nvme_dir=args.nvme_dir, params="nvme", grads="nvme", optimizer_states="nvme",
                                   compute_dtype="float32", step_in_backward=run["mode"] == "step_in_backward",
                                   optimizer_state_dtype=args.optimizer_state_dtype))
    out = {
        "size": run["size"], "mode": run["mode"], "params": n, "state_bytes": 16 * n, "wrap_s": run["wrap_s"],
        "step_s": step_s, "step_s_each": [round(s["step_s"], 2) for s in steady],
        "bytes_per_param_each": [round((s["read_bytes"] + s["write_bytes"]) / n, 2) for s in steady],
        "final_settle_s": None if run["settle"] is None else run["settle"]["settle_s"],
        "read_bytes": read, "write_bytes": write, "bytes_per_param": (read + write) / n,
        "floor_s": floor, "step_over_floor": step_s / floor,
        # against the best round of the drive measurement: another process's IO during a round
        # makes the median too slow a yardstick (and the ratio too kind)
        "floor_best_s": best.floor_s(read, write), "step_over_floor_best": step_s / best.floor_s(read, write),
        "least_bytes_per_param": (least.read + least.write) / n,
        "least_floor_s": rates.floor_s(least.read, least.write),
        "disk_busy_frac": None if steady[0]["disk_busy_s"] is None else mean("disk_busy_s") / step_s,
        "stall_s": mean("stall_s"), "peak_rss": run["peak_rss"],
        # CPU seconds (every thread, user + sys) per step, and over the machine's cores: a step
        # can be no shorter than that either, however fast the drive
        "cpu_s": mean("cpu_s") if "cpu_s" in steady[0] else None,
        "cpu_floor_s": mean("cpu_s") / (os.cpu_count() or 1) if "cpu_s" in steady[0] else None,
        # page faults of fresh memory: what temporaries made per step cost on the CPU
        "minor_faults": mean("minor_faults") if "minor_faults" in steady[0] else None,
        "phases": None if "phases" not in steady[0] else {
            name: {k: statistics.mean(st["phases"][name][k] for st in steady) for k in steady[0]["phases"][name]}
            for name in steady[0]["phases"]},
        "rss_limit": parse_size(args.device_budget) + parse_size(args.host_budget) + int(1.5 * 2**30),
    }
    if "tz_by_kind" in steady[0]:
        out["by_kind_per_param"] = {k: {op: statistics.mean(s["tz_by_kind"][k][op] for s in steady) / n
                                        for op in ("read", "write")}
                                    for k in steady[0]["tz_by_kind"] if any(s["tz_by_kind"][k]["read"] or
                                                                            s["tz_by_kind"][k]["write"] for s in steady)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    from tierzero.config import parse_size

    nvme_dir = Path(args.nvme_dir)
    free = shutil.disk_usage(nvme_dir if nvme_dir.exists() else nvme_dir.parent).free
    print(f"measuring the drive under {nvme_dir} ...", file=sys.stderr, flush=True)
    drive = measure_drive(nvme_dir, parse_size(args.drive_bytes))
    results = []
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            results.append(summarise(run_child(args, size, mode), drive, args))
    report = {"drive": drive, "df_free_bytes_at_start": free, "host_budget": args.host_budget,
              "device_budget": args.device_budget, "seq": args.seq, "batch": args.batch,
              "tree": args.tree or "this checkout", "streams": args.streams, "poison": args.poison, "runs": results}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"drive (io_engine, O_DIRECT, {drive['threads']} threads, {drive['block_size'] >> 20} MiB blocks): "
          f"read {drive['read_gbps']:.2f} GB/s, write {drive['write_gbps']:.2f} GB/s")
    print(f"{'size':>10} {'mode':>16} {'params':>7} {'state':>8} {'step s':>7} {'floor s':>7} {'step/floor':>10} "
          f"{'(best)':>6} "
          f"{'B/param':>7} {'least':>5} {'disk busy':>9} {'peak RSS':>9} {'CPU s/core':>10}")
    for r in results:
        busy = "-" if r["disk_busy_frac"] is None else f"{r['disk_busy_frac']:.0%}"
        print(f"{r['size']:>10} {r['mode']:>16} {r['params'] / 1e9:>6.2f}B {r['state_bytes'] / 2**30:>6.1f}Gi "
              f"{r['step_s']:>7.1f} {r['floor_s']:>7.1f} {r['step_over_floor']:>10.2f} "
              f"{r['step_over_floor_best']:>6.2f} {r['bytes_per_param']:>7.1f} "
              f"{r['least_bytes_per_param']:>5.0f} {busy:>9} {r['peak_rss'] / 2**30:>7.2f}Gi "
              f"{'-' if r['cpu_floor_s'] is None else format(r['cpu_floor_s'], '.1f'):>10}")
        if r["phases"]:
            print(" " * 28 + "phases (s, CPU s, R+W bytes/param): " + ", ".join(
                f"{k} {v['s']:.1f}, {v['cpu_s']:.1f}, {(v['read_bytes'] + v['write_bytes']) / r['params']:.1f}"
                for k, v in r["phases"].items()))
        if "by_kind_per_param" in r:
            print(" " * 28 + "by kind (read/write bytes per param): " + ", ".join(
                f"{k} {v['read']:.1f}/{v['write']:.1f}" for k, v in r["by_kind_per_param"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
