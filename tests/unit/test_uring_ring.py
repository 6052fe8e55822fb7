"""fastio._uring.Ring used directly, and UringEngine's completion handling (short transfers, errors)."""
from __future__ import annotations

import errno
import gc
import mmap
import os
import resource
import signal
import warnings

import pytest

try:
    import fastio._uring as _uring
    _uring.probe()
    UNUSABLE = None
except ImportError as exc:   # the native extension was not built
    UNUSABLE = f"native extension fastio._uring not importable ({exc})"
except OSError as exc:  # seccomp, kernel.io_uring_disabled, old kernel
    UNUSABLE = f"io_uring unavailable: {exc}"

if UNUSABLE is None:
    from fastio._uring import Ring

    import fastio._uring_engine as uring_engine
from fastio._config import FastioConfig


@pytest.fixture(autouse=True)
def _io_uring_here(uring_unusable):
    """Every test here needs the ring: skipped where it cannot run, failed on CI (conftest.py)."""
    if UNUSABLE is not None:
        uring_unusable(UNUSABLE)


SIZES = [1, 7, 4095, 4096, 4097, (1 << 20) + 3]


def _pattern(nbytes: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(min(nbytes, 251))) * (nbytes // 251 + 1)


def _run_all(ring: Ring, count: int) -> dict:
    """Submit what is prepared and collect ``count`` completions as {user_data: res}."""
    results = {}
    while len(results) < count:
        ring.submit_and_wait(1)
        results.update(ring.reap())
    return results


@pytest.fixture
def rw_fd(tmp_path):
    fd = os.open(tmp_path / "data.bin", os.O_RDWR | os.O_CREAT, 0o644)
    yield fd
    os.close(fd)


def test_probe_succeeds():
    assert _uring.probe() is None


def test_write_then_read_back_many_sizes_in_flight_together(rw_fd):
    blobs = [_pattern(n, seed=i)[:n] for i, n in enumerate(SIZES)]
    offsets = [sum(SIZES[:i]) for i in range(len(SIZES))]  # odd, unaligned offsets on purpose
    with Ring(16) as ring:
        for i, (blob, offset) in enumerate(zip(blobs, offsets)):
            assert ring.prep("write", rw_fd, blob, offset, i)
        assert ring.inflight == len(SIZES)
        assert _run_all(ring, len(SIZES)) == {i: n for i, n in enumerate(SIZES)}
        assert ring.inflight == 0

        targets = [bytearray(n) for n in SIZES]
        for i, (target, offset) in enumerate(zip(targets, offsets)):
            assert ring.prep("read", rw_fd, target, offset, 100 + i)
        assert _run_all(ring, len(SIZES)) == {100 + i: n for i, n in enumerate(SIZES)}
    assert [bytes(t) for t in targets] == blobs
    assert os.fstat(rw_fd).st_size == sum(SIZES)


def test_zero_length_views(rw_fd):
    with Ring(4) as ring:
        assert ring.prep("write", rw_fd, b"", 0, 1)
        assert ring.prep("read", rw_fd, bytearray(), 0, 2)
        assert ring.prep("write", rw_fd, memoryview(b"abc")[3:], 0, 3)
        assert _run_all(ring, 3) == {1: 0, 2: 0, 3: 0}


def test_read_past_end_is_short_then_zero(rw_fd):
    os.pwrite(rw_fd, b"0123456789", 0)
    target = bytearray(16)
    with Ring(4) as ring:
        ring.prep("read", rw_fd, target, 4, 1)
        ring.prep("read", rw_fd, bytearray(8), 10, 2)
        assert _run_all(ring, 2) == {1: 6, 2: 0}
    assert bytes(target[:6]) == b"456789"


def test_numpy_and_memoryview_slices(rw_fd):
    np = pytest.importorskip("numpy")
    source = np.arange(10000, dtype=np.uint8)
    with Ring(4) as ring:
        ring.prep("write", rw_fd, memoryview(source)[100:9100], 0, 1)
        assert _run_all(ring, 1) == {1: 9000}
        out = np.zeros(9000, dtype=np.uint8)
        ring.prep("read", rw_fd, out, 0, 2)
        assert _run_all(ring, 1) == {2: 9000}
    assert (out == source[100:9100]).all()


def test_write_to_read_only_fd_completes_with_ebadf(tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        with Ring(4) as ring:
            ring.prep("write", fd, b"hello", 0, 7)
            assert _run_all(ring, 1) == {7: -errno.EBADF}
    finally:
        os.close(fd)


def test_register_bad_address_raises_oserror_with_kernel_errno():
    with Ring(4) as ring:
        with pytest.raises(OSError) as info:
            ring.register_buffers([(4096, 4096)])  # page 1 is never mapped
        assert info.value.errno == errno.EFAULT
        assert "io_uring_register" in str(info.value)


def test_registered_buffers_give_the_same_bytes(rw_fd):
    staging = mmap.mmap(-1, 2 * 4096)
    view = memoryview(staging)
    address = _address(view)
    data = _pattern(2 * 4096)[: 2 * 4096]
    view[:] = data
    with Ring(4) as ring:
        if not ring.register_buffers([(address, len(staging))]):
            pytest.skip("kernel refused buffer registration (memlock limit?)")
        ring.prep("write", rw_fd, view, 0, 1)          # whole buffer: WRITE_FIXED
        ring.prep("write", rw_fd, view[5:4100], 8192, 2)  # inside it, unaligned: WRITE_FIXED
        ring.prep("write", rw_fd, data[:100], 16384, 3)   # not registered: plain WRITE
        assert _run_all(ring, 3) == {1: 8192, 2: 4095, 3: 100}
        view[:] = bytes(len(staging))
        ring.prep("read", rw_fd, view, 0, 4)
        assert _run_all(ring, 1) == {4: 8192}
        assert bytes(view) == data
        ring.register_buffers([(address, 4096)])  # replaces the first registration
        ring.unregister_buffers()
    del view
    staging.close()
    assert os.pread(rw_fd, 4095, 8192) == data[5:4100]


def test_full_ring_returns_false_and_cq_is_never_overrun(rw_fd):
    with Ring(4) as ring:
        assert (ring.sq_entries, ring.cq_entries) == (4, 8)
        assert all(ring.prep("write", rw_fd, b"a", i, i) for i in range(4))
        assert not ring.prep("write", rw_fd, b"a", 4, 4)  # SQ full
        assert ring.submit_and_wait(0) >= 0
        assert all(ring.prep("write", rw_fd, b"b", i, i) for i in range(4, 8))
        ring.submit_and_wait(0)
        assert not ring.prep("write", rw_fd, b"c", 8, 8)  # 8 unreaped = CQ size
        assert sorted(_run_all(ring, 8)) == list(range(8))
        assert ring.prep("write", rw_fd, b"c", 8, 8)
        assert _run_all(ring, 1) == {8: 1}


def test_submit_and_wait_with_nothing_in_flight_returns_at_once():
    with Ring(2) as ring:
        assert ring.submit_and_wait(5) == 0
        assert ring.reap() == []


def test_misuse_raises_value_and_buffer_errors(rw_fd):
    with Ring(4) as ring:
        with pytest.raises(ValueError):
            ring.prep("append", rw_fd, b"x", 0, 1)
        with pytest.raises(ValueError):
            ring.prep("write", rw_fd, b"x", -1, 1)
        with pytest.raises(ValueError):
            ring.prep("write", rw_fd, b"x", 0, -1)
        with pytest.raises(BufferError):
            ring.prep("read", rw_fd, b"read-only", 0, 1)
        ring.prep("write", rw_fd, b"x", 0, 1)
        with pytest.raises(ValueError, match="already in flight"):
            ring.prep("write", rw_fd, b"y", 1, 1)
        _run_all(ring, 1)
    with pytest.raises(ValueError):
        Ring(0)


def test_close_is_idempotent_and_waits_for_inflight(rw_fd):
    ring = Ring(4)
    data = bytearray(_pattern(1 << 20)[: 1 << 20])
    ring.prep("write", rw_fd, data, 0, 1)
    ring.close()  # submits and waits: the kernel is done with `data` when close returns
    ring.close()
    assert ring.closed
    assert os.pread(rw_fd, 1 << 20, 0) == data
    with pytest.raises(ValueError, match="closed"):
        ring.prep("write", rw_fd, b"x", 0, 2)
    with pytest.raises(ValueError, match="closed"):
        ring.submit_and_wait(1)


def test_unclosed_ring_warns():
    ring = Ring(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del ring
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)


def _address(view) -> int:
    from fastio._memory import buffer_address

    return buffer_address(view)


# ---------------------------------------------------------------- UringEngine


def _engine(**overrides):
    config = FastioConfig(backend="uring", chunk_bytes=overrides.pop("chunk_bytes", 64 << 10),
                          queue_depth=overrides.pop("queue_depth", 4))
    return uring_engine.UringEngine(config)


def test_engine_round_trip_more_pieces_than_queue_depth(rw_fd):
    data = _pattern(3 << 20)[: (3 << 20) + 12345]
    engine = _engine()
    try:
        engine.submit_write(rw_fd, memoryview(data), 0, "data.bin").wait()
        out = bytearray(len(data))
        engine.submit_read(rw_fd, memoryview(out), 0, "data.bin").wait()
    finally:
        engine.close()
    assert out == data


def test_engine_read_past_end_raises_eof(rw_fd):
    os.pwrite(rw_fd, b"z" * 1000, 0)
    engine = _engine()
    try:
        ticket = engine.submit_read(rw_fd, memoryview(bytearray(4000)), 0, "data.bin")
        with pytest.raises(EOFError, match="offset 1000"):
            ticket.wait()
    finally:
        engine.close()


def test_engine_error_names_operation_size_offset_and_path(tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    engine = _engine()
    try:
        ticket = engine.submit_write(fd, memoryview(b"q" * 5000), 4096, str(path))
        with pytest.raises(OSError) as info:
            ticket.wait()
    finally:
        engine.close()
        os.close(fd)
    assert info.value.errno == errno.EBADF
    assert info.value.filename == str(path)
    assert "io_uring write of 5000 bytes at offset 4096" in str(info.value)


def test_engine_resubmits_short_write_then_reports_efbig(rw_fd):
    # RLIMIT_FSIZE makes the kernel write only up to the limit (a short write); the remainder,
    # resubmitted at the limit, fails with EFBIG. SIGXFSZ would otherwise kill the process.
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10000, old_limit[1]))
    engine = _engine(chunk_bytes=1 << 20)
    try:
        ticket = engine.submit_write(rw_fd, memoryview(b"w" * 16384), 0, "limited.bin")
        with pytest.raises(OSError) as info:
            ticket.wait()
    finally:
        engine.close()
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert info.value.errno == errno.EFBIG
    assert "of 6384 bytes at offset 10000" in str(info.value)
    assert os.fstat(rw_fd).st_size == 10000


class _ShortRing:
    """Stands in for Ring: performs each request with at most 1000 bytes (always short)."""

    def __init__(self, entries):
        self.sq_entries = entries
        self._done = []

    def prep(self, op, fd, view, offset, user_data):
        view = view[:1000]
        n = os.pwrite(fd, view, offset) if op == "write" else os.preadv(fd, [view], offset)
        self._done.append((user_data, n))
        return True

    def submit_and_wait(self, min_complete):
        return len(self._done)

    def reap(self):
        done, self._done = self._done, []
        return done

    def close(self):
        pass


def test_engine_completes_pieces_made_of_short_transfers(rw_fd, monkeypatch):
    monkeypatch.setattr(uring_engine, "Ring", _ShortRing)
    data = _pattern(300000)[:300000]
    engine = _engine()
    try:
        engine.submit_write(rw_fd, memoryview(data), 7, "data.bin").wait()
        out = bytearray(len(data))
        engine.submit_read(rw_fd, memoryview(out), 7, "data.bin").wait()
    finally:
        engine.close()
    assert out == data


def test_engine_registered_buffer_writes_its_live_bytes_and_is_kept_alive(rw_fd):
    import weakref

    from fastio import aligned_buffer

    nbytes = 1 << 20
    engine = _engine()
    try:
        buf = aligned_buffer(nbytes, populate=True)
        view = buf.view(0, nbytes)
        # A write in flight when the registration arrives: the engine finishes it first.
        first = engine.submit_write(rw_fd, memoryview(_pattern(nbytes, seed=1)[:nbytes]), 0, "data.bin")
        if not engine.register_buffer(buf):
            pytest.skip("kernel refused buffer registration (memlock limit?)")
        first.wait()
        assert engine.registered is buf
        for seed in (2, 3):   # the same registered pages, new contents each time: written as they are now
            view[:] = _pattern(nbytes, seed=seed)[:nbytes]
            engine.submit_write(rw_fd, view, 0, "data.bin").wait()
            assert os.pread(rw_fd, nbytes, 0) == bytes(view)
        # The engine holds a registered buffer: its pages stay mapped while the kernel has them.
        alive = weakref.ref(buf)
        del buf, view
        gc.collect()
        assert alive() is not None
        assert engine.register_buffer(None) and engine.registered is None
        gc.collect()
        assert alive() is None
        # Without a registration, writes go as before.
        data = _pattern(nbytes, seed=4)[:nbytes]
        engine.submit_write(rw_fd, memoryview(data), 0, "data.bin").wait()
        assert os.pread(rw_fd, nbytes, 0) == data
    finally:
        engine.close()
    assert engine.registered is None


def test_engine_registers_a_large_buffer_as_slices(rw_fd, monkeypatch):
    # The kernel takes at most 1 GiB per registered iovec; a bigger staging buffer goes as slices
    # (scaled down here), and requests inside or across slices write the right bytes.
    from fastio import aligned_buffer

    monkeypatch.setattr(uring_engine, "FIXED_SLICE_BYTES", 64 << 10)
    nbytes = 256 << 10
    engine = _engine(chunk_bytes=48 << 10)   # pieces that straddle the slice boundaries too
    try:
        buf = aligned_buffer(nbytes, populate=True)
        view = buf.view(0, nbytes)
        view[:] = _pattern(nbytes, seed=5)[:nbytes]
        if not engine.register_buffer(buf):
            pytest.skip("kernel refused buffer registration (memlock limit?)")
        engine.submit_write(rw_fd, view, 0, "data.bin").wait()
        assert os.pread(rw_fd, nbytes, 0) == bytes(view)
    finally:
        engine.close()


def test_engine_registration_racing_close_returns_instead_of_waiting_forever():
    from fastio import aligned_buffer

    engine = _engine()
    engine.close()
    assert engine.register_buffer(aligned_buffer(4096)) is False   # closed: refused at once
    # The race: the call saw the engine open, then close() let the thread end before it took the
    # registration from the queue. The call must notice the thread is gone and give up.
    engine._closed = False
    assert engine.register_buffer(aligned_buffer(4096)) is False
    engine._closed = True
