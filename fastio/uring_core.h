/* uring_core.h - one io_uring instance driven by raw syscalls (no liburing).
 *
 * Contract: every function returning int returns >= 0 on success and a negative errno value on
 * failure (the value the kernel returned, never a stale global errno). A ring is used by one
 * thread at a time; nothing here takes the GIL or calls into Python.
 */
#ifndef FASTIO_URING_CORE_H
#define FASTIO_URING_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>
#include <linux/io_uring.h>

typedef struct uring {
    int fd;                    /* ring file descriptor, -1 when not set up */
    unsigned sq_entries;       /* SQ size granted by the kernel (a power of two) */
    unsigned cq_entries;       /* CQ size (twice sq_entries by default) */
    unsigned inflight;         /* prepared but not yet reaped; bounded by cq_entries */
    unsigned features;         /* IORING_FEAT_* */

    /* SQ ring: pointers into the shared mapping. The kernel writes *sq_khead, we write *sq_ktail. */
    unsigned *sq_khead, *sq_ktail, *sq_array;
    unsigned sq_mask, sq_tail; /* sq_tail: our copy of *sq_ktail (only we write it) */
    struct io_uring_sqe *sqes;

    /* CQ ring: the kernel writes *cq_ktail, we write *cq_khead. */
    unsigned *cq_khead, *cq_ktail;
    unsigned cq_mask;
    struct io_uring_cqe *cqes;

    void *sq_map, *cq_map;     /* cq_map == sq_map with IORING_FEAT_SINGLE_MMAP */
    size_t sq_map_bytes, cq_map_bytes, sqes_bytes;

    struct iovec *bufs;        /* copy of the registered buffers, to pick buf_index at prep */
    unsigned nbufs;
} uring_t;

/* Set up a ring of at least `entries` SQEs (clamped to the kernel maximum). On failure nothing
 * is left open and r->fd == -1. */
int uring_init(uring_t *r, unsigned entries);

/* Unmap and close. Does not wait for in-flight requests: call uring_drain() first if buffers
 * must outlive the I/O. Safe on a ring whose uring_init failed. Returns close(2)'s result. */
int uring_exit(uring_t *r);

/* Queue one read or write of `len` bytes (clamped to the kernel's per-call maximum, which
 * gives a short transfer) at file `offset`. Uses READ_FIXED/WRITE_FIXED when [buf, buf+len) lies
 * inside a registered buffer. -EBUSY when the SQ is full or `inflight` reached cq_entries
 * (so the CQ can never overflow). The SQE is visible to the kernel at the next submit. */
int uring_prep_rw(uring_t *r, int is_write, int fd, void *buf, size_t len, uint64_t offset,
                  uint64_t user_data);

/* Submit every queued SQE and wait until at least `min_complete` CQEs (clamped to `inflight`)
 * are ready. Returns the number of CQEs ready to reap. -EINTR is returned, not retried, so
 * the caller can run signal handlers; calling again is always safe. */
int uring_submit_and_wait(uring_t *r, unsigned min_complete);

/* Copy up to `max` completions out and release their CQ slots. Returns how many. */
unsigned uring_reap(uring_t *r, uint64_t *user_data, int32_t *res, unsigned max);

/* Submit and wait for everything in flight (retrying EINTR), discarding the results. Call it
 * before freeing buffers the kernel may still touch. */
int uring_drain(uring_t *r);

/* Register `n` buffers for fixed I/O, replacing any registered before. The memory must stay
 * mapped until it is unregistered or the ring is closed. */
int uring_register_buffers(uring_t *r, const struct iovec *iov, unsigned n);
int uring_unregister_buffers(uring_t *r);

/* Set up and tear down a tiny ring and check IORING_OP_READ/WRITE(_FIXED) are supported
 * (-EOPNOTSUPP if not). */
int uring_probe(void);

#endif
