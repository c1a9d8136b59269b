"""io_engine: bit-exact roundtrips (sizes, offsets, alignment, threads, O_DIRECT modes, tmpfs and
disk, buffer kinds), page-cache coherence across O_DIRECT and buffered IO, concurrency, asyncio,
checksums."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import time

import numpy as np
import pytest

import io_engine
from io_engine import IOEngine, IOFuture, PreallocatedFile, aligned_empty, checksum
from io_engine import engine as engine_mod

MiB = 1 << 20
SIZES = [1, 199, 4095, 4096, 4097, MiB + 3]
SHM = "/dev/shm"


def fs_type(path) -> str:
    """File system type of the mount holding path."""
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


@pytest.fixture
def disk_dir(tmp_path):
    if fs_type(tmp_path) == "tmpfs":
        pytest.skip(f"{tmp_path} is on tmpfs here; the disk cases need a real block device")
    return tmp_path


@pytest.fixture
def shm_dir(tmp_path):
    if not os.path.isdir(SHM) or fs_type(SHM) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    d = os.path.join(SHM, f"io_engine-test-{os.getpid()}-{tmp_path.name}")
    os.makedirs(d)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


@pytest.fixture(params=["disk", "tmpfs"])
def any_dir(request):
    return request.getfixturevalue("disk_dir" if request.param == "disk" else "shm_dir")


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)


def placed(data: np.ndarray, skew: int) -> np.ndarray:
    """A copy of data whose first byte sits `skew` bytes past a page boundary."""
    out = aligned_empty(data.nbytes + 4096)[skew: skew + data.nbytes]
    out[:] = data
    return out


def test_disk_is_not_tmpfs(disk_dir):
    assert fs_type(disk_dir) != "tmpfs"


@pytest.mark.parametrize("direct", ["auto", True, False])
@pytest.mark.parametrize("offset", [0, 8192, 4099])
@pytest.mark.parametrize("size", SIZES)
def test_roundtrip(any_dir, size, offset, direct):
    threads = (1, 3, 8)[(size + offset) % 3]
    data = random_bytes(size)
    path = os.path.join(any_dir, "f.bin")
    # skew == offset % 4096: memory and file offset agree, so the aligned middle goes O_DIRECT;
    # skew + 1: they disagree, so the whole request goes buffered.
    for skew in (offset % 4096, (offset + 1) % 4096):
        with IOEngine(threads=threads, block_size=64 * 1024, direct=direct) as eng:
            src = placed(data, skew)
            assert eng.write(path, src, offset) == size
            dst = placed(np.zeros(size, np.uint8), skew)
            assert eng.read(path, dst, offset) == size
            np.testing.assert_array_equal(dst, data)
        with open(path, "rb") as f:  # and what is on file is exactly that
            f.seek(offset)
            assert f.read(size) == data.tobytes()


@pytest.fixture(scope="module")
def big():
    return random_bytes(64 * MiB + 4096)


@pytest.mark.parametrize("direct", ["auto", False])
@pytest.mark.parametrize("offset,size", [(0, 64 * MiB), (4099, 64 * MiB - 5)])
def test_roundtrip_64mib_disk(disk_dir, big, offset, size, direct):
    data = big[:size]
    with IOEngine(threads=8, block_size=4 * MiB, direct=direct) as eng, \
            PreallocatedFile(disk_dir / "f.bin", offset + size) as f:
        src = placed(data, offset % 4096)
        eng.write(f, src, offset)
        dst = placed(np.zeros(size, np.uint8), offset % 4096)
        fut = eng.pread(f, dst, offset, checksum=True)
        assert fut.result() == size
        assert fut.checksum == checksum(data)
        np.testing.assert_array_equal(dst, data)


def test_roundtrip_64mib_tmpfs(shm_dir, big):
    data = big[: 64 * MiB]
    with IOEngine(threads=3, block_size=8 * MiB) as eng:
        eng.write(os.path.join(shm_dir, "f.bin"), data)
        dst = aligned_empty(data.nbytes)
        eng.read(os.path.join(shm_dir, "f.bin"), dst)
        np.testing.assert_array_equal(dst, data)


def test_middle_goes_through_o_direct_fd(disk_dir, monkeypatch):
    seen = []
    real = engine_mod.pwritev_from

    def spy(fd, view, offset):
        seen.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, len(view)))
        return real(fd, view, offset)

    monkeypatch.setattr(engine_mod, "pwritev_from", spy)
    data = placed(random_bytes(3 * 65536 + 10), 100)
    with IOEngine(threads=2, block_size=65536, direct=True) as eng:
        eng.write(disk_dir / "f.bin", data, 100)
    seen.sort(key=lambda s: s[1])
    # bytes [100, 196718): head to the first page boundary buffered, the aligned middle in
    # block_size pieces O_DIRECT, the tail after the last page boundary buffered
    assert seen == [(False, 100, 3996), (True, 4096, 65536), (True, 69632, 65536), (True, 135168, 61440),
                    (False, 196608, 110)]


def test_plan_unaligned_memory_goes_buffered(disk_dir):
    with IOEngine(threads=1, block_size=8192) as eng, PreallocatedFile(disk_dir / "f.bin", 65536) as f:
        h = f.handle
        assert f.direct
        # memory 4096-aligned but offset 1: they disagree, everything buffered in block_size pieces
        assert eng._plan(h, 4096, 1, 20000) == [(h.fd, 0, 8192), (h.fd, 8192, 16384), (h.fd, 16384, 20000)]
        # fully aligned: all O_DIRECT
        assert eng._plan(h, 8192, 4096, 16384) == [(h.dfd, 0, 8192), (h.dfd, 8192, 16384)]
        # inside one page: buffered only
        assert eng._plan(h, 4196, 100, 50) == [(h.fd, 0, 50)]


@pytest.mark.parametrize("kind", ["bytearray", "memoryview", "mmap", "torch", "float32"])
def test_buffer_kinds(disk_dir, kind):
    n = 3 * 4096 + 17
    data = random_bytes(n)
    if kind == "bytearray":
        src, dst = bytearray(data.tobytes()), bytearray(n)
    elif kind == "memoryview":
        src, dst = memoryview(data.tobytes()), memoryview(bytearray(n))  # read-only source is fine for writes
    elif kind == "mmap":
        src, dst = mmap.mmap(-1, n), mmap.mmap(-1, n)
        src[:] = data.tobytes()
    elif kind == "torch":
        torch = pytest.importorskip("torch")
        src_t = torch.from_numpy(data.copy())
        dst_t = torch.zeros(n, dtype=torch.uint8)
        src, dst = src_t.numpy(), dst_t.view(torch.uint8).numpy()
    else:  # a non-byte dtype, 2-D
        src = np.frombuffer(data[: n - n % 4].tobytes(), np.float32).reshape(-1, 1).copy()
        dst = np.zeros_like(src)
        data = data[: n - n % 4]
    with IOEngine(threads=3, block_size=4096) as eng:
        fw = eng.pwrite(disk_dir / "f.bin", src, 5, checksum=True)
        fw.result()
        fr = eng.pread(disk_dir / "f.bin", dst, 5, checksum=True)
        assert fr.result() == data.nbytes
    assert np.frombuffer(dst, np.uint8).tobytes() == data.tobytes()
    assert fw.checksum == fr.checksum == checksum(data)
    if kind == "torch":
        assert dst_t.numpy().tobytes() == data.tobytes()
    if kind == "mmap":  # the engine released its views: the mapping can be closed
        src.close()
        dst.close()


def test_torch_tensor_direct_is_a_clear_type_error(disk_dir):
    torch = pytest.importorskip("torch")
    with IOEngine(threads=1) as eng, pytest.raises(TypeError, match=r"t\.numpy\(\)"):
        eng.pread(disk_dir / "f.bin", torch.zeros(4))


@pytest.mark.parametrize("direct", ["auto", False])
def test_page_cache_coherence_between_direct_and_buffered(disk_dir, direct):
    """Buffered writes then O_DIRECT reads of the same pages see the new data, and vice versa."""
    path = disk_dir / "f.bin"
    n = 16 * 4096
    a, b, c = (placed(random_bytes(n, s), 0) for s in (1, 2, 3))
    with IOEngine(threads=4, block_size=8192, direct=True) as dio, \
            IOEngine(threads=4, block_size=8192, direct=False) as bio:
        dio.write(path, a)
        out = aligned_empty(n)
        bio.read(path, out)  # pulls the pages into the page cache
        np.testing.assert_array_equal(out, a)
        bio.write(path, b)  # dirty cached pages, not yet on disk
        dio.read(path, out)
        np.testing.assert_array_equal(out, b)
        dio.write(path, c)  # O_DIRECT write must invalidate the cached (clean) pages
        bio.read(path, out)
        np.testing.assert_array_equal(out, c)
        # an unaligned request mixes both fds; a later fully aligned one reads it all back
        d = placed(random_bytes(n - 200, 4), 100)
        dio.write(path, d, 100)
        dio.read(path, out)
        np.testing.assert_array_equal(out[100: n - 100], d)
        np.testing.assert_array_equal(out[:100], c[:100])


def test_short_transfers_are_retried(disk_dir, monkeypatch):
    calls = {"read": 0, "write": 0}

    def short_read(fd, view, offset):
        calls["read"] += 1
        return os.preadv(fd, (view[:1000],), offset)

    def short_write(fd, view, offset):
        calls["write"] += 1
        return os.pwritev(fd, (view[:777],), offset)

    monkeypatch.setattr(engine_mod, "preadv_into", short_read)
    monkeypatch.setattr(engine_mod, "pwritev_from", short_write)
    data = placed(random_bytes(50_000), 0)
    with IOEngine(threads=3, block_size=16384, direct="auto") as eng:
        eng.write(disk_dir / "f.bin", data, 0)
        out = placed(np.zeros(data.nbytes, np.uint8), 0)
        eng.read(disk_dir / "f.bin", out, 0)
    np.testing.assert_array_equal(out, data)
    assert calls["write"] >= 50_000 // 777 and calls["read"] >= 50_000 // 1000


def test_o_direct_refused_at_open_falls_back(any_dir, monkeypatch):
    """As tmpfs did before Linux 6.6: open(O_DIRECT) -> EINVAL."""
    def refuse(path, flags):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(io_engine.files, "open_direct_fd", refuse)
    data = random_bytes(3 * 4096)
    path = os.path.join(any_dir, "f.bin")
    with IOEngine(threads=2, block_size=4096, direct="auto") as eng:
        eng.write(path, placed(data, 0))
        out = aligned_empty(data.nbytes)
        eng.read(path, out)
        np.testing.assert_array_equal(out, data)
    with PreallocatedFile(os.path.join(any_dir, "g.bin"), 8192) as f:
        assert not f.direct
    with IOEngine(threads=1, direct=True) as eng:
        with pytest.raises(io_engine.IOEngineError, match="refuses O_DIRECT") as e:
            eng.write(os.path.join(any_dir, "h.bin"), placed(data, 0))
        assert e.value.errno == 22 and "h.bin" in str(e.value) and 'direct="auto"' in str(e.value)


def test_o_direct_einval_at_transfer_falls_back_in_auto(disk_dir, monkeypatch):
    real = engine_mod.pwritev_from

    def picky(fd, view, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real(fd, view, offset)

    monkeypatch.setattr(engine_mod, "pwritev_from", picky)
    data = placed(random_bytes(4 * 4096), 0)
    with IOEngine(threads=2, block_size=4096, direct="auto") as eng:
        eng.write(disk_dir / "f.bin", data)
    assert (disk_dir / "f.bin").read_bytes() == data.tobytes()
    with IOEngine(threads=2, block_size=4096, direct=True) as eng:
        with pytest.raises(io_engine.IOEngineError, match="EINVAL"):
            eng.write(disk_dir / "f.bin", data)


def test_raw_fd_and_file_object(disk_dir):
    data = random_bytes(10_000)
    path = disk_dir / "f.bin"
    with IOEngine(threads=2, block_size=4096) as eng:
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        try:
            eng.write(fd, data, 3)
        finally:
            os.close(fd)
        out = np.zeros_like(data)
        with open(path, "rb") as f:
            eng.read(f, out, 3)
        np.testing.assert_array_equal(out, data)


def test_paths_are_opened_once(disk_dir, monkeypatch):
    opened = []
    real = io_engine.files.open_fd
    monkeypatch.setattr(io_engine.files, "open_fd", lambda p, fl, mode=0o644: opened.append(p) or real(p, fl, mode))
    data = random_bytes(4096)
    with IOEngine(threads=2) as eng:
        for i in range(20):
            eng.write(disk_dir / "f.bin", data, i * 4096)
            eng.read(str(disk_dir / "f.bin"), data, i * 4096)
    assert len(opened) == 1


def test_hundreds_of_concurrent_futures_on_one_file(disk_dir):
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 20_000, 400)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # packed, mostly unaligned
    data = random_bytes(int(sizes.sum()))
    with IOEngine(threads=8, block_size=8192) as eng, PreallocatedFile(disk_dir / "f.bin", data.nbytes) as f:
        futs = [eng.pwrite(f, data[o: o + s], int(o), checksum=bool(i % 2))
                for i, (o, s) in enumerate(zip(offsets, sizes))]
        assert sum(fu.result() for fu in futs) == data.nbytes
        out = np.zeros_like(data)
        futs = [eng.pread(f, out[o: o + s], int(o), checksum=True) for o, s in zip(offsets, sizes)]
        for fu, o, s in zip(futs, offsets, sizes):
            assert fu.result(timeout=30) == s
            assert fu.checksum == checksum(data[o: o + s])
    np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_checksums_match_whole_buffer(disk_dir, threads):
    data = placed(random_bytes(MiB + 3), 0)
    with IOEngine(threads=threads, block_size=4096) as eng:  # 257 pieces hashed in order
        fw = eng.pwrite(disk_dir / "f.bin", data, checksum=True)
        fw.result()
        out = aligned_empty(data.nbytes)
        fr = eng.pread(disk_dir / "f.bin", out, checksum=True)
        fr.result()
        plain = eng.pread(disk_dir / "f.bin", out)
        plain.result()
    assert fw.checksum == fr.checksum == checksum(data) == checksum(memoryview(data.tobytes()))
    assert plain.checksum is None
    assert checksum(b"") == checksum(np.zeros(0, np.uint8))


def test_zero_length_request(disk_dir):
    with IOEngine(threads=1) as eng:
        fut = eng.pwrite(disk_dir / "f.bin", b"", 0, checksum=True)
        assert fut.done() and fut.result() == 0 and fut.checksum == checksum(b"")


def test_asyncio_awaits_concurrently_without_blocking_the_loop(disk_dir, monkeypatch):
    real = engine_mod.preadv_into

    def slow_read(fd, view, offset):
        time.sleep(0.2)  # a slow drive; GIL released like a real syscall
        return real(fd, view, offset)

    data = random_bytes(4 * 4096)
    with IOEngine(threads=4, block_size=4096) as eng:
        eng.write(disk_dir / "f.bin", data)
        monkeypatch.setattr(engine_mod, "preadv_into", slow_read)
        outs = [np.zeros(4096, np.uint8) for _ in range(4)]

        async def main():
            ticks = 0
            stop = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0.005)

            t = asyncio.create_task(ticker())
            start = time.perf_counter()
            results = await asyncio.gather(*(eng.pread(disk_dir / "f.bin", o, i * 4096, checksum=True)
                                             for i, o in enumerate(outs)))
            elapsed = time.perf_counter() - start
            stop.set()
            await t
            return results, ticks, elapsed

        results, ticks, elapsed = asyncio.run(main())
    assert results == [4096] * 4
    assert elapsed < 0.6  # the four reads overlapped (4 x 0.2 s serially)
    assert ticks >= 10  # the loop kept running while the reads were in flight
    np.testing.assert_array_equal(np.concatenate(outs), data)


def test_await_failed_future_raises(disk_dir):
    with IOEngine(threads=1) as eng:
        eng.write(disk_dir / "f.bin", b"x" * 10)

        async def main():
            await eng.pread(disk_dir / "f.bin", bytearray(100))

        with pytest.raises(io_engine.IOEngineError, match="past end of file"):
            asyncio.run(main())


def test_done_callbacks_and_repr(disk_dir):
    got = []
    with IOEngine(threads=2) as eng:
        fut = eng.pwrite(disk_dir / "f.bin", b"abc")
        fut.add_done_callback(got.append)
        fut.result()
        fut.add_done_callback(got.append)  # already done: called at once
        assert isinstance(fut, IOFuture) and fut.done() and "pwrite" in repr(fut)
        assert "threads=2" in repr(eng)
    assert got == [fut, fut]


def test_aligned_empty():
    for n in (0, 1, 4095, 4096, 12345):
        a = aligned_empty(n)
        assert a.dtype == np.uint8 and a.nbytes == n
        assert n == 0 or a.ctypes.data % 4096 == 0  # numpy moves the pointer of empty views
    assert aligned_empty(100, alignment=65536).ctypes.data % 65536 == 0
    with pytest.raises(ValueError, match="power of two"):
        aligned_empty(10, alignment=3000)


def test_no_torch_at_the_core():
    import subprocess
    import sys

    code = ("import sys, io_engine, io_engine.bench, io_engine.aio; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("direct", ["auto", True, False])
def test_read_only_file_reads_what_was_opened_after_a_rename_or_removal(disk_dir, direct):
    data = random_bytes(3 * 4096 + 5)
    path = disk_dir / "ro.bin"
    path.write_bytes(data.tobytes())
    os.chmod(path, 0o444)  # read-only is enough: it never writes
    with IOEngine(threads=2, block_size=4096, direct=direct) as eng, io_engine.ReadOnlyFile(path, direct=direct) as f:
        assert f.handle.dfd >= 0 if direct else f.handle.dfd == -1
        os.rename(path, disk_dir / "moved.bin")
        os.unlink(disk_dir / "moved.bin")
        buf = aligned_empty(2 * 4096 + 5)
        eng.read(f, buf[:4096], 4096)  # aligned: O_DIRECT where on
        eng.read(f, buf[4096:], 4096 + 7)  # unaligned: buffered
        assert np.array_equal(buf[:4096], data[4096:8192]) and np.array_equal(buf[4096:], data[4103:4103 + 4101])
        assert f.stat().st_size == data.nbytes
    assert f.closed
    with pytest.raises(io_engine.IOEngineError, match="no such file"):
        io_engine.ReadOnlyFile(path)
