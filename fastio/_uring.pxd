# The C ABI of uring_core.h, and nothing else.
from libc.stdint cimport int32_t, uint64_t
from posix.uio cimport iovec


cdef extern from "uring_core.h" nogil:
    ctypedef struct uring_t:
        int fd
        unsigned sq_entries
        unsigned cq_entries
        unsigned inflight

    int uring_init(uring_t *r, unsigned entries)
    int uring_exit(uring_t *r)
    int uring_prep_rw(uring_t *r, int is_write, int fd, void *buf, size_t length, uint64_t offset,
                      uint64_t user_data)
    int uring_submit_and_wait(uring_t *r, unsigned min_complete)
    unsigned uring_reap(uring_t *r, uint64_t *user_data, int32_t *res, unsigned max)
    int uring_drain(uring_t *r)
    int uring_register_buffers(uring_t *r, const iovec *iov, unsigned n)
    int uring_unregister_buffers(uring_t *r)
    int uring_probe()
