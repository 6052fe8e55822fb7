"""The system-call trace of a lowdiff process (not a test module): every file-system change lowdiff
makes under one root directory, with the bytes written, in the order the calls returned.

How: ``install(root)`` wraps the ``os`` functions lowdiff changes files with (``open``, ``pwrite``,
``write``, ``ftruncate``, ``posix_fallocate``, ``fsync``, ``fdatasync``, ``replace``/``rename``,
``unlink``/``remove``, ``mkdir``, ``rmdir``) in the traced process only; each wrapper makes the real
call and, for a path under ``root``, appends what it did. Nothing in lowdiff changes, so tracing
costs nothing when it is off. fastio must run its pwrite backend (``FASTIO_BACKEND=pwrite``): an
io_uring write is no system call of its own, and no tracer (strace included) sees its bytes. Why
not strace: it sees the same calls, but its data dumps are hex text split across threads'
"resumed" lines, and it would not see io_uring writes either; the wrappers give exact bytes and
which open file they went to with no parsing. A completeness check (tests/crashstates) replays the
whole trace and compares it with the directory the process really left, byte for byte.

``LowDiffOptimizer.step``, ``flush`` and ``close`` are wrapped too, to mark in the trace the step
``durable_step()`` reports once they return: a crash after that mark must resume at least there.

Run a script under the tracer: ``python traced.py ROOT TRACE SCRIPT ARGS...`` (tests/crashstates/traced.py).
"""
from __future__ import annotations

import atexit
import itertools
import os
import pickle
import threading
import time

_lock = threading.RLock()
_ops: list = []
_fds: dict = {}              # fd -> handle (a name unique across processes)
_counter = itertools.count()
_root = ""
_real: dict = {}


def _rel(path) -> str | None:
    """``path`` relative to the root, or None when it is outside."""
    if isinstance(path, int):
        return None
    full = os.path.abspath(os.fsdecode(path))
    if full == _root:
        return ""
    if full.startswith(_root + os.sep):
        return full[len(_root) + 1:]
    return None


def _record(*op, at: int | None = None) -> None:
    """Append ``op`` stamped with the monotonic clock: by default when the call has returned; a call
    that makes a name appear passes ``at``, read before the call, so that another process which
    sees the name (an open after it) is always stamped later and the merged traces keep that order."""
    _ops.append((time.monotonic_ns() if at is None else at, os.getpid()) + op)


def _wrap_open(path, flags, mode=0o777, *, dir_fd=None):
    rel = _rel(path) if dir_fd is None else None
    with _lock:
        existed = rel is not None and os.path.lexists(path)
        before = time.monotonic_ns()
        fd = _real["open"](path, flags, mode, dir_fd=dir_fd)
        if rel is not None:
            handle = f"{os.getpid()}:{next(_counter)}"
            _fds[fd] = handle
            created = bool(flags & os.O_CREAT) and not existed
            _record("open", handle, rel, created, bool(flags & os.O_TRUNC), at=before if created else None)
        return fd


def _wrap_close(fd):
    with _lock:
        _fds.pop(fd, None)
        return _real["close"](fd)


def _wrap_pwrite(fd, data, offset):
    with _lock:
        n = _real["pwrite"](fd, data, offset)
        if fd in _fds and n:
            _record("write", _fds[fd], offset, bytes(memoryview(data).cast("B")[:n]))
        return n


def _wrap_write(fd, data):
    with _lock:
        offset = os.lseek(fd, 0, os.SEEK_CUR) if fd in _fds else 0
        n = _real["write"](fd, data)
        if fd in _fds and n:
            _record("write", _fds[fd], offset, bytes(memoryview(data).cast("B")[:n]))
        return n


def _wrap_ftruncate(fd, length):
    with _lock:
        _real["ftruncate"](fd, length)
        if fd in _fds:
            _record("truncate", _fds[fd], length)


def _wrap_fallocate(fd, offset, length):
    with _lock:
        _real["posix_fallocate"](fd, offset, length)
        if fd in _fds:
            _record("extend", _fds[fd], offset + length)


def _syncer(name):
    def sync(fd):
        with _lock:
            _real[name](fd)
            if fd in _fds:
                _record("sync", _fds[fd])
    return sync


def _renamer(name):
    def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        with _lock:
            before = time.monotonic_ns()
            _real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            a, b = _rel(src), _rel(dst)
            if a is not None and b is not None:
                _record("rename", a, b, at=before)
            elif a is not None or b is not None:
                raise AssertionError(f"rename across the traced root: {src} -> {dst}")
    return rename


def _path_op(name, kind):
    def op(path, *args, **kwargs):
        with _lock:
            before = time.monotonic_ns()
            _real[name](path, *args, **kwargs)
            rel = _rel(path)
            if rel is not None and kwargs.get("dir_fd") is None:
                _record(kind, rel, at=before if kind == "mkdir" else None)
    return op


def mark_durable(step: int) -> None:
    """Mark in the trace that lowdiff reported ``step`` durable (called after that report)."""
    with _lock:
        _record("durable", int(step))


def _wrap_optimizer() -> None:
    from lowdiff.train.wrapper import LowDiffOptimizer

    for name in ("step", "flush", "close"):
        method = getattr(LowDiffOptimizer, name)

        def traced(self, *args, _method=method, **kwargs):
            out = _method(self, *args, **kwargs)
            mark_durable(self.durable_step)
            return out
        setattr(LowDiffOptimizer, name, traced)


def install(root: str, trace_path: str) -> None:
    """Trace every change under ``root`` from now on; the trace is pickled to ``trace_path`` when
    the process exits (``os._exit`` included: the gloo workers end with it)."""
    global _root
    _root = os.path.abspath(root)
    names = {"open": _wrap_open, "close": _wrap_close, "pwrite": _wrap_pwrite, "write": _wrap_write,
             "ftruncate": _wrap_ftruncate, "posix_fallocate": _wrap_fallocate,
             "fsync": _syncer("fsync"), "fdatasync": _syncer("fdatasync"),
             "replace": _renamer("replace"), "rename": _renamer("rename"),
             "unlink": _path_op("unlink", "unlink"), "remove": _path_op("remove", "unlink"),
             "mkdir": _path_op("mkdir", "mkdir"), "rmdir": _path_op("rmdir", "rmdir")}
    for name, wrapper in names.items():
        _real[name] = getattr(os, name)
        setattr(os, name, wrapper)
    real_exit = os._exit

    def dump() -> None:
        with _lock:
            data = pickle.dumps(_ops)
        fd = _real["open"](trace_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[_real["write"](fd, view):]
        finally:
            _real["close"](fd)

    def exit_after_dump(code):
        dump()
        real_exit(code)
    os._exit = exit_after_dump
    atexit.register(dump)
    _wrap_optimizer()


def load(path: str) -> list:
    """The ops of one trace file."""
    with open(path, "rb") as f:
        return pickle.load(f)
