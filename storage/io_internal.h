/*
 * io_internal.h - what the I/O engine (io.c) and its backends share.
 *
 * A request (read_object/extents/bundles/raw) becomes one or more
 * segments, each one system-level read of aligned bytes. Backends see only
 * segments: submit() hands them to the kernel, reap() returns finished
 * ones with seg->res set (bytes read or -errno). A backend may wrap
 * another (fault wraps aio, uring or sync).
 */
#ifndef NFLASH_IO_INTERNAL_H
#define NFLASH_IO_INTERNAL_H

#include <libaio.h>
#include <stdint.h>

#include "nflash/io.h"

struct nf_io_req;

/*
 * A segment is filled by the submitting thread (seg_add, the backend's
 * prep) and read by the thread that reaps its completion; the kernel
 * orders the two (io_submit / io_uring_submit happen before the event is
 * returned), which ThreadSanitizer cannot see. NF_TSAN_RELEASE before the
 * submit and NF_TSAN_ACQUIRE after the reap tell it, so a TSan report on
 * the I/O path is a real race.
 */
#if defined(__SANITIZE_THREAD__)
#define NF_IO_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define NF_IO_TSAN 1
#endif
#endif
#ifdef NF_IO_TSAN
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
#define NF_TSAN_RELEASE(p) __tsan_release(p)
#define NF_TSAN_ACQUIRE(p) __tsan_acquire(p)
#else
#define NF_TSAN_RELEASE(p) ((void)(p))
#define NF_TSAN_ACQUIRE(p) ((void)(p))
#endif

struct nf_io_seg {
	struct nf_io_req *req;
	uint64_t offset;
	uint32_t len;
	uint8_t *buf;
	int64_t res;              /* bytes or -errno, set by reap */
	uint64_t t_submit;        /* ns, CLOCK_MONOTONIC */
	struct nf_io_seg *next;   /* queue / free list / backend lists */
	/* fault backend */
	int fault;                /* enum nf_io_fault_kind or 0 */
	uint32_t delay_us;
	uint64_t due;
	/* per-backend */
	struct iocb iocb;
};

struct nf_io_be;

struct nf_io_be_ops {
	const char *name;
	/* Set up for ctx (descriptor and queue depth in be->ctx). 0 or -errno. */
	int (*init)(struct nf_io_be *be);
	void (*fini)(struct nf_io_be *be);
	/* Hand n segments to the kernel; returns how many were taken (>= 0;
	 * fewer when the kernel is full) or -errno. */
	int (*submit)(struct nf_io_be *be, struct nf_io_seg **segs, unsigned int n);
	/* Collect up to max finished segments into out, waiting for at least
	 * min of them or until timeout_ns (< 0: forever). Returns the count
	 * (0 on timeout) or -errno. */
	int (*reap)(struct nf_io_be *be, unsigned int min, unsigned int max, int64_t timeout_ns,
		    struct nf_io_seg **out);
};

struct nf_io_be {
	const struct nf_io_be_ops *ops;
	const struct nf_io_sys *sys;
	int fd;
	unsigned int qd;
	void *priv;
	unsigned int inflight;     /* maintained by the backend */
	/* fault backend only: its rules and the backend it wraps */
	const struct nf_io_fault_opts *fault;
	const struct nf_io_be_ops *inner_ops;
};

extern const struct nf_io_be_ops nf_io_be_aio;
extern const struct nf_io_be_ops nf_io_be_uring;
extern const struct nf_io_be_ops nf_io_be_sync;
extern const struct nf_io_be_ops nf_io_be_fault;

uint64_t nf_io_now_ns(void);

#endif /* NFLASH_IO_INTERNAL_H */
