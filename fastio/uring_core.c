/* uring_core.c - fastio's io_uring ring: syscalls, ring mappings, SQE prep, CQE reap. */
#define _GNU_SOURCE
#include "uring_core.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The numbers are the same on every architecture except alpha; old libc headers may lack them. */
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

/* The kernel caps one read/write at INT_MAX rounded down to a page (MAX_RW_COUNT); sqe->len is
 * 32 bits. Clamping here turns a huge request into a short transfer the caller resubmits. */
#define URING_MAX_RW ((size_t)0x7ffff000)

/* Ring indices shared with the kernel. Acquire on the index the kernel publishes (CQ tail: the
 * CQE contents written before it are then visible; SQ head: the kernel is done reading those
 * SQEs before we overwrite them). Release on the index we publish (SQ tail: the SQE contents we
 * wrote become visible first; CQ head: we finished reading the CQEs before the kernel reuses
 * their slots). */
static inline unsigned load_acquire(const unsigned *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store_release(unsigned *p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* syscall(2) returns -1 and sets errno; errno is read right after the failing call. */
static int sys_setup(unsigned entries, struct io_uring_params *p)
{
    long ret = syscall(__NR_io_uring_setup, entries, p);
    return ret < 0 ? -errno : (int)ret;
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    long ret = syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, (size_t)0);
    return ret < 0 ? -errno : (int)ret;
}

static int sys_register(int fd, unsigned opcode, void *arg, unsigned nr_args)
{
    long ret;
    do {  /* older kernels quiesce the ring for (un)registration and may be interrupted */
        ret = syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
    } while (ret < 0 && errno == EINTR);
    return ret < 0 ? -errno : (int)ret;
}

static void *map_ring(int fd, size_t bytes, uint64_t offset, int *err)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, (off_t)offset);
    if (p == MAP_FAILED) {
        *err = -errno;
        return NULL;
    }
    return p;
}

int uring_init(uring_t *r, unsigned entries)
{
    struct io_uring_params p;
    int ret = 0;
    unsigned i;
    char *sq, *cq;

    memset(r, 0, sizeof *r);
    memset(&p, 0, sizeof p);
    r->fd = -1;
    /* CLAMP: a queue depth above the kernel maximum gets the maximum instead of EINVAL. */
    p.flags = IORING_SETUP_CLAMP;
    ret = sys_setup(entries, &p);
    if (ret < 0)
        return ret;
    r->fd = ret;
    r->features = p.features;
    r->sq_entries = p.sq_entries;
    r->cq_entries = p.cq_entries;

    r->sq_map_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_bytes = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        /* Both rings live in one mapping (5.4+): map it once, large enough for either. */
        if (r->cq_map_bytes > r->sq_map_bytes)
            r->sq_map_bytes = r->cq_map_bytes;
        r->cq_map_bytes = r->sq_map_bytes;
    }
    r->sq_map = map_ring(r->fd, r->sq_map_bytes, IORING_OFF_SQ_RING, &ret);
    if (!r->sq_map)
        goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = map_ring(r->fd, r->cq_map_bytes, IORING_OFF_CQ_RING, &ret);
        if (!r->cq_map)
            goto fail;
    }
    r->sqes_bytes = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = map_ring(r->fd, r->sqes_bytes, IORING_OFF_SQES, &ret);
    if (!r->sqes)
        goto fail;

    sq = r->sq_map;
    cq = r->cq_map;
    r->sq_khead = (unsigned *)(sq + p.sq_off.head);
    r->sq_ktail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = *(unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->sq_tail = *r->sq_ktail;
    r->cq_khead = (unsigned *)(cq + p.cq_off.head);
    r->cq_ktail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = *(unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    /* SQ slot i always holds SQE i, so the indirection array is filled once. */
    for (i = 0; i < p.sq_entries; i++)
        r->sq_array[i] = i;
    return 0;

fail:
    uring_exit(r);
    return ret;
}

int uring_exit(uring_t *r)
{
    int ret = 0;

    /* munmap of a mapping we created with its own length cannot fail in a way we could act on. */
    if (r->sqes)
        munmap(r->sqes, r->sqes_bytes);
    if (r->cq_map && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_map_bytes);
    if (r->sq_map)
        munmap(r->sq_map, r->sq_map_bytes);
    /* Closing the fd also drops the registered buffers. No retry on EINTR: Linux has closed it. */
    if (r->fd >= 0 && close(r->fd) < 0)
        ret = -errno;
    free(r->bufs);
    memset(r, 0, sizeof *r);
    r->fd = -1;
    return ret;
}

/* Index of the registered buffer holding [buf, buf+len), or -1. The list is short. */
static int find_buffer(const uring_t *r, const void *buf, size_t len)
{
    uintptr_t start = (uintptr_t)buf;
    unsigned i;

    for (i = 0; i < r->nbufs; i++) {
        uintptr_t base = (uintptr_t)r->bufs[i].iov_base;
        if (start >= base && len <= r->bufs[i].iov_len && start - base <= r->bufs[i].iov_len - len)
            return (int)i;
    }
    return -1;
}

int uring_prep_rw(uring_t *r, int is_write, int fd, void *buf, size_t len, uint64_t offset,
                  uint64_t user_data)
{
    struct io_uring_sqe *sqe;
    int index;

    if (r->fd < 0)
        return -EBADF;
    if (r->sq_tail - load_acquire(r->sq_khead) >= r->sq_entries || r->inflight >= r->cq_entries)
        return -EBUSY;
    if (len > URING_MAX_RW)
        len = URING_MAX_RW;
    index = len ? find_buffer(r, buf, len) : -1;

    sqe = &r->sqes[r->sq_tail & r->sq_mask];
    memset(sqe, 0, sizeof *sqe);  /* unused fields (flags, rw_flags, ...) must be zero */
    if (index >= 0) {
        sqe->opcode = is_write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
        sqe->buf_index = (__u16)index;
    } else {
        sqe->opcode = is_write ? IORING_OP_WRITE : IORING_OP_READ;
    }
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = (uint32_t)len;
    sqe->off = offset;
    sqe->user_data = user_data;

    /* Publishing now is safe: without SQPOLL the kernel reads the SQ only inside io_uring_enter. */
    r->sq_tail++;
    store_release(r->sq_ktail, r->sq_tail);
    r->inflight++;
    return 0;
}

static unsigned cq_ready(const uring_t *r)
{
    return load_acquire(r->cq_ktail) - *r->cq_khead;
}

int uring_submit_and_wait(uring_t *r, unsigned min_complete)
{
    if (r->fd < 0)
        return -EBADF;
    /* Waiting for more completions than requests outstanding would block forever. */
    if (min_complete > r->inflight)
        min_complete = r->inflight;
    for (;;) {
        /* Without SQPOLL the kernel consumes SQEs only in io_uring_enter, so this is exact. */
        unsigned to_submit = r->sq_tail - load_acquire(r->sq_khead);
        unsigned ready = cq_ready(r);
        int ret;

        if (to_submit == 0 && ready >= min_complete)
            return (int)ready;
        ret = sys_enter(r->fd, to_submit, min_complete, IORING_ENTER_GETEVENTS);
        if (ret < 0) {
            /* Out of kernel resources or CQ backlog: reaping what is ready frees them. */
            if ((ret == -EAGAIN || ret == -EBUSY) && (ready = cq_ready(r)) > 0)
                return (int)ready;
            return ret;
        }
        /* ret = SQEs consumed. A wait cut short by a signal after submitting also returns the
         * count, so loop until the condition above holds; but never spin on a kernel that
         * accepts nothing. */
        if (ret == 0 && to_submit > 0) {
            ready = cq_ready(r);
            return ready > 0 ? (int)ready : -EAGAIN;
        }
    }
}

unsigned uring_reap(uring_t *r, uint64_t *user_data, int32_t *res, unsigned max)
{
    unsigned head, tail, n = 0;

    if (r->fd < 0)
        return 0;
    head = *r->cq_khead;  /* only we write the CQ head */
    tail = load_acquire(r->cq_ktail);
    while (head != tail && n < max) {
        const struct io_uring_cqe *cqe = &r->cqes[head & r->cq_mask];
        user_data[n] = cqe->user_data;
        res[n] = cqe->res;
        head++;
        n++;
    }
    if (n) {
        store_release(r->cq_khead, head);
        r->inflight -= n;
    }
    return n;
}

int uring_drain(uring_t *r)
{
    uint64_t user_data[64];
    int32_t res[64];

    while (r->inflight > 0) {
        int ret = uring_submit_and_wait(r, 1);
        if (ret < 0 && ret != -EINTR)
            return ret;
        uring_reap(r, user_data, res, 64);
    }
    return 0;
}

int uring_register_buffers(uring_t *r, const struct iovec *iov, unsigned n)
{
    struct iovec *copy;
    int ret;

    if (r->fd < 0)
        return -EBADF;
    copy = malloc(n * sizeof *copy);
    if (!copy)
        return -ENOMEM;
    memcpy(copy, iov, n * sizeof *copy);
    if (r->nbufs) {  /* the kernel refuses a second table (EBUSY): replace the first */
        ret = uring_unregister_buffers(r);
        if (ret < 0) {
            free(copy);
            return ret;
        }
    }
    ret = sys_register(r->fd, IORING_REGISTER_BUFFERS, copy, n);
    if (ret < 0) {
        free(copy);
        return ret;
    }
    r->bufs = copy;
    r->nbufs = n;
    return 0;
}

int uring_unregister_buffers(uring_t *r)
{
    int ret;

    if (r->fd < 0)
        return -EBADF;
    if (!r->nbufs)
        return 0;
    ret = sys_register(r->fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
    if (ret < 0)
        return ret;
    free(r->bufs);
    r->bufs = NULL;
    r->nbufs = 0;
    return 0;
}

static int op_supported(const struct io_uring_probe *p, unsigned op)
{
    return op <= p->last_op && op < p->ops_len && (p->ops[op].flags & IO_URING_OP_SUPPORTED);
}

int uring_probe(void)
{
    enum { NOPS = 256 };
    struct io_uring_probe *p;
    uring_t r;
    int close_ret, ret = uring_init(&r, 2);

    if (ret < 0)
        return ret;
    p = calloc(1, sizeof *p + NOPS * sizeof p->ops[0]);
    if (!p) {
        uring_exit(&r);
        return -ENOMEM;
    }
    ret = sys_register(r.fd, IORING_REGISTER_PROBE, p, NOPS);
    if (ret == -EINVAL)
        ret = -EOPNOTSUPP;  /* before 5.6: no probe, and no IORING_OP_READ/WRITE either */
    else if (ret >= 0 && !(op_supported(p, IORING_OP_READ) && op_supported(p, IORING_OP_WRITE) &&
                           op_supported(p, IORING_OP_READ_FIXED) && op_supported(p, IORING_OP_WRITE_FIXED)))
        ret = -EOPNOTSUPP;
    free(p);
    close_ret = uring_exit(&r);
    return ret < 0 ? ret : close_ret;
}
