# cython: language_level=3
"""The io_uring ring as a Python handle (``Ring``), and ``probe()``: a thin layer over uring_core.c.

A Ring is used by one thread at a time. It keeps every buffer it was handed alive (an exported
buffer of it) until the request's completion is reaped, and ``close()`` waits for the requests
still in flight, so the kernel never touches freed memory. ``close()`` drops registered buffers.
"""
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport EBUSY, EINTR
from libc.stdint cimport int32_t, uint64_t
from libc.stdlib cimport free, malloc
from posix.unistd cimport getpid

import errno as _errno
import warnings

from fastio._errors import io_error

cdef enum:
    REAP_BATCH = 64

_U64_LIMIT = 1 << 64

# register_buffers() reports these as "refused" (False): limits and policy, not bugs.
_REGISTER_REFUSALS = frozenset({_errno.ENOMEM, _errno.EPERM, _errno.EACCES, _errno.EOPNOTSUPP,
                                _errno.EINVAL, _errno.EOVERFLOW, _errno.ENOSYS})

# Buffers of requests a failed close() could not wait for: the kernel may still write into them,
# so they are never released (a leak is better than a write into reused memory).
_unsafe_to_release = []


cdef int _check(int ret, str operation) except -1:
    """The one place a negative errno from uring_core becomes an OSError (its errno subclass)."""
    if ret < 0:
        raise io_error(-ret, operation, None)
    return 0


def probe():
    """Set up and tear down a tiny ring; OSError if io_uring is unusable here.

    EPERM/ENOSYS/EINVAL from seccomp, ``kernel.io_uring_disabled`` or an old kernel come back as
    the OSError's errno; EOPNOTSUPP if IORING_OP_READ/WRITE are missing.
    """
    cdef int ret
    with nogil:
        ret = uring_probe()
    _check(ret, "io_uring probe")


cdef class Ring:
    """One io_uring instance: ``prep`` requests, ``submit_and_wait``, ``reap`` completions.

    ``user_data`` identifies a request in its completion and must be unique among the requests
    in flight. Completions are ``(user_data, res)``: ``res`` is the byte count transferred (may be
    short) or a negative errno; the Ring does not interpret it.
    """

    cdef uring_t _ring
    cdef bint _open
    cdef bint _waiting
    cdef int _pid
    cdef dict _inflight   # user_data -> the exported buffer the kernel reads or writes

    def __cinit__(self, entries):
        self._open = False
        self._waiting = False
        self._inflight = {}
        self._ring.fd = -1
        if not 1 <= entries < (1 << 32):
            raise ValueError(f"Ring entries={entries} must be in [1, 2**32)")
        cdef unsigned n = entries
        cdef int ret
        with nogil:
            ret = uring_init(&self._ring, n)
        _check(ret, f"io_uring_setup with {entries} entries")
        self._open = True
        self._pid = getpid()

    @property
    def sq_entries(self) -> int:
        return self._ring.sq_entries

    @property
    def cq_entries(self) -> int:
        return self._ring.cq_entries

    @property
    def inflight(self) -> int:
        """Requests prepared and not yet reaped."""
        return self._ring.inflight

    @property
    def closed(self) -> bool:
        return not self._open

    cdef int _check_open(self) except -1:
        if not self._open:
            raise ValueError("io_uring Ring is closed")
        return 0

    def prep(self, str op, int fd, view, offset, user_data) -> bool:
        """Queue ``op`` ("write" from or "read" into the 1-D C-contiguous byte buffer ``view``) at
        file ``offset``. False when the ring is full (reap first). The kernel sees it at the next
        ``submit_and_wait``."""
        cdef const unsigned char[::1] source
        cdef unsigned char[::1] target
        cdef void *address = NULL
        cdef size_t nbytes = 0
        cdef int is_write, ret
        cdef object keep
        self._check_open()
        if op == "write":
            is_write = 1
            source = view
            keep = source
            nbytes = source.shape[0]
            if nbytes:
                address = <void *>&source[0]
        elif op == "read":
            is_write = 0
            target = view
            keep = target
            nbytes = target.shape[0]
            if nbytes:
                address = &target[0]
        else:
            raise ValueError(f"op={op!r} must be 'write' or 'read'")
        if not 0 <= offset < _U64_LIMIT:
            raise ValueError(f"offset={offset} must be in [0, 2**64)")
        if not 0 <= user_data < _U64_LIMIT:
            raise ValueError(f"user_data={user_data} must be in [0, 2**64)")
        if user_data in self._inflight:
            raise ValueError(f"user_data={user_data} is already in flight")
        ret = uring_prep_rw(&self._ring, is_write, fd, address, nbytes, offset, user_data)
        if ret == -EBUSY:
            return False
        _check(ret, f"io_uring {op} prep")
        self._inflight[user_data] = keep
        return True

    def submit_and_wait(self, unsigned min_complete=1) -> int:
        """Submit every prepared request, then wait (GIL released) until ``min_complete``
        completions are ready (fewer if fewer are in flight). Returns how many are ready.
        Interrupted waits are resumed after Python signal handlers ran (PEP 475)."""
        cdef int ret
        self._check_open()
        self._waiting = True
        try:
            while True:
                with nogil:
                    ret = uring_submit_and_wait(&self._ring, min_complete)
                if ret != -EINTR:
                    break
                PyErr_CheckSignals()  # a handler that raises ends the wait; retrying is safe
        finally:
            self._waiting = False
        _check(ret, "io_uring_enter")
        return ret

    def reap(self) -> list:
        """Every completion ready now, as ``(user_data, res)`` tuples, in completion order."""
        cdef uint64_t user_data[REAP_BATCH]
        cdef int32_t res[REAP_BATCH]
        cdef unsigned i, n = REAP_BATCH
        self._check_open()
        done = []
        inflight = self._inflight
        while n == REAP_BATCH:
            n = uring_reap(&self._ring, user_data, res, REAP_BATCH)
            for i in range(n):
                inflight.pop(user_data[i], None)
                done.append((user_data[i], res[i]))
        return done

    def register_buffers(self, buffers) -> bool:
        """Register ``[(address, nbytes), ...]`` for fixed I/O, replacing earlier registrations.

        Later requests whose bytes lie inside one of them use READ_FIXED/WRITE_FIXED. False if
        the kernel refuses (memlock limit, permissions, sizes); the ring works without them.
        The memory must stay mapped and unchanged in address until ``unregister_buffers()`` or
        ``close()``: the kernel pins the pages it found at registration.
        """
        cdef iovec *iov
        cdef Py_ssize_t i, n
        cdef int ret
        self._check_open()
        pairs = [(int(address), int(nbytes)) for address, nbytes in buffers]
        n = len(pairs)
        if n == 0:
            raise ValueError("register_buffers needs at least one (address, nbytes) pair")
        for address, nbytes in pairs:
            if address <= 0 or nbytes <= 0:
                raise ValueError(f"buffer (address={address:#x}, nbytes={nbytes}) must be non-empty")
        iov = <iovec *>malloc(n * sizeof(iovec))
        if iov == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                iov[i].iov_base = <void *><size_t>pairs[i][0]
                iov[i].iov_len = pairs[i][1]
            with nogil:
                ret = uring_register_buffers(&self._ring, iov, <unsigned>n)
        finally:
            free(iov)
        if ret < 0 and -ret in _REGISTER_REFUSALS:
            return False
        _check(ret, f"io_uring_register of {n} buffers")
        return True

    def unregister_buffers(self) -> None:
        cdef int ret
        self._check_open()
        with nogil:
            ret = uring_unregister_buffers(&self._ring)
        _check(ret, "io_uring_register (unregister buffers)")

    cdef int _teardown(self):
        """Wait for in-flight requests, then unmap and close. Returns the first error."""
        cdef int drained = 0, closed
        self._open = False
        # A forked child shares the parent's ring memory: draining would steal the parent's
        # completions. The child only drops its own mappings and fd.
        if self._pid == getpid():
            with nogil:
                drained = uring_drain(&self._ring)
        if self._inflight:
            if drained < 0:
                _unsafe_to_release.extend(self._inflight.values())
            self._inflight.clear()
        closed = uring_exit(&self._ring)
        return drained if drained < 0 else closed

    def close(self) -> None:
        """Wait for the requests in flight, then release the ring. Idempotent."""
        if not self._open:
            return
        if self._waiting:
            raise RuntimeError("Ring.close() called while another thread waits on the ring")
        _check(self._teardown(), "io_uring close")

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        state = "closed" if not self._open else f"fd={self._ring.fd} sq_entries={self._ring.sq_entries}"
        return f"<fastio._uring.Ring {state}>"

    def __dealloc__(self):
        if not self._open:
            return
        if self._pid == getpid():
            try:
                warnings.warn(f"unclosed io_uring Ring (fd {self._ring.fd})", ResourceWarning)
            except BaseException:  # interpreter shutdown: warnings may be gone
                pass
        self._teardown()
