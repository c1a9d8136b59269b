"""Copy-on-write NVMe homes (tierzero/cow_home.py): a checkpoint's files serve as the parameters'
NVMe home until their first write.

The swap space alone: segments at unaligned offsets and of odd sizes read back exactly (zeros
between them), under every io.direct setting, with the swap extent reserved but never written;
the first write goes to the swap file and lets go of the checkpoint; a file changed in place is
an error naming it (checksums, or without them its size and time), a file renamed or removed is
not. A bf16 transformers checkpoint loaded for bf16 compute: no swap write at all, the values
(read back from the files) and the export equal transformers' own from_pretrained, training
follows the load that copies to the swap files loss for loss, a checkpoint saved from the
borrowed homes resumes exactly. The two-rank ZeRO-3 load is in test_weights.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tierzero as tz
from io_engine import aligned_empty
from pairs import clipped_step
from tierzero import runtime
from tierzero.runtime import wrapping
from tierzero.config.config import IOConfig
from tierzero.placement.storage.cow_home import CheckpointChangedError, Segment
from tierzero.placement.handles import Kind
from tierzero.placement.storage.nvme import SwapSpace
from tierzero.placement.storage.tiers import Budget, round_up
from tierzero.config.tiernames import Tier
from builders import llama_config

HEAD = 1237
"""Bytes before the first segment: nothing after it is page aligned."""


def checkpoint_file(path: Path, nbytes: int) -> np.ndarray:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return data


def segments_of(path: Path, size: int) -> tuple[list[Segment], int]:
    """Segments of odd sizes at odd offsets, placed in a shard with gaps and padding; the last
    one ends at the file's (unaligned) end."""
    spans = [(HEAD, 1000), (HEAD + 1000, 70001), (HEAD + 90000, 4096), (size - 12345, 12345)]
    out, at = [], 8
    for i, (offset, n) in enumerate(spans):
        out.append(Segment(f"t{i}", str(path), offset, n, at))
        at += n + 6  # a gap, as between a FlatLayout's aligned slots
    return out, at + 100  # padding


def expected(data: np.ndarray, segments: list[Segment], nbytes: int) -> np.ndarray:
    want = np.zeros(nbytes, dtype=np.uint8)
    for s in segments:
        want[s.at:s.at + s.nbytes] = data[s.offset:s.offset + s.nbytes]
    return want


@pytest.fixture
def make_swap(tmp_path):
    made: list[SwapSpace] = []

    def make(**kw: Any) -> SwapSpace:
        io = IOConfig(threads=3, block_size="8KiB", direct=kw.pop("direct", "auto"))
        swap = SwapSpace(tmp_path / "nvme", 0, Budget(Tier.NVME, 1 << 24), io, **kw)
        made.append(swap)
        return swap

    yield make
    for s in made:
        s.close()


def garbage(n: int) -> np.ndarray:
    buf = aligned_empty(n)
    buf[:] = 0xAB
    return buf


@pytest.mark.parametrize("direct", ["auto", True, False])
def test_borrowed_region_reads_the_checkpoint_until_its_first_write(tmp_path, make_swap, direct):
    data = checkpoint_file(tmp_path / "model.safetensors", 200_003)
    segments, nbytes = segments_of(tmp_path / "model.safetensors", data.nbytes)
    want = expected(data, segments, nbytes)
    swap = make_swap(direct=direct)
    region = swap.try_alloc(nbytes)
    assert swap.budget.used == round_up(nbytes)  # reserved as for any tensor
    home = swap.borrow(segments, nbytes)  # read and hashed, nothing kept
    swap.adopt(region, home, "layers.0.param")
    for _ in range(2):
        out = garbage(region.length)
        swap.read(region, out, "layers.0.param")
        assert np.array_equal(out[:nbytes], want)
    assert swap.borrowed(region) and swap.location(region) == (str(tmp_path / "model.safetensors"), HEAD)
    step = swap.telemetry.reset_step()
    assert step.nvme_write_bytes == 0 and step.nvme_read_bytes == 3 * nbytes
    assert len(swap.checkpoint_files) == 1
    new = garbage(region.length)
    new[:] = np.arange(region.length) % 251
    swap.write(region, new, "layers.0.param")  # the first write: to the swap file
    assert not swap.borrowed(region) and len(swap.checkpoint_files) == 0  # the file is closed
    out = garbage(region.length)
    swap.read(region, out, "layers.0.param")
    assert np.array_equal(out, new)
    assert swap.location(region)[0].startswith(str(swap.run_dir))
    assert np.array_equal(np.fromfile(tmp_path / "model.safetensors", dtype=np.uint8), data)  # untouched


def test_free_and_close_let_go_of_the_files(tmp_path, make_swap):
    data = checkpoint_file(tmp_path / "a.safetensors", 100_000)
    segments, nbytes = segments_of(tmp_path / "a.safetensors", data.nbytes)
    swap = make_swap()
    homes = []
    for name in ("a", "b"):
        region = swap.try_alloc(nbytes)
        swap.adopt(region, swap.borrow(segments, nbytes), name)
        homes.append(region)
    assert len(swap.checkpoint_files) == 1  # opened once for both
    swap.free(homes[0])
    assert len(swap.checkpoint_files) == 1 and swap.budget.used == round_up(nbytes)
    swap.close()
    assert len(swap.checkpoint_files) == 0


@pytest.mark.parametrize("checksums", [True, False])
def test_changed_file_is_an_error_naming_it_and_a_moved_one_is_not(tmp_path, make_swap, checksums):
    path = tmp_path / "hf" / "model.safetensors"
    path.parent.mkdir()
    data = checkpoint_file(path, 150_001)
    segments, nbytes = segments_of(path, data.nbytes)
    want = expected(data, segments, nbytes)
    swap = make_swap(checksums=checksums)
    region = swap.try_alloc(nbytes)
    swap.adopt(region, swap.borrow(segments, nbytes), "layers.3.param")
    os.rename(tmp_path / "hf", tmp_path / "moved")  # the folder renamed, then its file removed
    moved = tmp_path / "moved" / "model.safetensors"
    out = garbage(region.length)
    swap.read(region, out, "layers.3.param")
    assert np.array_equal(out[:nbytes], want)
    with open(moved, "r+b") as f:  # written in place: the file the home holds open
        f.seek(HEAD + 1000 + 500)
        f.write(b"\x00\x01\x02")
        os.utime(f.fileno(), ns=(1, 1))  # a changed modification time, whatever the clock's grain
    os.unlink(moved)
    with pytest.raises(CheckpointChangedError) as e:
        swap.read(region, garbage(region.length), "layers.3.param")
    msg = str(e.value)
    assert "'layers.3.param'" in msg and str(path) in msg and "tz.from_pretrained" in msg
    if checksums:
        assert f"[{HEAD + 1000}, {HEAD + 1000 + 70001})" in msg and "'t1'" in msg and "xxh3" in msg
    else:
        assert "mtime_ns" in msg


# ----------------------------------------------------------------------- a transformers load


def _hf() -> Any:
    return pytest.importorskip("transformers")


def bf16_folder(tmp_path: Path) -> Path:
    hf = _hf()
    torch.manual_seed(0)
    folder = tmp_path / "hf"
    hf.LlamaForCausalLM(llama_config(tied=False)).to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    return folder


def bf16_config(tmp_path: Path, name: str, **kw: Any) -> tz.Config:
    """704 KiB of host: the root's update in the stand-in's pinned region ([Note: working set
    windows]) needs 664 KiB."""
    return tz.Config(device_budget="4MiB", host_budget="704KiB", nvme_dir=str(tmp_path / name), params="nvme",
                     grads="nvme", optimizer_states="nvme", compute_dtype="bfloat16", **kw)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 211, (2, 12), generator=g) for _ in range(n)]


def params_of(model: torch.nn.Module) -> list[Any]:
    state = runtime.state_of(model)
    return [h for h in state.pm.handles if h.kind is Kind.PARAM]


def test_bf16_load_reads_back_from_the_checkpoint_without_swap_writes(tmp_path):
    hf = _hf()
    folder = bf16_folder(tmp_path)
    ref = hf.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model = tz.from_pretrained(folder, bf16_config(tmp_path, "nvme"), dtype=torch.bfloat16)
    try:
        pm = runtime.placement_manager(model)
        assert pm.telemetry.reset_step().nvme_write_bytes == 0
        params = params_of(model)
        assert all(Path(pm.nvme_location(h)[0]).parent == folder for h in params)  # homed in the files
        nvme_homed = [h for h in pm.handles if h.home is Tier.NVME]
        assert pm.bytes_used("nvme") == sum(round_up(h.nbytes) for h in nvme_homed)  # the room is reserved
        state = runtime.state_of(model)
        want = ref.state_dict()
        for flat in state.flat_params():
            values = flat.layout.flatten([want[s.fqn] for s in flat.layout.slots], dtype=torch.bfloat16)
            assert torch.equal(pm.read(flat.param).view(torch.int16), values.view(torch.int16)), flat.name
        sd = model.state_dict()
        assert sd.keys() == want.keys()
        for k, v in want.items():
            assert sd[k].dtype == v.dtype and torch.equal(sd[k].view(torch.int16), v.view(torch.int16)), k
        tz.save_pretrained(model, tmp_path / "out", dtype=torch.bfloat16)  # reads through the same homes
        out = hf.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16).state_dict()
        assert all(torch.equal(out[k].view(torch.int16), v.view(torch.int16)) for k, v in want.items())
        step = pm.telemetry.reset_step()
        assert step.nvme_write_bytes == 0 and step.nvme_by_kind["params"]["read"] > 0
    finally:
        runtime.close(model)
    assert len(pm.swap.checkpoint_files) == 0


def test_training_follows_the_load_that_copies_to_the_swap_files(tmp_path, monkeypatch):
    """The same checkpoint loaded with copy-on-write homes and with copies in the swap files
    (the path before them): the same losses, bit for bit; the first optimizer step writes every
    parameter to its swap extent (by the end of the next step's forward) and lets go of the
    files; a checkpoint saved from the borrowed homes (before any step) resumes exactly, after
    the folder was renamed."""
    folder = bf16_folder(tmp_path)
    model = tz.from_pretrained(folder, bf16_config(tmp_path, "cow"), dtype=torch.bfloat16)
    with monkeypatch.context() as m:
        m.setattr(wrapping, "borrows_checkpoint", lambda home, zero: False)
        copied = tz.from_pretrained(folder, bf16_config(tmp_path, "copied"), dtype=torch.bfloat16)
    pm = runtime.placement_manager(model)
    assert all(Path(pm.nvme_location(h)[0]).parent == folder for h in params_of(model))
    assert all(runtime.placement_manager(copied).nvme_location(h)[0].endswith(".bin") for h in params_of(copied))
    ckpt = tz.save_checkpoint(tmp_path / "ckpt", model)
    os.rename(folder, tmp_path / "renamed")
    opts = [tz.AdamW(m, lr=3e-3, weight_decay=0.1) for m in (model, copied)]
    xs = batches(4)
    try:
        for i, x in enumerate(xs[:3]):
            losses = [clipped_step(m, opt, m(x, labels=x).loss, 1.0, 1) for m, opt in zip((model, copied), opts)]
            assert losses[0] == losses[1], (i, losses)
            if i == 1:  # the first step's updates (overlapped: beside the next forward) have all landed
                assert not any(pm.nvme_location(h)[0].endswith(".safetensors") for h in params_of(model))
                assert len(pm.swap.checkpoint_files) == 0
        # resume from the checkpoint saved while the homes were the files: step for step again
        resumed = tz.from_pretrained(tmp_path / "renamed", bf16_config(tmp_path, "resumed"), dtype=torch.bfloat16)
        try:
            tz.load_checkpoint(ckpt, resumed)
            opt = tz.AdamW(resumed, lr=3e-3, weight_decay=0.1)
            fresh = tz.from_pretrained(tmp_path / "renamed", bf16_config(tmp_path, "fresh"), dtype=torch.bfloat16)
            try:
                fresh_opt = tz.AdamW(fresh, lr=3e-3, weight_decay=0.1)
                for x in xs[:2]:
                    a = clipped_step(resumed, opt, resumed(x, labels=x).loss, 1.0, 1)
                    b = clipped_step(fresh, fresh_opt, fresh(x, labels=x).loss, 1.0, 1)
                    assert a == b
            finally:
                runtime.close(fresh)
        finally:
            runtime.close(resumed)
    finally:
        runtime.close(model)
        runtime.close(copied)


@pytest.mark.parametrize("checksums", [True, False])
def test_checkpoint_file_changed_under_a_loaded_model_is_a_named_error(tmp_path, checksums):
    folder = bf16_folder(tmp_path)
    model = tz.from_pretrained(folder, bf16_config(tmp_path, "nvme", checksums=checksums), dtype=torch.bfloat16)
    try:
        pm = runtime.placement_manager(model)
        h = params_of(model)[1]
        path, offset = pm.nvme_location(h)
        with open(path, "r+b") as f:
            f.seek(offset + 3)
            f.write(bytes(f.read(1)[0] ^ 0xFF for _ in range(1)))
            os.utime(f.fileno(), ns=(1, 1))
        with pytest.raises(CheckpointChangedError) as e:
            pm.read(h)
        msg = str(e.value)
        assert h.name in msg and path in msg and "tz.from_pretrained" in msg
        if checksums:
            assert f"[{offset}, " in msg
    finally:
        runtime.close(model)
