"""Bytes written through fastio.Writer come back unchanged through fastio.Reader, on every backend."""
from __future__ import annotations

import errno
import gc
import os
import shutil
import sys
import tempfile
import warnings

import numpy as np
import pytest
import torch
from fastio_helpers import SpyEngine, aligned_copy, listing, random_bytes, read_back, unaligned_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastio

SIZES = [0, 1, 4095, 4096, 4097, (1 << 20) + 1]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("source", ["aligned", "unaligned", "bytes"])
def test_round_trip_sizes(tmp_path, rng, backend, nbytes, source):
    data = random_bytes(rng, nbytes)
    obj = {"aligned": lambda: aligned_copy(data).view(),
           "unaligned": lambda: unaligned_copy(data),
           "bytes": lambda: data.tobytes()}[source]()
    path = tmp_path / "out.bin"
    with fastio.Writer(path, engine=backend) as writer:
        assert writer.write(obj) == 0
        assert writer.size == nbytes
    assert os.path.getsize(path) == nbytes
    assert listing(tmp_path) == ["out.bin"]
    for aligned_target in (True, False):
        assert np.array_equal(read_back(path, backend, aligned_target=aligned_target), data)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["aligned", "unaligned"])
def test_round_trip_256_mib(tmp_path, rng, backend, source):
    nbytes = (256 << 20) + 4097  # an unaligned tail after 256 MiB
    data = random_bytes(rng, nbytes)
    obj = aligned_copy(data).numpy() if source == "aligned" else unaligned_copy(data)
    path = tmp_path / "big.bin"
    with fastio.Writer(path, engine=backend, size_hint=nbytes) as writer:
        writer.write(obj)
    del obj
    assert os.path.getsize(path) == nbytes
    back = read_back(path, backend, aligned_target=True)
    assert np.array_equal(back, data)
    del back
    with open(path, "rb") as f:  # and through the kernel's ordinary read path
        assert f.read(4097) == data[:4097].tobytes()
        f.seek(nbytes - 5000)
        assert f.read() == data[-5000:].tobytes()


def test_many_small_writes(tmp_path, rng, backend):
    """Thousands of tiny appends, some aligned, cross several staging slots."""
    config = fastio.FastioConfig(staging_slot_bytes=64 << 10, staging_slots=3)
    pieces, offsets = [], []
    expected = bytearray()
    path = tmp_path / "small.bin"
    with fastio.Writer(path, config, engine=backend) as writer:
        for _ in range(6000):
            piece = random_bytes(rng, int(rng.integers(0, 200))).tobytes()
            align = int(rng.choice([1, 1, 1, 8, 64, 4096]))
            if align > 1 and len(expected) % align:
                expected += bytes(align - len(expected) % align)
            offset = writer.write(piece, align=align)
            assert offset == len(expected) and offset % align == 0
            expected += piece
            pieces.append(piece)
            offsets.append(offset)
        assert writer.size == len(expected)
        assert writer.pad_to(4096) == -(-len(expected) // 4096) * 4096
    expected += bytes(-len(expected) % 4096)
    assert os.path.getsize(path) == len(expected)
    assert read_back(path, backend, aligned_target=False).tobytes() == bytes(expected)
    with fastio.Reader(path, engine=backend) as reader:
        for i in rng.choice(len(pieces), 300, replace=False):
            assert reader.read(offsets[i], len(pieces[i])) == pieces[i]


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
SHAPES = [(0,), (1,), (3, 5), (1025,), (17, 33, 2), (257, 1024)]


def _random_tensor(rng, dtype, shape):
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    high = 256 if dtype == torch.uint8 else 1 << 62
    return torch.randint(0, high, shape, generator=generator, dtype=dtype)


def test_tensors_of_several_dtypes(tmp_path, rng, backend):
    tensors = [_random_tensor(rng, dtype, shape) for dtype in DTYPES for shape in SHAPES]
    path = tmp_path / "tensors.bin"
    with fastio.Writer(path, engine=backend) as writer:
        writer.write(b"header: not a multiple of anything")
        offsets = [writer.write(t, align=4096) for t in tensors]
    assert all(offset % 4096 == 0 for offset in offsets)
    with fastio.Reader(path, engine=backend) as reader:
        for tensor, offset in zip(tensors, offsets):
            ordinary = torch.empty(tensor.shape, dtype=tensor.dtype)
            reader.read_into(offset, ordinary)
            assert torch.equal(ordinary, tensor), (tensor.dtype, tensor.shape)
            nbytes = tensor.numel() * tensor.element_size()
            staging = fastio.aligned_buffer(nbytes)  # O_DIRECT target
            into = staging.tensor().view(tensor.dtype).view(tensor.shape) if nbytes else ordinary.clone()
            reader.read_into(offset, into)
            assert torch.equal(into, tensor), (tensor.dtype, tensor.shape)


def test_aligned_tensors_go_zero_copy_and_others_are_staged(tmp_path, rng, backend):
    """Aligned memory at an aligned offset is handed to the kernel as is, even after a header;
    unaligned memory is copied into staging and never submitted from its own address."""
    spy = SpyEngine(backend)
    shared = fastio.aligned_buffer(3 << 20)
    zero_copy = shared.tensor().view(torch.float32)
    zero_copy.copy_(torch.from_numpy(rng.standard_normal(zero_copy.numel(), dtype=np.float32)))
    ordinary = unaligned_copy(random_bytes(rng, (1 << 20) + 12))
    path = tmp_path / "mixed.bin"
    with fastio.Writer(path, engine=spy) as writer:
        writer.write(b"HDR!" * 5)
        zero_offset = writer.write(zero_copy, align=4096)
        copy_offset = writer.write(ordinary, align=4096)
        tail_offset = writer.write(zero_copy[:1000], align=4096)  # aligned but not whole pages
    assert spy.submitted_from(shared.address, shared.nbytes)
    assert not spy.submitted_from(ordinary.ctypes.data, ordinary.nbytes)
    assert all(address % 4096 == 0 and offset % 4096 == 0 for address, _, offset in spy.writes)
    with fastio.Reader(path, engine=backend) as reader:
        out = torch.empty_like(zero_copy)
        reader.read_into(zero_offset, out)
        assert torch.equal(out, zero_copy)
        assert reader.read(copy_offset, ordinary.nbytes) == ordinary.tobytes()
        assert reader.read(tail_offset, 4000) == zero_copy[:1000].numpy().tobytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranges=st.lists(st.tuples(st.integers(0, 300_000), st.integers(0, 70_000)), min_size=1, max_size=8),
       aligned_target=st.booleans())
def test_reads_at_arbitrary_offsets(tmp_path, backend, ranges, aligned_target):
    path = tmp_path / "random-access.bin"
    if not path.exists():
        data = np.random.default_rng(7).integers(0, 256, 300_001, dtype=np.uint8)
        with fastio.Writer(path, engine=backend) as writer:
            writer.write(data)
    data = np.fromfile(path, dtype=np.uint8)
    with fastio.Reader(path, engine=backend) as reader:
        for offset, nbytes in ranges:
            if offset + nbytes > reader.size:
                with pytest.raises(EOFError):
                    reader.read_into(offset, bytearray(nbytes))
                continue
            out = fastio.aligned_buffer(nbytes).numpy() if aligned_target else np.empty(nbytes, np.uint8)
            reader.read_into(offset, out)
            assert np.array_equal(out, data[offset:offset + nbytes])
            assert reader.read(offset, nbytes) == data[offset:offset + nbytes].tobytes()


def test_aligned_offsets_read_with_o_direct(tmp_path, rng, backend):
    data = random_bytes(rng, 5 * 4096 + 100)
    path = tmp_path / "direct.bin"
    with fastio.Writer(path, engine=backend) as writer:
        writer.write(data)
    with fastio.Reader(path, engine=backend) as reader:
        for offset, nbytes in [(0, 4096), (4096, 8192), (8192, 3 * 4096 + 100), (4096, 4096 + 1)]:
            out = fastio.aligned_buffer(nbytes)
            reader.read_into(offset, out.numpy())
            assert np.array_equal(out.numpy(), data[offset:offset + nbytes])


def test_submit_read_into_overlaps_several_reads(tmp_path, rng, backend):
    data = random_bytes(rng, 64 * 4096)
    path = tmp_path / "overlap.bin"
    with fastio.Writer(path, engine=backend) as writer:
        writer.write(data)
    outs = [fastio.aligned_buffer(8 * 4096) for _ in range(8)]
    with fastio.Reader(path, engine=backend) as reader:
        waits = [reader.submit_read_into(i * 8 * 4096, out.numpy()) for i, out in enumerate(outs)]
        for wait in waits:
            wait()
    assert np.array_equal(np.concatenate([out.numpy() for out in outs]), data)


def test_reading_past_end_raises_eoferror_naming_the_file(tmp_path, backend):
    path = tmp_path / "short.bin"
    with fastio.Writer(path, engine=backend) as writer:
        writer.write(b"0123456789")
    with fastio.Reader(path, engine=backend) as reader:
        assert reader.size == 10
        assert reader.read(0, 10) == b"0123456789"
        assert reader.read(10, 0) == b""
        for offset, nbytes in [(0, 11), (9, 2), (10, 1), (4096, 4096), (-1, 1)]:
            with pytest.raises(EOFError) as info:
                reader.read(offset, nbytes)
            assert str(path) in str(info.value)


def test_reader_misuse(tmp_path, backend):
    path = tmp_path / "x.bin"
    with fastio.Writer(path, engine=backend) as writer:
        writer.write(b"abc")
    reader = fastio.Reader(path, engine=backend)
    with pytest.raises(TypeError):
        reader.read_into(0, b"\0\0\0")  # read-only target
    with pytest.raises(TypeError):
        reader.read_into(0, torch.empty(2, 3)[:, 0])  # not contiguous
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        reader.read(0, 1)


def _o_direct_accepted(directory) -> bool:
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    os.close(fd)
    return True


@pytest.fixture
def shm_dir():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("/dev/shm does not exist")
    directory = tempfile.mkdtemp(prefix="fastio-test-", dir="/dev/shm")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_tmpfs_round_trip(shm_dir, rng, backend):
    """tmpfs: O_DIRECT is refused by older kernels (buffered fallback) and accepted since 6.6;
    either way the writer reports what it got and the bytes round-trip."""
    data = random_bytes(rng, 3 * 4096 + 5)
    path = os.path.join(shm_dir, "t.bin")
    with fastio.Writer(path, engine=backend) as writer:
        writer.write(aligned_copy(data).view())
        assert writer.direct is _o_direct_accepted(shm_dir)
    assert np.array_equal(read_back(path, backend, aligned_target=True), data)
    assert listing(shm_dir) == ["t.bin"]


def test_buffered_fallback_when_o_direct_is_refused(tmp_path, rng, backend, monkeypatch):
    """A filesystem answering EINVAL to O_DIRECT (and, like some do, creating the file first)."""
    from fastio import _files

    real_open = os.open
    refused = []

    def open_refusing_o_direct(path, flags, mode=0o777, **kwargs):
        if flags & os.O_DIRECT:
            if flags & os.O_CREAT:  # the inode appears before the refusal
                os.close(real_open(path, (flags & ~os.O_DIRECT), mode))
            refused.append(path)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(_files.os, "open", open_refusing_o_direct)
    data = random_bytes(rng, 2 * 4096 + 77)
    path = tmp_path / "fallback.bin"
    with fastio.Writer(path, engine=backend) as writer:
        assert writer.direct is False
        writer.write(aligned_copy(data).view())
        writer.write(data.tobytes())
    monkeypatch.undo()
    assert refused
    assert np.array_equal(read_back(path, backend, aligned_target=True), np.concatenate([data, data]))
    assert listing(tmp_path) == ["fallback.bin"]


def test_size_hint_larger_than_the_data_does_not_lengthen_the_file(tmp_path, rng, backend):
    data = random_bytes(rng, 8192)
    path = tmp_path / "hinted.bin"
    with fastio.Writer(path, engine=backend, size_hint=1 << 20) as writer:
        writer.write(aligned_copy(data).view())
    assert os.path.getsize(path) == 8192
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), data)


def test_no_resource_warnings(tmp_path, rng, backend_name, monkeypatch):
    """Writers, readers and engines used as documented leak nothing; a leaked Reader is reported."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    data = random_bytes(rng, 3 * 4096 + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        engine = fastio.make_engine(fastio.FastioConfig(backend=backend_name))
        with fastio.Writer(tmp_path / "a.bin", engine=engine) as writer:
            writer.write(data)
        with pytest.raises(RuntimeError):
            with fastio.Writer(tmp_path / "b.bin", engine=engine) as writer:
                writer.write(data)
                raise RuntimeError("abort")
        writer = fastio.Writer(tmp_path / "c.bin", engine=engine)
        writer.write(data)
        writer.abort()
        with fastio.Reader(tmp_path / "a.bin", engine=engine) as reader:
            reader.read(1, 3 * 4096)
        engine.close()
        del writer, reader, engine
        gc.collect()
        assert unraisable == []

        leaked = fastio.Reader(tmp_path / "a.bin", engine=fastio.make_engine(fastio.FastioConfig(backend="pwrite")))
        del leaked
        gc.collect()
    assert len(unraisable) == 1 and isinstance(unraisable[0].exc_value, ResourceWarning)
    assert listing(tmp_path) == ["a.bin"]
