"""io_engine error paths: each failure is an IOEngineError (OSError, errno set) whose message names
the path, offset, byte count and OS error; lifecycle (close with work outstanding, threads joined)."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import io_engine
from io_engine import IOEngine, IOEngineError, PreallocatedFile, aligned_empty
from io_engine import engine as engine_mod

from builders import REPO


def test_missing_directory(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "f.bin"
    with IOEngine(threads=1) as eng:
        with pytest.raises(IOEngineError) as e:
            eng.write(path, b"abc")
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOENT
    msg = str(e.value)
    assert f"directory {str(path.parent)!r} does not exist" in msg and "create it first" in msg
    with pytest.raises(IOEngineError, match="directory .* does not exist"):
        PreallocatedFile(path, 4096)


def test_missing_file_for_read(tmp_path):
    with IOEngine(threads=1) as eng, pytest.raises(IOEngineError, match="no such file") as e:
        eng.read(tmp_path / "absent.bin", bytearray(10))
    assert e.value.errno == errno.ENOENT
    assert not (tmp_path / "absent.bin").exists()  # a read never creates the file


@pytest.mark.parametrize("direct", ["auto", False])
@pytest.mark.parametrize("file_size,offset,nbytes", [(1000, 0, 2000), (5000, 0, 8192), (4096, 8192, 4096),
                                                     (3 * 65536, 65536, 3 * 65536)])
def test_read_past_eof_is_an_error_not_zeros(tmp_path, direct, file_size, offset, nbytes):
    path = tmp_path / "f.bin"
    path.write_bytes(b"\x01" * file_size)
    buf = aligned_empty(nbytes)
    buf[:] = 0xEE
    with IOEngine(threads=3, block_size=65536, direct=direct) as eng:
        fut = eng.pread(path, buf, offset)
        with pytest.raises(IOEngineError) as e:
            fut.result()
    err = e.value
    assert err.errno == errno.ENODATA and err.path == str(path) and err.offset == offset and err.nbytes == nbytes
    msg = str(err)
    assert "read past end of file" in msg and f"{nbytes} bytes at offset {offset}" in msg
    assert f"the file is {file_size} bytes long" in msg and str(path) in msg


def test_closed_engine_refuses_work(tmp_path):
    eng = IOEngine(threads=2)
    eng.close()
    eng.close()  # idempotent
    assert eng.closed
    for call in (eng.pread, eng.pwrite):
        with pytest.raises(IOEngineError, match="this IOEngine is closed") as e:
            call(tmp_path / "f.bin", bytearray(10))
        assert e.value.errno == errno.EBADF and "f.bin" in str(e.value)


def test_write_failure_efbig_from_rlimit_fsize(tmp_path):
    """A real failing write: RLIMIT_FSIZE in a child process (SIGXFSZ ignored so write returns EFBIG)."""
    path = tmp_path / "f.bin"
    code = textwrap.dedent(f"""
        import json, resource, signal, numpy as np
        from io_engine import IOEngine, IOEngineError, aligned_empty
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        buf = aligned_empty(4 << 20); buf[:] = 7
        with IOEngine(threads=2, block_size=1 << 20, direct="auto") as eng:
            try:
                eng.write({str(path)!r}, buf, 4096)
            except IOEngineError as e:
                print(json.dumps({{"errno": e.errno, "msg": str(e), "path": e.path, "offset": e.offset,
                                  "nbytes": e.nbytes, "oserror": isinstance(e, OSError)}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["errno"] == errno.EFBIG and got["oserror"]
    assert got["path"] == str(path) and got["offset"] == 4096 and got["nbytes"] == 4 << 20
    assert f"pwrite of {4 << 20} bytes at offset 4096 to {str(path)!r} failed at offset" in got["msg"]
    assert "EFBIG" in got["msg"] and "RLIMIT_FSIZE" in got["msg"]


def test_write_failure_enospc_names_everything(tmp_path, monkeypatch):
    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine_mod, "pwritev_from", full)
    with IOEngine(threads=2, block_size=4096) as eng:
        fut = eng.pwrite(tmp_path / "f.bin", np.ones(10_000, np.uint8), 123, checksum=True)
        with pytest.raises(IOEngineError) as e:
            fut.result()
        assert fut.checksum is None
    assert e.value.errno == errno.ENOSPC
    assert "pwrite of 10000 bytes at offset 123" in str(e.value) and "file system is full" in str(e.value)


def test_preallocate_more_than_free_space(tmp_path):
    path = tmp_path / "huge.bin"
    with pytest.raises(IOEngineError) as e:
        PreallocatedFile(path, 1 << 50)
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert str(path) in msg and str(1 << 50) in msg and "1.0 PiB" in msg and "free" in msg
    assert not path.exists()  # no half-made file left behind


def test_preallocate_failure_from_fallocate(tmp_path, monkeypatch):
    def enospc(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io_engine.files, "fallocate", enospc)
    with pytest.raises(IOEngineError, match=r"cannot preallocate 8192 bytes .* free"):
        PreallocatedFile(tmp_path / "f.bin", 8192)


def test_preallocated_file_lifecycle(tmp_path):
    path = tmp_path / "f.bin"
    with PreallocatedFile(path, 3 * 4096 + 5) as f:
        assert f.path == str(path) and f.size == 3 * 4096 + 5 and os.path.getsize(path) == f.size
        assert os.stat(path).st_blocks * 512 >= f.size  # space really reserved
        with IOEngine(threads=2) as eng:
            eng.write(f, b"hello", 7)
            out = bytearray(5)
            eng.read(f, out, 7)
            assert out == b"hello"
    assert f.closed and path.exists()
    with pytest.raises(IOEngineError, match="is closed"), IOEngine(threads=1) as eng:
        eng.read(f, bytearray(1))
    with PreallocatedFile(path, 100) as g:  # reopen: never shrinks
        assert g.size == 3 * 4096 + 5
    g.unlink()
    assert not path.exists()
    with PreallocatedFile(path, 4096, remove_on_close=True):
        assert path.exists()
    assert not path.exists()


def test_bad_arguments(tmp_path):
    for kwargs, match in (({"threads": 0}, "threads"), ({"block_size": 1000}, "multiple of 4096"),
                          ({"direct": "yes"}, "direct")):
        with pytest.raises(ValueError, match=match):
            IOEngine(**kwargs)
    with IOEngine(threads=1, block_size="8MiB") as eng:
        assert eng.block_size == 8 << 20
        with pytest.raises(ValueError, match="writable"):
            eng.pread(tmp_path / "f.bin", b"read-only")
        with pytest.raises(ValueError, match="C-contiguous"):
            eng.pwrite(tmp_path / "f.bin", np.zeros(10)[::2])
        with pytest.raises(ValueError, match="offset"):
            eng.pwrite(tmp_path / "f.bin", b"x", -1)
        with pytest.raises(TypeError, match="buffer-protocol"):
            eng.pwrite(tmp_path / "f.bin", [1, 2, 3])
        with pytest.raises(TypeError, match="path, PreallocatedFile or fd"):
            eng.pwrite(3.5, b"x")


def _slow(monkeypatch, seconds=0.05):
    real = engine_mod.pwritev_from

    def slow(fd, view, offset):
        time.sleep(seconds)
        return real(fd, view, offset)

    monkeypatch.setattr(engine_mod, "pwritev_from", slow)


def test_close_waits_for_outstanding_futures(tmp_path, monkeypatch):
    _slow(monkeypatch)
    eng = IOEngine(threads=2, block_size=4096)
    futs = [eng.pwrite(tmp_path / "f.bin", np.full(4096, i, np.uint8), i * 4096) for i in range(12)]
    assert not all(f.done() for f in futs)
    eng.close()
    assert all(f.done() and f.result() == 4096 for f in futs)
    data = (tmp_path / "f.bin").read_bytes()
    assert all(data[i * 4096] == i for i in range(12))
    assert not any(t.is_alive() for t in eng._state.threads)


def test_close_cancel_fails_queued_futures(tmp_path, monkeypatch):
    started = threading.Event()
    real = engine_mod.pwritev_from

    def slow(fd, view, offset):
        started.set()
        time.sleep(0.1)
        return real(fd, view, offset)

    monkeypatch.setattr(engine_mod, "pwritev_from", slow)
    eng = IOEngine(threads=1, block_size=4096)
    futs = [eng.pwrite(tmp_path / "f.bin", np.ones(4096, np.uint8), i * 4096) for i in range(10)]
    assert started.wait(10)
    eng.close(cancel=True)
    errors = [f.exception() for f in futs]
    cancelled = [e for e in errors if e is not None]
    assert cancelled and all(isinstance(e, IOEngineError) and e.errno == errno.ECANCELED for e in cancelled)
    assert "cancelled: the IOEngine was closed with cancel=True" in str(cancelled[0])
    assert errors[0] is None  # the one already running completed


def test_result_timeout(tmp_path, monkeypatch):
    _slow(monkeypatch, 0.3)
    with IOEngine(threads=1) as eng:
        fut = eng.pwrite(tmp_path / "f.bin", b"x")
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.01)
        assert fut.result(timeout=10) == 1


def test_no_worker_thread_left_after_close():
    before = set(threading.enumerate())
    with IOEngine(threads=8) as eng:
        assert len(set(threading.enumerate()) - before) == 8
    assert set(threading.enumerate()) - before == set()
    assert not any(t.is_alive() for t in eng._state.threads)


def test_unclosed_engine_is_shut_down_when_collected():
    eng = IOEngine(threads=3)
    threads = list(eng._state.threads)
    del eng
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)


def test_close_from_a_done_callback_is_refused(tmp_path):
    seen = []
    with IOEngine(threads=1) as eng:
        def cb(fut):
            try:
                eng.close()
            except RuntimeError as e:
                seen.append(str(e))

        f = eng.pwrite(tmp_path / "f.bin", b"x")
        f.add_done_callback(cb)
        f.result()
        time.sleep(0.05)
    assert seen and "worker threads" in seen[0]
