"""Crossings on paths through tierzero, traced on real calls on the CPU (sys.setprofile,
tierzero and io_engine frames only, the calling thread only: the IO workers' calls are not
counted).

The default report, `paths`: four paths, on the built-in GPT (3 layers and the root: 4 blocks,
fp32, NVMe swap in a temporary folder), each traced after two warm-up steps:
- fetch: one block's fetch in forward, its parameters homed on NVMe and its cached copies
  dropped (Block.hold of the middle layer, prefetch policy "none" so the fetch is the block's
  own, not a read started ahead);
- update: one block's update in opt.step(), optimizer states split device/host/NVMe (one window
  per block: TieredOptimizer._step_flat; the figures are the range over the blocks);
- micro-batch: each extra micro-batch in tz.accumulate over the 4 blocks (a step of 3
  micro-batches less a step of 2);
- save: tz.save_checkpoint of the model and its AdamW (12 stored tensors: 4 blocks' parameters
  and two moments).

Counted in a path (a window: from the root call to its return, everything it calls):
- calls: every call of a function of a tierzero module (a generator or context manager resumed
  counts again, as Python's profiler reports it; properties are calls);
- modules: the distinct tierzero modules called;
- module switches: the calls whose caller (the nearest tierzero frame below the callee on the
  stack, frames of torch, contextlib or greenlet passed over) is in another module;
- worst back-and-forth: the pair of modules with the most switches between them, A -> B and
  B -> A added (each switch is a trip there and back);
- backs and worst callback: the switches back into a module the path is still inside (A -> B ->
  A, or A -> B -> C -> A: a frame of A lower on the stack), all of them and the pair (the caller's
  module and A) with the most: the calls that come back rather than go down.

`--edges` gives the older report instead: package crossings (or module crossings, `--level
module`) by edge on (a) the optimizer's update of one block in opt.step() and (b) one fetch of
a block whose parameters are homed on NVMe. There a crossing is a call whose function lies in
another package than the nearest tierzero (or io_engine) frame below it: `tierzero.optim ->
tierzero.runtime` counts once per call, however deep in torch or the standard library the call
was made. Model: parameters, gradients and optimizer states homed on NVMe, the step inline (no
overlap) so the update runs on this thread; (a) is the whole opt.step() divided by the blocks
it updates, (b) entering tz.gathered_params on one layer after its cached copies were dropped.
Also counted: the distinct (calling function, called function) pairs that cross.

From any worktree (traces whichever tierzero is imported):
    PYTHONPATH=<tree> .venv/bin/python <tree>/benchmarks/crossings.py [--json]
    PYTHONPATH=<tree> .venv/bin/python <tree>/benchmarks/crossings.py --edges [--level module]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.models import GPT, GPTConfig
from tierzero.optim.base import TieredOptimizer
from tierzero.prefetch import FetchPhase
from tierzero.runtime.blocks import Block

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
    _uncache(state.pm)  # the fetch reads the layer's parameters from NVMe
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


# ---------------------------------------------------------------------------------- the four paths
# Each path is traced as windows: every call of a root function (the predicate picks which) opens
# a window on this thread, closed when that frame returns; the tierzero calls made inside it are
# the window's events, each as (caller module, callee module): the caller is the nearest tierzero
# frame below the callee on the stack (frames of torch, contextlib or greenlet are passed over),
# or None where there is none.


class Event(NamedTuple):
    caller: str | None
    callee: str
    back: bool = False
    """A switch into a module that has a frame lower on the stack (inside the window): the path
    went out of it and comes back into it before returning."""


def trace(fn: Callable[[], Any], root: Callable[..., Any],
          pick: Callable[[Any], bool] = lambda frame: True) -> list[list[Event]]:
    """Run `fn`; one list of events per call of `root` that `pick(frame)` accepts."""
    code = getattr(root, "__code__", None) or root.__func__.__code__
    windows: list[list[Event]] = []
    open_frame: list[Any] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "return":
            if open_frame and frame is open_frame[0]:
                open_frame.clear()
            return
        if event != "call":
            return
        callee = unit_of(frame.f_globals.get("__name__"), "module")
        if callee is None:
            return
        if not open_frame:
            if frame.f_code is code and pick(frame):
                open_frame.append(frame)
                windows.append([Event(None, callee)])
            return
        caller = frame.f_back
        while caller is not None and unit_of(caller.f_globals.get("__name__"), "module") is None:
            caller = caller.f_back
        back = False
        if caller is not None and caller.f_globals["__name__"] != callee:
            below = caller.f_back
            while below is not None and not back:
                back = below.f_globals.get("__name__") == callee
                below = None if below is open_frame[0] else below.f_back
        windows[-1].append(Event(None if caller is None else caller.f_globals["__name__"], callee, back))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return windows


def figures(events: list[Event], less: list[Event] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """calls: the window's tierzero calls (a generator resumed counts as a call, as Python's
    profiler reports it); modules: the distinct modules called; switches: calls whose caller is
    in another module than the callee; worst: the pair of modules with the most switches between
    them, both ways counted (A -> B and B -> A: each a trip there and back); backs: the switches
    back into a module the path is still inside (A -> B -> A, or A -> B -> C -> A: a callback
    into A, counted for the pair of its caller and A), worst_back the pair with most. With `less`: the
    figures of `events` less those of `less` (modules: those of `events`)."""
    pairs = _pairs(events)
    pairs.subtract(_pairs(less))
    top = sorted(pairs.items(), key=lambda kv: -kv[1])[:8]
    backs = _pairs([e for e in events if e.back])
    backs.subtract(_pairs([e for e in less if e.back]))
    worst_back = max(backs.items(), key=lambda kv: kv[1], default=None)
    return {"calls": len(events) - len(less), "modules": len({e.callee for e in events}),
            "switches": sum(pairs.values()), "backs": sum(backs.values()),
            "worst_back": f"{worst_back[0][0]} <-> {worst_back[0][1]} {worst_back[1]}" if worst_back else "-",
            "worst_back_n": worst_back[1] if worst_back else 0,
            "worst": f"{top[0][0][0]} <-> {top[0][0][1]} {top[0][1]}" if top else "-",
            "worst_n": top[0][1] if top else 0,
            "pairs": {f"{a} <-> {b}": n for (a, b), n in top}}


def _pairs(events: list[Event]) -> collections.Counter[tuple[str, str]]:
    pairs: collections.Counter[tuple[str, str]] = collections.Counter()
    for e in events:
        if e.caller is not None and e.caller != e.callee:
            pairs[tuple(sorted((short(e.caller), short(e.callee))))] += 1  # type: ignore[index]
    return pairs


def short(module: str) -> str:
    """tierzero.placement.residency -> placement.residency."""
    return module.removeprefix("tierzero.")


def _paths_model(nvme_dir: str, **kw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, seq_len=16, n_layer=3, n_head=4, n_embd=64))
    base: dict[str, Any] = dict(device_budget="64MiB", host_budget="64MiB", nvme_dir=nvme_dir, nvme_budget="256MiB",
                                compute_dtype="float32", params="nvme", grads="nvme", optimizer_states="nvme",
                                overlap_step=False)
    base.update(kw)
    model = tz.wrap(model, tz.Config(**base))
    return model, tz.AdamW(model, lr=1e-3)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(seed))


def _loss(out: Any, mb: Any = None) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return logits.float().square().mean()


def _warm(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for s in range(steps):
        opt.zero_grad()
        _loss(model(_batch(s))).backward()
        opt.step()


def _uncache(pm: Any) -> None:
    """Every copy written home and dropped from the host and device: nothing cached."""
    pm.flush()
    for h in pm.handles:
        for tier in ("host", "device"):
            if h.home.value != tier:
                pm.drop(h, tier)


def path_fetch(nvme_dir: str) -> list[list[Event]]:
    model, opt = _paths_model(nvme_dir, prefetch={"policy": "none"})
    _warm(model, opt)
    state = runtime.state_of(model)
    name = next(b.name for b in state.blocks if any(m is model.blocks[1] for m in b.modules))
    runtime.settle(model)
    _uncache(state.pm)  # the fetch reads the block's parameters from NVMe
    opt.zero_grad()

    def pick(frame: Any) -> bool:
        return frame.f_locals["self"].name == name and frame.f_locals["phase"] is FetchPhase.FORWARD

    windows = trace(lambda: _loss(model(_batch(9))).backward(), Block.hold, pick)
    runtime.close(model)
    return windows


def path_update(nvme_dir: str) -> list[list[Event]]:
    model, opt = _paths_model(nvme_dir, params="host", grads="host",
                              optimizer_states={"device": 0.34, "host": 0.33, "nvme": 0.33})
    _warm(model, opt)
    opt.zero_grad()
    _loss(model(_batch(9))).backward()
    windows = trace(opt.step, TieredOptimizer._step_flat)
    runtime.close(model)
    return windows


def path_micro_batch(nvme_dir: str) -> tuple[list[Event], list[Event]]:
    """The events of a tz.accumulate step of 2 micro-batches and of one of 3."""
    model, opt = _paths_model(nvme_dir)
    _warm(model, opt)
    runs = []
    for k in (2, 3):
        opt.zero_grad()
        tz.accumulate(model, [_batch(20 + i) for i in range(k)], _loss)  # untraced: the k's first step
        opt.zero_grad()
        runs.append(trace(lambda: tz.accumulate(model, [_batch(30 + i) for i in range(k)], _loss),
                          tz.accumulate)[0])
    runtime.close(model)
    return runs[0], runs[1]


def path_save(nvme_dir: str, folder: str) -> list[list[Event]]:
    model, opt = _paths_model(nvme_dir)
    _warm(model, opt)
    windows = trace(lambda: tz.save_checkpoint(folder, model, opt), tz.save_checkpoint)
    runtime.close(model)
    return windows


def measure_paths() -> dict[str, dict[str, Any]]:
    """The four paths' figures (see `figures`); the update's as "lo-hi" over its blocks, the
    micro-batch's as a step of 3 less a step of 2."""
    with tempfile.TemporaryDirectory() as tmp:
        fetch = path_fetch(f"{tmp}/fetch")
        update = path_update(f"{tmp}/update")
        two, three = path_micro_batch(f"{tmp}/mb")
        save = path_save(f"{tmp}/save", f"{tmp}/ckpt")
        text = next(Path(f"{tmp}/ckpt").rglob("manifest.json")).read_text()
        manifest = json.loads(text.split("\n", 1)[1])  # after the checksum line
        stored = sum(len(flat["kinds"]) for flat in manifest["flats"])
    assert len(fetch) == 1 and len(save) == 1, (len(fetch), len(save))
    out = {"fetch": figures(fetch[0]), "update": _span([figures(w) for w in update]),
           "micro-batch": figures(three, less=two), "save": figures(save[0])}
    out["save"]["stored_tensors"] = stored
    out["tree"] = {"path": str(Path(tz.__file__).parents[1])}
    return out


def _span(per_block: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"blocks": len(per_block)}
    for key in ("calls", "modules", "switches", "worst_n", "backs", "worst_back_n"):
        lo, hi = min(f[key] for f in per_block), max(f[key] for f in per_block)
        out[key] = lo if lo == hi else f"{lo}-{hi}"
    most = max(per_block, key=lambda f: f["worst_n"])
    out["worst"], out["pairs"] = most["worst"], most["pairs"]
    out["worst_back"] = max(per_block, key=lambda f: f["worst_back_n"])["worst_back"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/crossings.py", description=__doc__.splitlines()[0])
    p.add_argument("--edges", action="store_true", help="the older report: crossings by edge on an update and a fetch")
    p.add_argument("--nvme-dir", default=None, help="--edges: swap files' folder (default: a temporary one)")
    p.add_argument("--layers", type=int, default=3, help="--edges: the GPT's layers")
    p.add_argument("--level", choices=("package", "module"), default="package", help="--edges: what a unit is")
    p.add_argument("--pairs", action="store_true", help="also each path's 8 pairs of modules most crossed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.edges:
        paths = measure_paths()
        if args.json:
            print(json.dumps(paths))
            return 0
        print(f"tree {paths.pop('tree')['path']}")
        print(f"{'path':<13}{'calls':>10}{'modules':>9}{'switches':>10}  {'worst back-and-forth':<48}{'backs':>8}"
              "  worst callback")
        for name, f in paths.items():
            print(f"{name:<13}{f['calls']!s:>10}{f['modules']!s:>9}{f['switches']!s:>10}  {f['worst']:<48}"
                  f"{f['backs']!s:>8}  {f['worst_back']}")
            for pair, n in f["pairs"].items() if args.pairs else ():
                print(f"{'':<13}{n:>10}  {pair}")
        return 0
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
