"""Checkpoints: exact save/load on every tier, keep_last, the double-buffered IO loop,
corruption of every file kind, a different model, missing files, a corrupt swap file and a full
disk while saving, resharding N -> M (pure plans and real multi-rank files), safetensors export
and import."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tierzero as tz
from tierzero.checkpoint import save_load as ck
from tierzero.checkpoint import format as fmt
from tierzero.checkpoint import chunk_io as ckpt_io
from tierzero.checkpoint import reshard
from tierzero import runtime
from tierzero.config.config import IOConfig
from tierzero.placement.handles import Kind
from tierzero.formats import load_safetensors, persistent_buffers
from tierzero.layout.flat_layout import FlatLayout

from builders import REPO
from io_engine.safe_files import MARKER
D, VOCAB = 37, 29


class Net(nn.Module):
    """Uneven shapes, a tied embedding/head, a frozen norm, three repeated layers, running
    statistics in a persistent buffer (and a non-persistent one that is not saved)."""

    def __init__(self, d: int = D, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d + 5), nn.GELU(), nn.Linear(d + 5, d))
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.norm.requires_grad_(False)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("running", torch.zeros(d))
        self.register_buffer("scratch", torch.ones(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(h.mean(dim=(0, 1)), alpha=0.1)
        return self.head(self.norm(h) + self.running.to(h.dtype))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (3, 11), generator=g), torch.randint(0, VOCAB, (3, 11), generator=g)


@pytest.fixture
def make(tmp_path):
    made = []

    def make(tier: str = "nvme", *, seed: int = 0, layers: int = 3, dtype: str = "float32",
             optimizer: bool = True) -> tuple[nn.Module, Any]:
        torch.manual_seed(seed)
        model = Net(layers=layers)
        # device-tier states with device-tier gradients: one update kernel over both, as CUDA needs
        cfg = tz.Config(device_budget="8MiB", host_budget="64MiB", nvme_dir=str(tmp_path / "nvme"),
                        nvme_budget="64MiB", params=tier, optimizer_states=tier, compute_dtype=dtype,
                        grads="device" if tier == "device" else "host")
        tz.wrap(model, cfg)
        made.append(model)
        return model, (tz.AdamW(model, lr=1e-2, weight_decay=0.1) if optimizer else None)

    yield make
    for m in made:
        runtime.close(m)


def train(model: nn.Module, opt: Any, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x, y = batch(s)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        tz.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def tiered_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the placement manager holds for the model except gradients."""
    runtime.settle(model)  # read through the placement manager: after the last step's updates
    pm = runtime.placement_manager(model)
    return {h.name: pm.read(h).clone() for h in pm.handles if h.kind is not Kind.GRAD}


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = tiered_state(a), tiered_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert torch.equal(a.running, b.running) and a.running.abs().sum() > 0


# --------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("tier,dtype", [("nvme", "float32"), ("host", "float32"), ("device", "float32"),
                                        ("nvme", "bfloat16")])
def test_save_load_is_exact_and_training_continues_identically(make, tmp_path, tier, dtype):
    a, opt_a = make(tier, dtype=dtype)
    train(a, opt_a, range(3))
    rng = torch.get_rng_state()
    folder = tz.save_checkpoint(tmp_path / "ck", a, opt_a, extra={"step": 3, "rng": rng})
    assert folder == tmp_path / "ck" / "ckpt-00000001"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "rank00000.bin", "rank00000.pt"]
    b, opt_b = make(tier, seed=1, dtype=dtype)
    extra = tz.load_checkpoint(tmp_path / "ck", b, opt_b)
    assert extra["step"] == 3 and torch.equal(extra["rng"], rng)
    assert_same_state(a, b)
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    assert [opt_b.saved_state().steps(f) for f in opt_b.flat_params] == [3] * len(opt_b.flat_params)
    assert train(a, opt_a, range(3, 6)) == train(b, opt_b, range(3, 6))
    assert_same_state(a, b)


def test_sgd_with_momentum_round_trip(make, tmp_path):
    a, _ = make("nvme", optimizer=False)
    opt_a = tz.SGD(a, lr=0.05, momentum=0.9)
    train(a, opt_a, range(2))
    tz.save_checkpoint(tmp_path / "ck", a, opt_a)
    b, _ = make("nvme", seed=1, optimizer=False)
    opt_b = tz.SGD(b, lr=0.05, momentum=0.9)
    tz.load_checkpoint(tmp_path / "ck", b, opt_b)
    assert_same_state(a, b)
    assert train(a, opt_a, range(2, 4)) == train(b, opt_b, range(2, 4))
    c, opt_c = make("nvme", seed=2)  # AdamW state is not in an SGD checkpoint
    with pytest.raises(fmt.CheckpointError, match="no optimizer state 'exp_avg'.*saved with optimizer SGD"):
        tz.load_checkpoint(tmp_path / "ck", c, opt_c)


def test_model_only_checkpoint_and_optimizer_mismatch(make, tmp_path):
    a, _ = make(optimizer=False)
    tz.save_checkpoint(tmp_path / "ck", a)
    b, opt_b = make(seed=1)
    with pytest.raises(fmt.CheckpointError, match="manifest.json.*(no optimizer state|without an optimizer)"):
        tz.load_checkpoint(tmp_path / "ck", b, opt_b)
    c, _ = make(seed=2, optimizer=False)
    tz.load_checkpoint(tmp_path / "ck", c)
    for k, v in a.state_dict().items():
        assert torch.equal(v, c.state_dict()[k]), k


def test_keep_last_and_latest(make, tmp_path):
    a, opt = make("host")
    for step in range(1, 5):
        train(a, opt, range(step - 1, step))
        tz.save_checkpoint(tmp_path / "ck", a, opt, extra={"step": step}, keep_last=2)
    assert [p.name for p in fmt.checkpoints(tmp_path / "ck")] == ["ckpt-00000003", "ckpt-00000004"]
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-00000003", "ckpt-00000004"]
    b, opt_b = make("host", seed=1)
    assert tz.load_checkpoint(tmp_path / "ck", b, opt_b)["step"] == 4
    assert tz.load_checkpoint(tmp_path / "ck" / "ckpt-00000003", b, opt_b)["step"] == 3
    with pytest.raises(ValueError, match="keep_last"):
        tz.save_checkpoint(tmp_path / "ck", a, opt, keep_last=0)
    with pytest.raises(fmt.CheckpointError, match="no checkpoint there"):
        tz.load_checkpoint(tmp_path / "empty", b, opt_b)


DEAD_PID = 2**22 + 12345  # above the kernel's pid_max default: never a live process


def test_leftover_of_an_interrupted_save_is_ignored_then_removed_by_its_owners_successor(make, tmp_path):
    """A save's temporary folder is named by its process and marked as tierzero's: a killed
    save's is removed by the next save; one whose process lives (another run saving there now)
    is left to it; look-alikes without the marker (a user's `.tmp-ckpt-notes-<n>`) stay."""
    a, opt = make("host")
    tz.save_checkpoint(tmp_path / "ck", a, opt, extra=1)
    dead = tmp_path / "ck" / f".tmp-ckpt-00000002-{DEAD_PID}"
    live = tmp_path / "ck" / f".tmp-ckpt-00000007-{os.getppid()}"
    look_alikes = [tmp_path / "ck" / f".tmp-ckpt-notes-{DEAD_PID}", tmp_path / "ck" / f".trash-ckpt-old-{DEAD_PID}"]
    for leftover in (dead, live, tmp_path / "ck" / f".trash-ckpt-ckpt-00000000-{DEAD_PID}", *look_alikes):
        leftover.mkdir()
        (leftover / "rank00000.bin").write_bytes(b"half")
        if leftover not in look_alikes:
            (leftover / MARKER).write_text(f"{DEAD_PID}\n")
    b, opt_b = make("host", seed=1)
    assert tz.load_checkpoint(tmp_path / "ck", b, opt_b) == 1
    tz.save_checkpoint(tmp_path / "ck", a, opt, extra=2)
    assert sorted(os.listdir(tmp_path / "ck")) == sorted(["ckpt-00000001", "ckpt-00000002", live.name,
                                                          *(p.name for p in look_alikes)])
    assert all((p / "rank00000.bin").read_bytes() == b"half" for p in look_alikes)


def test_a_save_killed_between_its_mkdir_and_its_marker_leaves_nothing_behind(make, tmp_path):
    """A kill right after a save made its temporary folder, before the marker: the folder is empty,
    and the next save removes it (rmdir, which takes no content); the same name holding a file,
    unmarked, is not tierzero's to remove and stays."""
    a, opt = make("host")
    tz.save_checkpoint(tmp_path / "ck", a, opt, extra=1)
    empty = tmp_path / "ck" / f".tmp-ckpt-00000002-{DEAD_PID}"
    full = tmp_path / "ck" / f".tmp-ckpt-00000005-{DEAD_PID}"
    for folder in (empty, full):
        folder.mkdir()
    (full / "notes.txt").write_text("mine")
    tz.save_checkpoint(tmp_path / "ck", a, opt, extra=2)
    assert not empty.exists()
    assert (full / "notes.txt").read_text() == "mine"


def test_another_users_dead_leftover_is_left_to_them(make, tmp_path):
    """Root's save leaves another user's marked leftover of a dead process alone (a second uid)."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    a, opt = make("host")
    theirs = tmp_path / "ck" / f".tmp-ckpt-00000005-{DEAD_PID}"
    theirs.mkdir(parents=True)
    (theirs / MARKER).write_text(f"{DEAD_PID}\n")
    for p in (theirs, theirs / MARKER):
        os.chown(p, 4321, 4321)
    tz.save_checkpoint(tmp_path / "ck", a, opt)
    assert (theirs / MARKER).is_file()


def test_pruning_leaves_a_linked_or_another_users_checkpoint_alone_and_the_save_stands(make, tmp_path):
    """keep_last over a `ckpt-N` that is a symlink to a folder elsewhere, and over one another user
    owns (a second uid, as root): neither is touched nor counted; the new checkpoints are
    published and pruned among themselves."""
    a, opt = make("host")
    tz.save_checkpoint(tmp_path / "elsewhere", a, opt, extra=0)
    tz.save_checkpoint(tmp_path / "ck", a, opt, extra=1)
    os.rename(tmp_path / "ck" / "ckpt-00000001", tmp_path / "ck" / "ckpt-00000002")
    os.symlink(tmp_path / "elsewhere" / "ckpt-00000001", tmp_path / "ck" / "ckpt-00000001")
    theirs = ["ckpt-00000002"] if os.geteuid() == 0 else []
    for p in theirs:
        for f in [tmp_path / "ck" / p, *(tmp_path / "ck" / p).iterdir()]:
            os.chown(f, 65534, 65534, follow_symlinks=False)
    for step in (3, 4, 5):
        tz.save_checkpoint(tmp_path / "ck", a, opt, extra=step, keep_last=1)
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-00000001", *theirs, "ckpt-00000005"]
    assert (tmp_path / "elsewhere" / "ckpt-00000001" / "manifest.json").is_file()


def test_checkpoints_are_private_unless_asked(tmp_path, wrapped):
    old = os.umask(0o022)
    try:
        for file_mode, folder, file in (("private", 0o700, 0o600), ("umask", 0o755, 0o644)):
            model = wrapped(Net(), tz.Config(device_budget="8MiB", host_budget="64MiB", file_mode=file_mode))
            out = tz.save_checkpoint(tmp_path / file_mode, model, tz.AdamW(model, lr=1e-2))
            assert stat.S_IMODE(out.parent.stat().st_mode) == folder and stat.S_IMODE(out.stat().st_mode) == folder
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
            assert modes == {name: file for name in modes} and "manifest.json" in modes
    finally:
        os.umask(old)


class _Future:
    """Stands for a read or write still running: it logs being waited for."""

    def __init__(self, log: list[tuple[str, int]], i: int) -> None:
        self.log, self.i = log, i

    def result(self) -> None:
        self.log.append(("wait", self.i))

    def exception(self) -> None:
        self.log.append(("drain", self.i))


def test_double_buffered_overlaps_neighbours_and_drains_every_started_item_on_failure():
    log: list[tuple[str, int]] = []
    bufs: dict[int, int] = {}

    def start(i: int, buf: np.ndarray) -> list[_Future]:
        bufs[i] = buf.ctypes.data
        log.append(("start", i))
        return [_Future(log, i)]

    def finish(i: int, futures: list[_Future]) -> None:
        futures[0].result()
        if i == fail_at:
            raise OSError(f"item {i}")
        log.append(("finish", i))

    fail_at = None
    ckpt_io.double_buffered(4, 4096, start, finish)
    assert log == [("start", 0), ("start", 1), ("wait", 0), ("finish", 0), ("start", 2), ("wait", 1),
                   ("finish", 1), ("start", 3), ("wait", 2), ("finish", 2), ("wait", 3), ("finish", 3)]
    assert bufs[0] == bufs[2] != bufs[1] == bufs[3]
    log.clear()
    fail_at = 1
    with pytest.raises(OSError, match="item 1"):
        ckpt_io.double_buffered(4, 4096, start, finish)
    assert log[-3:] == [("wait", 1), ("drain", 1), ("drain", 2)]  # nothing left running on a buffer


def test_region_offsets_put_each_region_on_a_page_and_pad_it_to_a_whole_page():
    sizes = [1, 0, 4096, 4097, 12]
    offsets = fmt.region_offsets(sizes)
    assert offsets == [0, 4096, 4096, 8192, 16384, 20480]  # the last: the data file's size
    assert all(o % 4096 == 0 for o in offsets)
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [fmt.round_up(n) for n in sizes]
    assert fmt.region_offsets([]) == [0]


# ------------------------------------------------------------------------- bad checkpoints


def _flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x10]))


def test_flipping_any_byte_of_any_file_fails_the_load_naming_the_file(make, tmp_path):
    a, opt = make("nvme", dtype="bfloat16")
    train(a, opt, range(2))
    folder = tz.save_checkpoint(tmp_path / "ck", a, opt, extra={"step": 2})
    manifest = fmt.read_manifest(folder / "manifest.json")
    regions = sorted(manifest.ranks[0].regions.values())
    rng = random.Random(0)
    b, opt_b = make("nvme", seed=1, dtype="bfloat16")
    for name in ("manifest.json", "rank00000.bin", "rank00000.pt"):
        path = folder / name
        size = path.stat().st_size
        positions = {0, 1, size // 2, size - 1, *rng.sample(range(size), 12)}
        if name == "manifest.json":
            positions |= set(range(0, 60))  # every byte of the header line
        if name == "rank00000.bin":  # a padding byte of every region and the first byte of the next
            positions |= {r.offset + r.nbytes for r in regions if r.length > r.nbytes}
            positions |= {r.offset for r in regions}
        for pos in sorted(positions):
            _flip(path, pos)
            with pytest.raises(fmt.CheckpointError) as e:
                tz.load_checkpoint(tmp_path / "ck", b, opt_b)
            assert str(path) in str(e.value), (name, pos, str(e.value))
            _flip(path, pos)
    tz.load_checkpoint(tmp_path / "ck", b, opt_b)  # restored: loads again
    assert_same_state(a, b)


def test_truncated_and_missing_files(make, tmp_path):
    a, opt = make("host")
    folder = tz.save_checkpoint(tmp_path / "ck", a, opt)
    b, opt_b = make("host", seed=1)
    for name in ("rank00000.bin", "rank00000.pt"):
        path = folder / name
        data = path.read_bytes()
        path.write_bytes(data[:-100])
        with pytest.raises(fmt.CheckpointError, match="truncated") as e:
            tz.load_checkpoint(folder, b, opt_b)
        assert str(path) in str(e.value)
        path.unlink()
        with pytest.raises(fmt.CheckpointError, match="missing") as e:
            tz.load_checkpoint(folder, b, opt_b)
        assert str(path) in str(e.value)
        path.write_bytes(data)
    (folder / "manifest.json").write_bytes((folder / "manifest.json").read_bytes()[:300])
    with pytest.raises(fmt.CheckpointError, match="checksum mismatch") as e:
        tz.load_checkpoint(folder, b, opt_b)
    assert str(folder / "manifest.json") in str(e.value)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(make, tmp_path):
    a, opt = make("host", layers=2)
    tz.save_checkpoint(tmp_path / "ck", a, opt)
    b, opt_b = make("host", seed=1, layers=3)
    before = tiered_state(b)
    with pytest.raises(fmt.CheckpointError, match="different model") as e:
        tz.load_checkpoint(tmp_path / "ck", b, opt_b)
    assert str(tmp_path / "ck" / "ckpt-00000001" / "manifest.json") in str(e.value)
    torch.manual_seed(0)
    wider = Net(d=D + 1, layers=2)
    tz.wrap(wider, tz.Config(device_budget="8MiB", host_budget="64MiB", compute_dtype="float32"))
    try:
        with pytest.raises(fmt.CheckpointError, match=r"different model: block .* holds"):
            tz.load_checkpoint(tmp_path / "ck", wider)
    finally:
        runtime.close(wider)
    b_same, opt_same = make("host", seed=1, layers=2)
    b_same.register_buffer("extra_stat", torch.zeros(2))
    with pytest.raises(fmt.CheckpointError, match=r"rank00000.pt.* holds buffers"):
        tz.load_checkpoint(tmp_path / "ck", b_same, opt_same)
    after = tiered_state(b)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_swap_file_fails_the_save_and_keeps_the_previous_checkpoint(make, tmp_path, damage):
    a, opt = make("nvme")
    train(a, opt, range(1))
    tz.save_checkpoint(tmp_path / "ck", a, opt, extra="first")
    pm = runtime.placement_manager(a)
    swap_file, offset = pm.nvme_location(opt.flat_params[1].master)  # where the tensor lives
    if damage == "flip":
        _flip(Path(swap_file), offset + 5)
    else:
        os.truncate(swap_file, offset + 100)
    with pytest.raises(OSError, match="checksum mismatch" if damage == "flip" else "read past end of file") as e:
        tz.save_checkpoint(tmp_path / "ck", a, opt, extra="second")
    assert swap_file in str(e.value)
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-00000001"]
    b, opt_b = make("nvme", seed=1)
    assert tz.load_checkpoint(tmp_path / "ck", b, opt_b) == "first"


def test_disk_full_while_saving_keeps_the_live_run_and_the_previous_checkpoint(tmp_path):
    """RLIMIT_FSIZE in a child process makes the checkpoint file exceed the allowed size."""
    code = textwrap.dedent(f"""
        import json, os, resource, signal, sys, torch
        sys.path[:0] = [{str(REPO / "tests")!r}, {str(REPO / "tests" / "checkpoint")!r}]
        import tierzero as tz
        from test_checkpoint import Net, train, tiered_state
        torch.manual_seed(0)
        model = Net()
        tz.wrap(model, tz.Config(device_budget="8MiB", host_budget="64MiB", compute_dtype="float32"))
        opt = tz.AdamW(model, lr=1e-2)
        train(model, opt, range(2))
        root = {str(tmp_path / "ck")!r}
        tz.save_checkpoint(root, model, opt, extra="first")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
        out = {{}}
        try:
            tz.save_checkpoint(root, model, opt, extra="second")
        except OSError as e:
            out["error"], out["errno"] = str(e), e.errno
        out["after_fail"] = sorted(os.listdir(root))
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        out["losses"] = train(model, opt, range(2, 4))  # the live run goes on
        tz.save_checkpoint(root, model, opt, extra="third")
        fresh = Net()
        tz.wrap(fresh, tz.Config(device_budget="8MiB", host_budget="64MiB", compute_dtype="float32"))
        fresh_opt = tz.AdamW(fresh, lr=1e-2)
        out["loaded"] = tz.load_checkpoint(root, fresh, fresh_opt)
        a, b = tiered_state(model), tiered_state(fresh)
        out["same"] = all(torch.equal(a[k], b[k]) for k in a)
        print(json.dumps(out))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errno"] == 27 and "EFBIG" in out["error"]  # EFBIG
    assert re.search(re.escape(str(tmp_path / "ck" / ".tmp-ckpt-00000002-")) + r"\d+/rank00000.bin", out["error"])
    assert out["after_fail"] == ["ckpt-00000001"]
    assert out["loaded"] == "third" and out["same"]
    ref_losses = _reference_losses()
    assert out["losses"] == ref_losses[2:4]


def _reference_losses() -> list[float]:
    torch.manual_seed(0)
    model = Net()
    tz.wrap(model, tz.Config(device_budget="8MiB", host_budget="64MiB", compute_dtype="float32"))
    try:
        return train(model, tz.AdamW(model, lr=1e-2), range(4))
    finally:
        runtime.close(model)


# ----------------------------------------------------------------------------- resharding


def _layout(n_params: int, world: int, itemsize: int, seed: int) -> FlatLayout:
    rng = random.Random(seed)
    shapes = [torch.Size([rng.randint(1, 9), rng.randint(1, 13)]) for _ in range(n_params)]
    return FlatLayout.build([f"p{i}" for i in range(n_params)], shapes, world, itemsize=itemsize)


def _shards(layout: FlatLayout, values: list[np.ndarray]) -> list[np.ndarray]:
    flat = np.zeros(layout.padded_numel, np.float32)
    for s, v in zip(layout.slots, values):
        flat[s.offset:s.offset + s.numel] = v
    return [flat[slice(*layout.shard_range(r))] for r in range(layout.world_size)]


@pytest.mark.parametrize("seed", range(3))
def test_reshard_plan_n_to_m_pure(seed):
    for n in (1, 2, 3, 5):
        for m in (1, 2, 4, 7):
            for old_item, new_item in ((4, 4), (2, 4), (4, 2)):
                old = _layout(7, n, old_item, seed)
                new = FlatLayout.build([s.fqn for s in old.slots], [s.shape for s in old.slots], m, itemsize=new_item)
                values = [np.random.default_rng(seed + i).standard_normal(s.numel).astype(np.float32)
                          for i, s in enumerate(old.slots)]
                saved, want = _shards(old, values), _shards(new, values)
                for r in range(m):
                    got = np.zeros(new.shard_numel, np.float32)
                    for op in reshard.reshard_plan(old, new, r):
                        got[op.dst_start:op.dst_start + op.count] = saved[op.src_rank][op.src_start:op.src_start + op.count]
                    np.testing.assert_array_equal(got, want[r], err_msg=f"{n} -> {m} ranks, rank {r}")
    with pytest.raises(ValueError, match="different parameters"):
        reshard.reshard_plan(_layout(3, 1, 4, 0), _layout(4, 1, 4, 0), 0)


def _synthetic_checkpoint(folder: Path, model: nn.Module, opt: Any, world: int, chunk: int) -> dict[str, np.ndarray]:
    """Write `model`'s state as if `world` ranks had saved it (layouts of that world size);
    returns each stored tensor's full unpadded values by region key."""
    state = runtime.state_of(model)
    pm = state.pm
    folder.mkdir(parents=True)
    full, flats, per_rank = {}, [], [[] for _ in range(world)]
    for flat in state.flat_params():
        layout = FlatLayout.build([s.fqn for s in flat.layout.slots], [s.shape for s in flat.layout.slots], world,
                                  itemsize=2)
        states = opt.saved_state().blocks[flat] if flat.trainable else None
        names = ["values", *(states.states if states is not None else [])]
        for kind in names:
            values = (pm.read(flat.values) if states is None or kind == "values" else states.read(kind)).numpy()
            slots = [values[s.offset:s.offset + s.numel] for s in flat.layout.slots]
            full[f"{flat.param.name}/{kind}"] = slots
            for r, shard in enumerate(_shards(layout, slots)):
                shard = np.ascontiguousarray(shard)
                per_rank[r].append(ckpt_io.Source(
                    f"{flat.param.name}/{kind}", shard.nbytes,
                    lambda buf, s=shard: buf.__setitem__(slice(0, s.nbytes), s.view(np.uint8))))
        flats.append(fmt.FlatEntry(name=flat.param.name, trainable=flat.trainable, layout=layout,
                                   dtypes=tuple(str(d).removeprefix("torch.") for d in flat.orig_dtypes),
                                   kinds={k: "float32" for k in names},
                                   steps=opt.saved_state().steps(flat) if flat.trainable else None))
    blob = ck._training_blob(state, opt, {"world": world}, persistent_buffers(model))
    ranks = [ckpt_io.write_rank_files(folder, r, per_rank[r], blob, IOConfig(), chunk_bytes=chunk)
             for r in range(world)]
    fmt.write_manifest(folder / fmt.MANIFEST, fmt.Manifest(world_size=world, optimizer="AdamW", chunk_bytes=chunk,
                                                           flats=tuple(flats), ranks=tuple(ranks), aliases={}))
    return full


def test_a_three_rank_checkpoint_loads_into_one_rank(make, tmp_path):
    a, opt = make("nvme")
    train(a, opt, range(2))
    _synthetic_checkpoint(tmp_path / "three", a, opt, 3, chunk=8192)
    b, opt_b = make("nvme", seed=1)
    assert tz.load_checkpoint(tmp_path / "three", b, opt_b) == {"world": 3}
    assert_same_state(a, b)
    assert train(a, opt, range(2, 4)) == train(b, opt_b, range(2, 4))


def test_a_resharding_rank_reads_only_the_chunks_it_needs(make, tmp_path, monkeypatch):
    a, opt = make("host", layers=2)
    train(a, opt, range(1))
    full = _synthetic_checkpoint(tmp_path / "two", a, opt, 2, chunk=4096)
    manifest = fmt.read_manifest(tmp_path / "two" / fmt.MANIFEST)
    for world_m in (3, 4):
        for rank in range(world_m):
            with ckpt_io.open_engine(IOConfig()) as engine:
                read = []
                orig = engine.pread
                monkeypatch.setattr(engine, "pread", lambda f, buf, off, **kw: read.append(len(buf)) or orig(f, buf, off, **kw))
                reader = ckpt_io.Reader(tmp_path / "two", manifest, engine)
                for entry in manifest.flats:
                    new = FlatLayout.build([s.fqn for s in entry.layout.slots], [s.shape for s in entry.layout.slots],
                                           world_m, itemsize=4)
                    key = f"{entry.name}/values"
                    dst = np.zeros(fmt.round_up(new.shard_numel * 4) + 4096, np.uint8)
                    reader.read_ops(key, reshard.reshard_plan(entry.layout, new, rank), 4, dst)
                    want = _shards(new, full[key])[rank]
                    np.testing.assert_array_equal(dst[:want.nbytes].view(np.float32), want)
                total = sum(r.data_bytes for r in manifest.ranks)
                assert 0 < sum(read) < total * 0.75, (world_m, rank, sum(read), total)


# ------------------------------------------------------------------------- export / import


def test_export_is_a_plain_safetensors_file(make, tmp_path):
    a, opt = make("nvme", dtype="bfloat16")
    train(a, opt, range(2))
    tz.save_checkpoint(tmp_path / "ck", a, opt)
    from tierzero.cli import main

    assert main(["export", str(tmp_path / "ck"), "--to", str(tmp_path / "m.safetensors")]) == 0
    want = a.state_dict()
    mine = load_safetensors(tmp_path / "m.safetensors")
    assert mine.keys() == want.keys()  # tied weights under both names
    for k in want:
        assert mine[k].dtype == want[k].dtype and torch.equal(mine[k], want[k]), k
    # an independent reader of the format
    safetensors_torch = pytest.importorskip("safetensors.torch")
    theirs = safetensors_torch.load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(theirs[k], want[k]) for k in want) and theirs.keys() == want.keys()
    plain = Net()
    plain.load_state_dict(theirs, strict=True)
    x, _ = batch(9)
    plain.eval(), a.eval()
    with torch.no_grad():  # the wrapped model computes in bf16 from the same fp32 values
        assert torch.equal(plain.to(torch.bfloat16)(x), a(x))


def test_header_layout_by_hand(tmp_path):
    """The bytes on disk follow the format: u64 little-endian header length, JSON, raw data."""
    t = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
    tz.save_safetensors(t, tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert header["b"] == {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]}
    assert np.frombuffer(raw[8 + n:8 + n + 24], "<f4").tolist() == [0, 1, 2, 3, 4, 5]
    assert np.frombuffer(raw[8 + n + 24:], "<i8").tolist() == [1, 2]
    (tmp_path / "bad.safetensors").write_bytes(raw[:20])
    with pytest.raises(ValueError, match="bad.safetensors"):
        load_safetensors(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("how", ["dict", "pt", "safetensors"])
def test_a_wrapped_model_starts_from_plain_weights(make, tmp_path, how):
    torch.manual_seed(5)
    plain = Net()
    sd = plain.state_dict()
    if how == "pt":
        torch.save(sd, tmp_path / "w.pt")
        source: Any = tmp_path / "w.pt"
    elif how == "safetensors":
        sd_single = {k: v for k, v in sd.items() if k != "head.weight"}  # tied: one name is enough
        tz.save_safetensors(sd_single, tmp_path / "w.safetensors")
        source = tmp_path / "w.safetensors"
    else:
        source = sd
    model, opt = make("nvme", seed=1)
    tz.load_weights(model, source)
    for k, v in sd.items():
        assert torch.equal(model.state_dict()[k], v), k
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for s in range(2):  # the optimizer's master weights were loaded too: training matches plain PyTorch
        x, y = batch(s)
        ref = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
        ref.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        assert train(model, opt, range(s, s + 1)) == [ref.item()]
    with pytest.raises(ValueError, match="missing"):
        tz.load_weights(model, {k: v for k, v in sd.items() if not k.startswith("layers.0")})
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        tz.load_weights(model, tmp_path / "nope.safetensors")


def test_manifest_file_names_are_confined_to_the_checkpoint(make, tmp_path):
    """A manifest (checksummed, so written on purpose) that names rank files elsewhere, or other
    files than the model's config, is refused before anything is read."""
    a, opt = make("host")
    folder = tz.save_checkpoint(tmp_path / "ck", a, opt)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes((folder / "rank00000.bin").read_bytes())
    manifest = fmt.read_manifest(folder / "manifest.json")
    rank = dataclasses.replace(manifest.ranks[0], data=f"../../{outside.name}")
    fmt.write_manifest(folder / "manifest.json", dataclasses.replace(manifest, ranks=(rank,)))
    b, opt_b = make("host", seed=1)
    with pytest.raises(fmt.CheckpointError, match="expected 'rank00000.bin' and 'rank00000.pt' in the checkpoint"):
        tz.load_checkpoint(tmp_path / "ck", b, opt_b)
    fmt.write_manifest(folder / "manifest.json", dataclasses.replace(manifest, files={"../../x.json": 1}))
    with pytest.raises(fmt.CheckpointError, match="names other files"):
        tz.load_checkpoint(tmp_path / "ck", b, opt_b)
