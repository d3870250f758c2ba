/*
 * nflash/io.h - the asynchronous O_DIRECT read engine of a store.
 *
 * An I/O context reads a store's objects, extents and neuron bundles into
 * caller buffers. Reads are queued, coalesced, submitted in batches of up to
 * the queue depth and completed through a per-request callback, so that the
 * cache can raise a cluster-ready event the moment a cluster's bytes land.
 *
 * Backends (one file each under storage/):
 *   aio    libaio on an O_DIRECT descriptor (default)
 *   uring  io_uring through liburing, same semantics
 *   sync   pread on a normal descriptor; chosen automatically, with a
 *          one-line warning, where O_DIRECT is refused or not enforced
 *          (tmpfs: /dev/shm accepts O_DIRECT without honouring it), and
 *          (pread on the O_DIRECT descriptor) where the kernel answers
 *          io_setup / io_uring_setup with ENOSYS (qemu-user, sandboxes)
 *   fault  wraps another backend and fails, shortens or delays chosen reads
 *
 *	struct nf_io_opts o;
 *	nf_io_opts_default(&o);
 *	o.qd = 32;
 *	struct nf_io_ctx *io;
 *	if (nf_io_ctx_open(store, &o, &io, &diag) < 0) ...
 *	void *buf = nf_io_buf_alloc(n * obj->stride, nf_io_ctx_align(io));
 *	nf_io_ctx_read_bundles(io, obj, slots, n, buf, done, cookie);
 *	nf_io_ctx_wait(io, 0, -1);           // runs done(cookie, result)
 *
 * Errors (STYLE.md rule 6). A read that fails (errno from the kernel) or
 * comes back short fails its request with that error (NF_ESHORT for short)
 * and makes the context sticky: every later read_* call and wait return the
 * first such error, and requests still queued complete with it; requests
 * already in flight complete with their own result. A checksum mismatch
 * (NF_ECHECKSUM) fails only its request: the device works, the data is bad,
 * and `verify` must go on to name every bad extent. A late read is not an
 * error: a wait with a timeout returns -ETIMEDOUT and the context stays
 * usable. Close the context to clear a sticky error.
 *
 * Completion modes. By default (NF_IO_COMPLETION_POLL) the caller reaps:
 * callbacks run in the thread calling nf_io_ctx_wait(). With
 * NF_IO_COMPLETION_THREAD the context starts a thread that blocks in
 * io_getevents / io_uring_wait_cqe, runs the callbacks as reads land (with
 * the context's lock held, so a callback may queue reads but must not call
 * nf_io_ctx_wait() or close), and nf_io_ctx_wait() only sleeps until enough
 * requests completed. The sync and fault backends always poll.
 * docs/STORAGE.md compares the two.
 *
 * Thread-safety: in poll mode a context is used by one thread at a time;
 * in thread mode the read_* calls and wait may come from any threads.
 * Distinct contexts are independent.
 */
#ifndef NFLASH_IO_H
#define NFLASH_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/vfs.h>
#include <time.h>

#include "nflash/error.h"

#ifdef __cplusplus
extern "C" {
#endif

struct nf_store;
struct nf_store_object;
struct statx;
struct io_context;      /* libaio's, opaque here */
struct iocb;
struct io_event;
struct io_uring;        /* liburing's, opaque here */
struct io_uring_cqe;
struct __kernel_timespec;

/*
 * The system calls of the storage layer (STYLE.md rule 8). Contexts copy
 * the table they are given, so a test can replace any entry to make it
 * fail, come back short or sleep. Every entry follows its libc / library
 * counterpart's contract exactly (including errno for the POSIX ones and
 * negative returns for libaio and liburing).
 */
struct nf_io_sys {
	int (*open)(const char *path, int flags, mode_t mode);
	int (*close)(int fd);
	ssize_t (*pread)(int fd, void *buf, size_t len, off_t off);
	ssize_t (*pwrite)(int fd, const void *buf, size_t len, off_t off);
	int (*fstat)(int fd, struct stat *st);
	int (*fstatfs)(int fd, struct statfs *st);
	int (*statx)(int dirfd, const char *path, int flags, unsigned int mask, struct statx *stx);
	int (*ioctl_size)(int fd, uint64_t *bytes);         /* BLKGETSIZE64 */
	int (*ftruncate)(int fd, off_t len);
	int (*fsync)(int fd);
	int (*rename)(const char *from, const char *to);
	int (*unlink)(const char *path);
	int (*flock)(int fd, int op);                       /* in-place store updates */
	void *(*mmap)(void *addr, size_t len, int prot, int flags, int fd, off_t off);
	int (*munmap)(void *addr, size_t len);
	/* libaio */
	int (*kaio_setup)(int nr, struct io_context **ctx);
	int (*kaio_destroy)(struct io_context *ctx);
	int (*kaio_submit)(struct io_context *ctx, long n, struct iocb **iocbs);
	int (*kaio_getevents)(struct io_context *ctx, long min, long nr, struct io_event *ev,
			      struct timespec *timeout);
	/* liburing */
	int (*uring_init)(unsigned int entries, struct io_uring *ring, unsigned int flags);
	void (*uring_exit)(struct io_uring *ring);
	int (*uring_submit)(struct io_uring *ring);
	int (*uring_wait)(struct io_uring *ring, struct io_uring_cqe **cqe,
			  struct __kernel_timespec *timeout);    /* io_uring_wait_cqe_timeout */
};

/* The real calls. Constant; copy it and change entries for tests. */
extern const struct nf_io_sys nf_io_sys_default;

/*
 * nf_io_target_check - may a writer put a new file at path (replacing what
 * is there)? 0 when nothing is there, or a regular file or a symlink to one;
 * NF_EUSAGE naming what is there (a device, FIFO, socket or directory),
 * -ENOENT / -ENOTDIR when the directory it goes into does not exist or is
 * not one, or the statx error. sys NULL means nf_io_sys_default. Thread-safe.
 */
int nf_io_target_check(const struct nf_io_sys *sys, const char *path, struct nf_diag *d);

/*
 * Temporary files of writers. NF_IO_TMP_TAG is in every name:
 * ".<final name>.nflash-tmp.<pid>.<16 hex digits>", in the final name's
 * directory.
 *
 * nf_io_tmp_create - create a temporary file (dir false: O_RDWR, 0644) or
 * directory (dir true: fd is an O_DIRECTORY descriptor) for the final name
 * path and take an exclusive flock on fd, held until fd is closed, so that
 * nf_io_tmp_sweep never takes a live writer's file. Returns 0 with *tmp
 * (malloc'd; the caller frees it and removes the file) and *fd, or a
 * negative errno with d naming the path. sys NULL: nf_io_sys_default.
 *
 * nf_io_tmp_sweep - the temporaries in dir whose writer is gone (its pid no
 * longer runs and nobody holds the lock): calls fn(user, path, bytes, rc)
 * for each, where rc is 1 when only reported (remove false), else 0 or the
 * negative errno of removing it (a directory with the files in it). Returns
 * how many were found, or a negative errno (dir cannot be read).
 * Thread-safe.
 */
#define NF_IO_TMP_TAG ".nflash-tmp."
int nf_io_tmp_create(const struct nf_io_sys *sys, const char *path, bool dir, char **tmp, int *fd,
		     struct nf_diag *d);
typedef void (*nf_io_tmp_fn)(void *user, const char *path, uint64_t bytes, int rc);
int nf_io_tmp_sweep(const char *dir, bool remove, nf_io_tmp_fn fn, void *user);

/*
 * nf_io_pread_full / nf_io_pwrite_full - the whole of len bytes at off
 * through sys (NULL: nf_io_sys_default), retrying EINTR and partial
 * transfers. 0, a negative errno, or NF_ETRUNCATED when the file ends (a
 * read) or a write makes no progress. Thread-safe.
 */
int nf_io_pread_full(const struct nf_io_sys *sys, int fd, void *buf, size_t len, uint64_t off);
int nf_io_pwrite_full(const struct nf_io_sys *sys, int fd, const void *buf, size_t len,
		      uint64_t off);

enum nf_io_backend {
	NF_IO_AUTO = 0,   /* aio, or sync where O_DIRECT does not work */
	NF_IO_AIO,
	NF_IO_URING,
	NF_IO_SYNC,
	NF_IO_FAULT,      /* fault.inner does the reads */
};

/* Name as accepted by --backend ("auto", "aio", "uring", "sync", "fault"). */
const char *nf_io_backend_name(enum nf_io_backend b);
/* Parse a backend name; -1 when unknown. */
int nf_io_backend_parse(const char *name);

enum nf_io_fault_kind {
	NF_IO_FAULT_EIO = 1,   /* the read fails with -EIO */
	NF_IO_FAULT_SHORT,     /* the read returns half its bytes (rounded down to 512) */
	NF_IO_FAULT_DELAY,     /* the read completes delay_us late */
};

/* One rule: hits read number nth (0-based, counting every read the fault
 * backend submits) when prob is 0, else each read with probability prob. */
struct nf_io_fault_rule {
	enum nf_io_fault_kind kind;
	uint64_t nth;
	double prob;
	uint32_t delay_us;
};

#define NF_IO_FAULT_MAX_RULES 8
struct nf_io_fault_opts {
	enum nf_io_backend inner;    /* AUTO, AIO, URING or SYNC */
	uint64_t seed;               /* PRNG seed for probabilistic rules */
	unsigned int n_rules;
	struct nf_io_fault_rule rules[NF_IO_FAULT_MAX_RULES];
};

/* Who reaps completions and runs callbacks. */
enum nf_io_completion {
	NF_IO_COMPLETION_POLL = 0,    /* the caller, inside nf_io_ctx_wait() (default) */
	NF_IO_COMPLETION_THREAD,      /* a thread of the context's own (aio and uring only) */
};

struct nf_io_opts {
	enum nf_io_backend backend;   /* default NF_IO_AUTO */
	enum nf_io_completion completion;
	unsigned int qd;              /* reads in flight, 1..4096, default 32 */
	uint32_t max_coalesce;        /* bytes per read at most, default 1 MiB */
	unsigned int max_requests;    /* requests outstanding at most, default 1024 */
	unsigned int max_segments;    /* reads queued or in flight at most, default 16384 */
	bool no_verify;               /* skip crc32c checks on completion */
	bool quiet;                   /* do not print the fallback warning */
	const struct nf_io_sys *sys;  /* NULL: nf_io_sys_default */
	struct nf_io_fault_opts fault;
	/* Called for every read that completes, before its request's callback:
	 * offset, bytes asked, result (bytes or -errno), latency. For
	 * benchmarks and tracing; may be NULL. */
	void (*on_read)(void *user, uint64_t offset, uint32_t len, int64_t res, uint64_t lat_ns);
	void *on_read_user;
};

/* Fill o with the defaults above. */
void nf_io_opts_default(struct nf_io_opts *o);

struct nf_io_ctx;

/*
 * A request's completion: result is 0, a negative errno, NF_ESHORT,
 * NF_ECHECKSUM or the context's sticky error. Runs inside nf_io_ctx_wait();
 * it may queue new reads but must not close the context.
 */
typedef void (*nf_io_done_fn)(void *cookie, int result);

/*
 * nf_io_ctx_open - an I/O context reading store s (which must outlive it).
 * o may be NULL for defaults. Opens its own descriptor on the store's path
 * (O_DIRECT unless the backend is sync). Returns 0 and *out, or a negative
 * error with d naming the cause (nothing to clean up).
 */
int nf_io_ctx_open(struct nf_store *s, const struct nf_io_opts *o, struct nf_io_ctx **out,
		   struct nf_diag *d);
/* Waits for reads in flight (so no buffer is written after it returns), then
 * frees everything; callbacks of requests still pending do not run. NULL is
 * allowed. */
void nf_io_ctx_close(struct nf_io_ctx *io);

/*
 * Queue reads. buf must be aligned to nf_io_ctx_align() and stay valid
 * until the callback has run. Returns 0 when queued (cb will run exactly
 * once), or a negative error and cb will not run: NF_EALIGN (misaligned
 * buffer, offset or length), NF_EUSAGE (range outside the object), -EAGAIN
 * (max_requests or max_segments reached: wait and retry), or the sticky
 * error. Reads are submitted to the kernel before these return, as far as
 * the queue depth allows.
 *
 * read_object: a dense object's nf_store_object_buf_size() bytes, or every
 *   extent of an FFN object.
 * read_extents: extents [first, first + count) of an FFN object, back to
 *   back in buf.
 * read_bundles: bundles at slots[0..n) (slots, not neuron ids: map with
 *   obj->perm) to buf + k * stride. Runs of consecutive slots become one
 *   read of up to max_coalesce bytes; sort slots to get the most of it.
 *   Extents wholly covered by a run are verified.
 * read_raw: bytes [offset, offset + len) of the store file.
 */
int nf_io_ctx_read_object(struct nf_io_ctx *io, const struct nf_store_object *obj, void *buf,
			  nf_io_done_fn cb, void *cookie);
int nf_io_ctx_read_extents(struct nf_io_ctx *io, const struct nf_store_object *obj,
			   uint32_t first, uint32_t count, void *buf, nf_io_done_fn cb, void *cookie);
int nf_io_ctx_read_bundles(struct nf_io_ctx *io, const struct nf_store_object *obj,
			   const uint32_t *slots, uint32_t n, void *buf, nf_io_done_fn cb,
			   void *cookie);
int nf_io_ctx_read_raw(struct nf_io_ctx *io, uint64_t offset, uint64_t len, void *buf,
		       nf_io_done_fn cb, void *cookie);

/*
 * nf_io_ctx_wait - reap completions and run callbacks until at least
 * min_requests requests completed (0: until none is outstanding), or
 * timeout_ms passed (-1: no limit). Returns the number of requests
 * completed during the call (in thread mode requests may complete before
 * it), -ETIMEDOUT when the timeout passed first (callbacks of those that
 * did complete have run), or the sticky error / a backend error.
 */
int nf_io_ctx_wait(struct nf_io_ctx *io, unsigned int min_requests, int timeout_ms);

/*
 * Poll mode: collect the reads that have landed, without waiting, run
 * their callbacks and hand the queued reads the room they freed. A read
 * that landed holds its place in the queue depth until reaped, so a caller
 * that computes for milliseconds between waits leaves the device idle with
 * reads still queued here; calling this between its steps keeps the device
 * fed. Returns the requests completed (callbacks run), or the sticky error
 * / a backend error. In thread mode the thread reaps: 0.
 */
int nf_io_ctx_poll(struct nf_io_ctx *io);

/* Requests queued or in flight. */
unsigned int nf_io_ctx_pending(const struct nf_io_ctx *io);
/* The backend in use (never NF_IO_AUTO) and its name. */
enum nf_io_backend nf_io_ctx_backend(const struct nf_io_ctx *io);
/* Required alignment of buffers, offsets and lengths, in bytes. */
uint32_t nf_io_ctx_align(const struct nf_io_ctx *io);
/* The fallback warning printed at open, or "" if none. */
const char *nf_io_ctx_warning(const struct nf_io_ctx *io);
/* The sticky error, 0 if none. */
int nf_io_ctx_error(const struct nf_io_ctx *io);
/* The first failed read or checksum of the context, named ("blk.0.ffn:
 * bundle 150 at offset 1961984: crc32c mismatch"), or "" when none. Valid
 * until the context is closed. */
const char *nf_io_ctx_error_detail(const struct nf_io_ctx *io);

struct nf_io_stats {
	uint64_t requests;     /* completed */
	uint64_t reads;        /* system-level reads completed */
	uint64_t bytes;        /* bytes read */
	uint64_t submits;      /* io_submit / io_uring_submit / pread batches */
	uint64_t verified;     /* bytes checked by crc32c */
	uint64_t verify_ns;    /* time spent in crc32c */
};
void nf_io_ctx_stats(const struct nf_io_ctx *io, struct nf_io_stats *out);

/* Aligned memory for I/O buffers (align a power of two >= sizeof(void *));
 * length is rounded up to align. NULL on failure. Free with nf_io_buf_free. */
void *nf_io_buf_alloc(size_t len, size_t align);
void nf_io_buf_free(void *p);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_IO_H */
