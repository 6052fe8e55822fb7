"""What a failed, aborted or killed write leaves behind: never a committed partial file, never a
damaged older file, and errors that say which file and why."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from fastio_helpers import aligned_copy, listing, random_bytes, temp_files

import fastio
from fastio._engine import Ticket

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _commit(path, data: bytes, engine) -> None:
    with fastio.Writer(path, engine=engine) as writer:
        writer.write(data)


def _mount_tmpfs(directory, options: str) -> bool:
    """Mount a tmpfs with ``options`` on ``directory``; False where mounting is not allowed."""
    if shutil.which("mount") is None:
        return False
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
                            capture_output=True, text=True)
    return result.returncode == 0


def _unmount(directory) -> None:
    subprocess.run(["umount", str(directory)], check=True)


# --------------------------------------------------------------------------- abort
@pytest.mark.parametrize("nbytes", [0, 10, (1 << 20) + 3, 20 << 20])
def test_exception_inside_with_leaves_no_file(tmp_path, rng, backend, nbytes):
    path = tmp_path / "new.bin"
    with pytest.raises(RuntimeError, match="training crashed"):
        with fastio.Writer(path, engine=backend) as writer:
            writer.write(random_bytes(rng, nbytes))
            raise RuntimeError("training crashed")
    assert listing(tmp_path) == []


def test_exception_inside_with_keeps_the_older_file(tmp_path, rng, backend):
    path = tmp_path / "ckpt.bin"
    old = random_bytes(rng, 3 * 4096 + 11).tobytes()
    _commit(path, old, backend)
    with pytest.raises(KeyboardInterrupt):
        with fastio.Writer(path, engine=backend) as writer:
            writer.write(aligned_copy(random_bytes(rng, 9 << 20)).view())
            writer.write(b"more")
            raise KeyboardInterrupt
    assert path.read_bytes() == old
    assert listing(tmp_path) == ["ckpt.bin"]


def test_abort_and_commit_are_idempotent_and_final(tmp_path, backend):
    path = tmp_path / "a.bin"
    writer = fastio.Writer(path, engine=backend)
    writer.write(b"abc")
    writer.abort()
    writer.abort()
    with pytest.raises(ValueError, match="aborted"):
        writer.write(b"x")
    with pytest.raises(ValueError, match="aborted"):
        writer.commit()
    assert listing(tmp_path) == []
    writer = fastio.Writer(path, engine=backend)
    writer.write(b"abc")
    writer.commit()
    writer.commit()
    writer.abort()  # after commit: no effect
    assert path.read_bytes() == b"abc"
    with pytest.raises(ValueError, match="committed"):
        writer.write(b"x")


def test_nothing_is_visible_before_commit(tmp_path, backend):
    path = tmp_path / "late.bin"
    with fastio.Writer(path, engine=backend) as writer:
        writer.write(bytes(5 << 20))
        assert not path.exists()
    assert path.stat().st_size == 5 << 20


# --------------------------------------------------------------------------- SIGKILL
_SLOW_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    import fastio

    path = sys.argv[1]
    engine = fastio.make_engine(fastio.FastioConfig.from_env())
    chunk = fastio.aligned_buffer(1 << 20)
    chunk.numpy()[:] = 0xAB
    with fastio.Writer(path, engine=engine) as writer:
        for i in range(100_000):               # far more than the test waits for
            writer.write(chunk.view() if i % 2 else b"unaligned bytes" * 1000)
            print("progress", i, writer.size, flush=True)
            time.sleep(0.005)
    print("committed", flush=True)
""")


@pytest.mark.parametrize("older_file", [False, True])
def test_sigkill_mid_write_commits_nothing(tmp_path, rng, backend_name, older_file):
    path = tmp_path / "ckpt.bin"
    old = random_bytes(rng, 10_000).tobytes()
    if older_file:
        engine = fastio.make_engine(fastio.FastioConfig(backend=backend_name))
        try:
            _commit(path, old, engine)
        finally:
            engine.close()
    env = dict(os.environ, FASTIO_BACKEND=backend_name,
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        progress = 0
        for line in child.stdout:
            if line.startswith("progress"):
                progress += 1
                if progress == 40:  # several staging slots written and in flight
                    break
        assert progress == 40, f"writer did not report progress: {child.stderr.read()}"
        assert temp_files(tmp_path), "the writer should have a temporary file by now"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    if older_file:
        assert path.read_bytes() == old
    else:
        assert not path.exists()
    # A killed process cannot clean up: only its hidden temporary file may be left.
    others = [name for name in listing(tmp_path) if name != "ckpt.bin"]
    assert others == temp_files(tmp_path)
    assert all(name.startswith(".ckpt.bin.tmp-") for name in others)


# --------------------------------------------------------------------------- path errors
def test_missing_directory_raises_file_not_found_naming_the_path(tmp_path, backend):
    path = tmp_path / "no" / "such" / "dir" / "x.bin"
    with pytest.raises(FileNotFoundError) as info:
        fastio.Writer(path, engine=backend)
    assert info.value.filename == str(path)
    assert str(path) in str(info.value)
    assert not (tmp_path / "no").exists()


def test_reading_a_missing_file_names_the_path(tmp_path, backend):
    path = tmp_path / "absent.bin"
    with pytest.raises(FileNotFoundError) as info:
        fastio.Reader(path, engine=backend)
    assert str(path) in str(info.value)


def _after_the_first_open(monkeypatch, action):
    """Run ``action()`` right after fastio.Reader's first (buffered) open of its file: the moment
    a live trainer's retention can unlink it or a commit replace it."""
    import fastio.reader

    real_open = fastio.reader.open_file

    def open_file(path, flags, direct, *args):
        fd = real_open(path, flags, direct, *args)
        if not direct:
            action()
        return fd
    monkeypatch.setattr(fastio.reader, "open_file", open_file)


@pytest.mark.parametrize("then", ["unlinked", "replaced"])
def test_a_file_unlinked_or_replaced_while_a_reader_opens_it_is_read_whole(tmp_path, rng, backend, then,
                                                                          monkeypatch):
    # Beside a live trainer a reader's file was unlinked between its buffered and its O_DIRECT
    # open: the constructor raised with the first descriptor open, and only the garbage collector
    # closed it (a ResourceWarning, about 1 run in 4 of the live-trainer test in test_store_safety).
    path, other = tmp_path / "ckpt.bin", tmp_path / "other.bin"
    data, newer = random_bytes(rng, 3 * 4096 + 100), random_bytes(rng, 3 * 4096 + 100)
    path.write_bytes(data.tobytes())
    other.write_bytes(newer.tobytes())
    _after_the_first_open(monkeypatch, (lambda: os.unlink(path)) if then == "unlinked" else
                          (lambda: os.replace(other, path)))
    with fastio.Reader(path, engine=backend) as reader:
        out = fastio.aligned_buffer(data.nbytes).numpy()[:data.nbytes]   # aligned: O_DIRECT reads the bulk
        reader.read_into(0, out)
        assert out.tobytes() == data.tobytes()


def test_without_proc_a_file_replaced_while_a_reader_opens_it_is_refused(tmp_path, rng, backend, monkeypatch):
    import fastio.reader

    path, other = tmp_path / "ckpt.bin", tmp_path / "other.bin"
    data = random_bytes(rng, 2 * 4096)
    path.write_bytes(data.tobytes())
    other.write_bytes(bytes(2 * 4096))
    real_open = fastio.reader.open_file

    def open_file(name, flags, direct, *args):   # a system without /proc: the reader reopens by name
        if name.startswith("/proc/"):
            raise OSError(errno.ENOENT, "no /proc here", name)
        return real_open(name, flags, direct, *args)
    monkeypatch.setattr(fastio.reader, "open_file", open_file)
    with fastio.Reader(path, engine=backend) as reader:   # unchanged: opens, reads
        assert reader.read(0, data.nbytes) == data.tobytes()
    _after_the_first_open(monkeypatch, lambda: os.replace(other, path))
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError, match="replaced while it was opened"):
        fastio.Reader(path, engine=backend)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_reader_whose_open_fails_halfway_leaves_no_descriptor_open(tmp_path, backend, monkeypatch):
    path = tmp_path / "ckpt.bin"
    path.write_bytes(bytes(8192))
    import fastio.reader

    real_open = fastio.reader.open_file

    def open_file(path, flags, direct, *args):
        if direct:
            raise OSError(errno.EIO, "injected")
        return real_open(path, flags, direct, *args)
    monkeypatch.setattr(fastio.reader, "open_file", open_file)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="injected"):
        fastio.Reader(path, engine=backend)
    assert set(os.listdir("/proc/self/fd")) <= before   # closed now, not by the garbage collector


@pytest.fixture(params=["immutable", "read-only-mount"])
def read_only_dir(request, tmp_path):
    """A directory where even root cannot create files (mode bits do not bind root):
    ``chattr +i`` (EPERM) or a tmpfs mounted read-only (EROFS)."""
    directory = tmp_path / "ro"
    directory.mkdir()
    if request.param == "read-only-mount":
        if not _mount_tmpfs(directory, "ro,size=64k"):
            pytest.skip("cannot mount a read-only tmpfs here (needs root with CAP_SYS_ADMIN)")
        yield directory, errno.EROFS
        _unmount(directory)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is unavailable or refused on this filesystem")
    yield directory, errno.EPERM
    subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_read_only_directory_raises_naming_the_path(read_only_dir, backend):
    directory, expected_errno = read_only_dir
    path = directory / "x.bin"
    with pytest.raises(OSError) as info:
        fastio.Writer(path, engine=backend)
    assert info.value.errno == expected_errno
    if expected_errno == errno.EPERM:
        assert isinstance(info.value, PermissionError)  # EROFS has no OSError subclass in Python
    assert info.value.filename == str(path)
    assert str(path) in str(info.value)
    assert os.listdir(directory) == []


# --------------------------------------------------------------------------- ENOSPC
@pytest.fixture
def tiny_tmpfs(tmp_path):
    directory = tmp_path / "tiny"
    directory.mkdir()
    if not _mount_tmpfs(directory, "size=1m"):
        pytest.skip("cannot mount a 1 MiB tmpfs here; test_injected_enospc covers the error path")
    yield directory
    _unmount(directory)


@pytest.mark.parametrize("how", ["one-write", "many-writes", "size-hint", "aligned"])
def test_disk_full_raises_enospc_and_leaves_nothing(tiny_tmpfs, rng, backend, how):
    path = tiny_tmpfs / "full.bin"
    data = random_bytes(rng, 4 << 20)
    with pytest.raises(OSError) as info:
        if how == "size-hint":
            with fastio.Writer(path, engine=backend, size_hint=data.nbytes) as writer:
                writer.write(data)
        else:
            with fastio.Writer(path, engine=backend) as writer:
                if how == "one-write":
                    writer.write(data)
                elif how == "aligned":
                    writer.write(aligned_copy(data).view())
                else:  # the error surfaces in a later write(), while staging slots cycle
                    for _ in range(16):
                        writer.write(data)
    assert info.value.errno == errno.ENOSPC
    assert str(path) in str(info.value)
    assert listing(tiny_tmpfs) == []


def test_disk_full_keeps_the_older_file(tiny_tmpfs, rng, backend):
    path = tiny_tmpfs / "ckpt.bin"
    old = random_bytes(rng, 100_000).tobytes()
    _commit(path, old, backend)
    with pytest.raises(OSError) as info:
        with fastio.Writer(path, engine=backend) as writer:
            writer.write(random_bytes(rng, 4 << 20))
    assert info.value.errno == errno.ENOSPC
    assert path.read_bytes() == old
    assert listing(tiny_tmpfs) == ["ckpt.bin"]


class _FailingEngine:
    """Forwards to a real engine, but the ``fail_at``-th write completes with ``errno_value``."""

    def __init__(self, inner, fail_at: int, errno_value: int = errno.ENOSPC):
        self.inner, self.name, self.config = inner, inner.name, inner.config
        self.fail_at, self.errno_value, self.calls = fail_at, errno_value, 0

    def submit_write(self, fd, view, offset, path, priority=fastio.BULK, keepalive=None):
        self.calls += 1
        if self.calls == self.fail_at:
            ticket = Ticket(1, view.nbytes)
            ticket._piece_done(OSError(self.errno_value, f"injected write of {view.nbytes} bytes at "
                                                         f"offset {offset} failed", path))
            return ticket
        return self.inner.submit_write(fd, view, offset, path, priority, keepalive)

    def submit_read(self, *args, **kwargs):
        return self.inner.submit_read(*args, **kwargs)


@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_injected_enospc(tmp_path, rng, backend, fail_at):
    """The same contract without a real full disk, at several points of a multi-slot write."""
    engine = _FailingEngine(backend, fail_at)
    config = fastio.FastioConfig(staging_slot_bytes=1 << 20, staging_slots=2)
    path = tmp_path / "x.bin"
    old = b"older committed contents"
    _commit(path, old, backend)
    with pytest.raises(OSError) as info:
        with fastio.Writer(path, config, engine=engine) as writer:
            for _ in range(8):
                writer.write(random_bytes(rng, (1 << 20) - 7))
    assert info.value.errno == errno.ENOSPC
    assert str(path) in str(info.value)
    assert path.read_bytes() == old
    assert listing(tmp_path) == ["x.bin"]


def test_write_error_caught_by_the_caller_still_prevents_commit(tmp_path, rng, backend):
    """A failed earlier write that surfaces in write() must not let a later commit() succeed
    with a hole in the file."""
    engine = _FailingEngine(backend, fail_at=1, errno_value=errno.EIO)
    config = fastio.FastioConfig(staging_slot_bytes=4096, staging_slots=1)
    path = tmp_path / "hole.bin"
    writer = fastio.Writer(path, config, engine=engine)
    # Never page-aligned (a bytes object's data is 4096-aligned by chance now and then, and then the
    # Writer sends it directly, its error surfacing only at commit: the test would not see it here).
    data = memoryview(bytearray(4097))[1:]
    with pytest.raises(OSError) as info:
        for _ in range(4):
            writer.write(data)
    assert info.value.errno == errno.EIO
    with pytest.raises(ValueError, match="aborted"):
        writer.commit()
    assert listing(tmp_path) == []


def test_commit_failure_names_the_path_and_cleans_up(tmp_path, backend, monkeypatch):
    path = tmp_path / "sync.bin"
    writer = fastio.Writer(path, engine=backend)
    writer.write(b"data")

    def failing_fdatasync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", failing_fdatasync)
    with pytest.raises(OSError) as info:
        writer.commit()
    monkeypatch.undo()
    assert info.value.errno == errno.EIO
    assert str(path) in str(info.value)
    assert listing(tmp_path) == []


def test_a_failed_direct_write_of_aligned_data_fails_the_commit(tmp_path, backend):
    """Page-aligned data goes to the engine without staging; its failed write surfaces at the latest
    in commit(), and nothing appears under the final name."""
    engine = _FailingEngine(backend, fail_at=1, errno_value=errno.EIO)
    path = tmp_path / "direct.bin"
    writer = fastio.Writer(path, fastio.FastioConfig(staging_slot_bytes=4096, staging_slots=1), engine=engine)
    data = fastio.aligned_buffer(4096)
    with pytest.raises(OSError) as info:
        for _ in range(4):
            writer.write(data.view())
        writer.commit()
    assert info.value.errno == errno.EIO
    assert listing(tmp_path) == []
