import fcntl
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierzero.config.config import IOConfig
from tierzero.placement.storage.nvme import ChecksumError, Extent, ExtentAllocator, SwapSpace
from tierzero.placement.storage.tiers import ALIGNMENT, Budget
from tierzero.config.tiernames import Tier


def aligned(n, fill=None):
    from io_engine import aligned_empty

    buf = aligned_empty(n)
    if fill is not None:
        buf[:] = np.random.default_rng(fill).integers(0, 256, n, dtype=np.uint8)
    return buf


def test_extent_allocator_first_fit_and_coalescing():
    a = ExtentAllocator()
    c = a.add_chunk(16 * ALIGNMENT)
    e1, e2, e3 = a.alloc(1), a.alloc(ALIGNMENT + 1), a.alloc(3 * ALIGNMENT)
    assert e1 == Extent(c, 0, ALIGNMENT) and e2 == Extent(c, ALIGNMENT, 2 * ALIGNMENT)
    assert e3.offset == 3 * ALIGNMENT and a.used_bytes == 6 * ALIGNMENT
    a.free(e1)
    assert a.alloc(ALIGNMENT) == e1  # first fit reuses the hole at the start
    a.free(e1)
    a.free(e3)
    a.free(e2)  # the middle one last: both neighbours merge
    assert a.is_empty(c) and a.used_bytes == 0
    assert a.alloc(17 * ALIGNMENT) is None
    with pytest.raises(AssertionError, match="double free"):
        a.free(Extent(c, 0, ALIGNMENT))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGNMENT), st.integers(0, 10**6)), max_size=80))
def test_extent_allocator_never_overlaps_and_returns_everything(ops):
    a = ExtentAllocator()
    a.add_chunk(32 * ALIGNMENT)
    a.add_chunk(8 * ALIGNMENT)
    live: list[Extent] = []
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            e = a.alloc(n)
            if e is not None:
                assert e.offset % ALIGNMENT == 0 and e.length >= n and e.length % ALIGNMENT == 0
                for o in live:
                    assert o.chunk != e.chunk or o.offset + o.length <= e.offset or e.offset + e.length <= o.offset
                live.append(e)
        else:
            a.free(live.pop(pick % len(live)))
        assert a.used_bytes == sum(e.length for e in live)
    for e in live:
        a.free(e)
    assert a.used_bytes == 0 and all(a.is_empty(c) for c in a.chunks())


@pytest.fixture
def swap(tmp_path):
    s = SwapSpace(tmp_path / "nvme", 3, Budget(Tier.NVME, 64 * ALIGNMENT), IOConfig(threads=2),
                  chunk_bytes=16 * ALIGNMENT)
    yield s
    s.close()


def test_swap_layout_lock_and_cleanup(tmp_path, swap):
    assert swap.run_dir.parent == tmp_path / "nvme" / "rank3"
    with open(swap.run_dir / ".lock") as f, pytest.raises(BlockingIOError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this run holds its folder
    other = SwapSpace(tmp_path / "nvme", 3, Budget(Tier.NVME, ALIGNMENT), IOConfig())
    assert other.run_dir != swap.run_dir  # two runs never share a folder
    other.close()
    ext = swap.try_alloc(5000)
    files = list(swap.run_dir.glob("swap*.bin"))
    assert len(files) == 1 and os.path.getsize(files[0]) == 16 * ALIGNMENT
    swap.free(ext)
    run_dir = swap.run_dir
    swap.close()
    swap.close()  # idempotent
    assert not run_dir.exists()


def test_swap_roundtrip_grows_and_respects_budget(swap):
    regions = [swap.try_alloc(n) for n in (5000, 20 * ALIGNMENT, 3, 30 * ALIGNMENT)]
    assert all(regions) and swap.budget.used == (2 + 20 + 1 + 30) * ALIGNMENT
    assert len(swap.allocator.chunks()) >= 2  # grew past the first 16-page chunk
    assert swap.file_bytes <= swap.budget.limit
    # The last one fit no hole and the files could not grow by 30 pages: it is in pieces.
    assert len(regions[-1].extents) > 1 and sum(e.length for e in regions[-1].extents) == 30 * ALIGNMENT
    bufs = [aligned(r.length, fill=i) for i, r in enumerate(regions)]
    for i, (r, b) in enumerate(zip(regions, bufs)):
        swap.write(r, b, f"t{i}")
    for i, (r, b) in enumerate(zip(regions, bufs)):
        out = aligned(r.length)
        swap.read(r, out, f"t{i}")
        assert np.array_equal(out, b)
    assert swap.try_alloc(11 * ALIGNMENT + 1) is None  # 53 of 64 pages used
    assert swap.budget.used == 53 * ALIGNMENT
    for r in regions:
        swap.free(r)
    assert swap.budget.used == 0 and swap.allocator.used_bytes == 0
    whole = swap.try_alloc(64 * ALIGNMENT)
    assert whole is not None and swap.file_bytes <= swap.budget.limit
    swap.free(whole)


def test_swap_checksum_mismatch_names_tensor_file_offset(swap):
    a, b = swap.try_alloc(ALIGNMENT), swap.try_alloc(2 * ALIGNMENT)
    swap.write(a, aligned(a.length, fill=1), "x")
    swap.write(b, aligned(b.length, fill=2), "layers.0.param")
    path, offset = swap.location(b)
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\x00\x01\x02")
    swap.read(a, aligned(a.length), "x")  # untouched region still verifies
    with pytest.raises(ChecksumError, match=rf"'layers.0.param' from {path} at offset {offset}"):
        swap.read(b, aligned(b.length), "layers.0.param")


def test_swap_missing_parent_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="parent folder .* does not exist"):
        SwapSpace(tmp_path / "no" / "such", 0, Budget(Tier.NVME, ALIGNMENT), IOConfig())
    s = SwapSpace(tmp_path / "created", 0, Budget(Tier.NVME, ALIGNMENT), IOConfig())  # parent exists
    s.close()


def test_a_small_disk_that_holds_the_state_is_not_refused_for_a_1_gib_chunk(tmp_path):
    """A 24 MiB file system and a state of a few MiB on NVMe (default 1 GiB chunks, a 256 GiB budget):
    the swap files are sized to what the disk holds; wrap and training steps run, and every
    step matches the same model on the host tier."""
    import torch

    import tierzero as tz
    from builders import gpt, tier_config, tmpfs
    from tierzero import runtime

    with tmpfs(tmp_path / "small", "size=24m") as small:
        models = [gpt(seed=0), gpt(seed=0)]
        tz.wrap(models[0], tier_config(small / "nvme", nvme_budget="256GiB"))
        tz.wrap(models[1], tier_config(tier="host"))
        try:
            opts = [tz.AdamW(m, lr=1e-3) for m in models]
            for step in range(2):
                x = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(step))
                losses = []
                for m, opt in zip(models, opts):
                    loss = m(x, targets=x).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                assert losses[0] == losses[1], (step, losses)
            assert 0 < runtime.placement_manager(models[0]).bytes_used("nvme") < 24 << 20
        finally:
            for m in models:
                runtime.close(m)
