"""Package-boundary crossings on two paths through tierzero: (a) the optimizer's update of one
block in opt.step() and (b) one fetch of a block whose parameters are homed on NVMe.

A crossing is a Python call whose function lies in another package than the nearest tierzero
(or io_engine) frame below it on the calling thread's stack: `tierzero.optim -> tierzero.runtime`
counts once per call, however deep in torch or the standard library the call was made (a
`with` statement's contextlib frames are passed over). Properties count: they are calls. Only
the calling thread is watched (sys.setprofile): the IO workers' calls are not a crossing of the
caller's path. `--level module` counts module boundaries instead (tierzero.placement.manager ->
tierzero.placement.residency), the path inside one package.

The model: the built-in GPT (`--layers` blocks and the root), fp32, parameters, gradients and
optimizer states homed on NVMe, the step inline (no overlap) so the update runs on this thread.
(a) is the whole opt.step() divided by the blocks it updates; (b) is entering
tz.gathered_params on one layer after its cached copies were dropped. Also counted: the
distinct (calling function, called function) pairs that cross, the places in the code a path
goes over a package line however often it runs them.

    .venv/bin/python benchmarks/crossings.py --nvme-dir runs/crossings [--level module] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.models import GPT, GPTConfig

WATCHED = ("tierzero.", "io_engine")
"""Module name prefixes whose frames are ends of a crossing."""


def unit_of(module: str | None, level: str) -> str | None:
    """The package (`level` "package": tierzero.X, io_engine) or module a frame's module counts as;
    None for frames outside tierzero and io_engine."""
    if not module or not module.startswith(WATCHED):
        return None
    if level == "module":
        return module
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "tierzero" and len(parts) > 1 else parts[0]


def count(fn: Callable[[], Any], *, level: str = "package",
          sites: set[tuple[str, str]] | None = None) -> collections.Counter[tuple[str, str]]:
    """Run `fn` and count its crossings on this thread, by (from, to); `sites` (when given)
    receives each distinct (calling function, called function) pair that crossed."""
    crossings: collections.Counter[tuple[str, str]] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = unit_of(frame.f_globals.get("__name__"), level)
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None:
            unit = unit_of(caller.f_globals.get("__name__"), level)
            if unit is not None:
                if unit != callee:
                    crossings[(unit, callee)] += 1
                    if sites is not None:
                        sites.add((_where(caller), _where(frame)))
                return
            caller = caller.f_back

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return crossings


def _where(frame: Any) -> str:
    return f"{frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}"


def build(nvme_dir: str, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, seq_len=16, n_layer=layers, n_head=4, n_embd=64))
    config = tz.Config(device_budget="64MiB", host_budget="64MiB", nvme_dir=nvme_dir, nvme_budget="256MiB",
                       compute_dtype="float32", params="nvme", grads="nvme", optimizer_states="nvme",
                       overlap_step=False)
    model = tz.wrap(model, config)
    return model, tz.AdamW(model, lr=1e-3)


def backward(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    logits.float().square().mean().backward()


def measure(nvme_dir: str, layers: int, level: str) -> dict[str, Any]:
    """Crossings of (a) one block's update, (b) one NVMe fetch, with the counts by edge."""
    model, opt = build(nvme_dir, layers)
    backward(model, opt)
    opt.step()  # the first step registers and warms what later steps reuse
    backward(model, opt)
    update_sites: set[tuple[str, str]] = set()
    update = count(opt.step, level=level, sites=update_sites)
    blocks = sum(1 for f in runtime.state_of(model).flat_params(trainable=True))
    runtime.settle(model)
    state = runtime.state_of(model)
    layer = model.blocks[len(model.blocks) // 2]
    pm = state.pm
    pm.flush()
    for h in pm.handles:  # nothing cached: the fetch reads the layer's parameters from NVMe
        for tier in ("host", "device"):
            if h.home.value != tier:
                pm.drop(h, tier)
    gathered = tz.gathered_params(model, modules=layer)
    fetch_sites: set[tuple[str, str]] = set()
    fetch = count(gathered.__enter__, level=level, sites=fetch_sites)
    gathered.__exit__(None, None, None)
    runtime.close(model)
    return {"tree": str(Path(tz.__file__).parents[1]), "level": level, "blocks_updated": blocks,
            "update_per_block": round(sum(update.values()) / blocks, 1), "update_step_total": sum(update.values()),
            "fetch": sum(fetch.values()), "update_sites": len(update_sites), "fetch_sites": len(fetch_sites),
            "update_edges": {f"{a} -> {b}": n for (a, b), n in update.most_common()},
            "fetch_edges": {f"{a} -> {b}": n for (a, b), n in fetch.most_common()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/crossings.py", description=__doc__.splitlines()[0])
    p.add_argument("--nvme-dir", default=None, help="swap files' folder (default: a temporary one)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--level", choices=("package", "module"), default="package")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        nvme_dir = args.nvme_dir or str(Path(tmp) / "nvme")
        result = measure(nvme_dir, args.layers, args.level)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"tree {result['tree']}: {args.level} crossings: update of one block {result['update_per_block']} "
          f"({result['update_step_total']} over {result['blocks_updated']} blocks), one NVMe fetch {result['fetch']}; "
          f"distinct crossing calls (caller, callee): step {result['update_sites']}, fetch {result['fetch_sites']}")
    for what in ("update_edges", "fetch_edges"):
        print(f"  {what}:")
        for edge, n in result[what].items():
            print(f"    {n:6d}  {edge}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
