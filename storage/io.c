/*
 * io.c - the backend-independent part of the I/O engine: requests,
 * coalescing, alignment checks, batching up to the queue depth,
 * completion, verification and sticky errors.
 *
 * Invariants:
 *  1. Every read handed to a backend is aligned (buffer, offset, length)
 *     to the context's alignment; misaligned requests are refused before
 *     anything is queued, so a backend never sees one.
 *  2. At most qd segments are in the backend at once; the rest wait in a
 *     FIFO and are submitted in batches as completions free room.
 *  3. A request's callback runs exactly once, after all its segments
 *     finished, from nf_io_ctx_wait(); its result is the first error of its
 *     segments, else the verification result, else 0.
 *  4. The first read error (errno or short read) sticks (io.h describes
 *     what that means); checksum mismatches do not.
 *  5. The hot path does not allocate: requests and segments come from
 *     pools sized at open.
 *  6. In completion-thread mode every field below is guarded by mu (a
 *     recursive mutex, so callbacks run by the thread may queue reads);
 *     only the backend's reap runs outside it, in the thread, and the
 *     backends keep their inflight counters atomic for that.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>

#include "nflash/crc32c.h"
#include "nflash/store.h"
#include "io_internal.h"

enum req_kind { REQ_OBJECT = 1, REQ_EXTENTS, REQ_BUNDLES, REQ_RAW };

struct nf_io_req {
	nf_io_done_fn cb;
	void *cookie;
	const struct nf_store_object *obj;
	enum req_kind kind;
	uint32_t first, count;     /* extents */
	uint8_t *buf;
	int result;
	unsigned int pending;      /* segments not yet finished */
	struct nf_io_req *next;    /* free list */
};

struct nf_io_ctx {
	struct nf_store *store;
	struct nf_io_opts opts;
	struct nf_io_sys sys;
	enum nf_io_backend backend;
	struct nf_io_be be;
	int fd;
	uint32_t mem_align, off_align, align;
	uint32_t block_size;
	int err;                         /* sticky */
	char warning[256];
	char detail[256];                /* the first failed read or checksum, named */
	struct nf_io_req *reqs, *free_reqs;
	struct nf_io_seg *segs, *free_segs;
	unsigned int n_free_segs;
	struct nf_io_seg *q_head, *q_tail;  /* queued, not yet submitted */
	unsigned int pending_reqs;
	struct nf_io_seg **batch;        /* qd entries */
	struct nf_io_stats stats;
	uint64_t completed;              /* requests completed since open */
	/* completion-thread mode */
	bool threaded, thr_started, thr_stop;
	pthread_t thr;
	pthread_mutex_t mu;
	pthread_cond_t done_cv, work_cv;
};

static void *completion_main(void *arg);

static void lock(struct nf_io_ctx *io)
{
	if (io->threaded)
		pthread_mutex_lock(&io->mu);
}

static void unlock(struct nf_io_ctx *io)
{
	if (io->threaded)
		pthread_mutex_unlock(&io->mu);
}

static unsigned int be_inflight(const struct nf_io_ctx *io)
{
	return __atomic_load_n(&io->be.inflight, __ATOMIC_RELAXED);
}

uint64_t nf_io_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const char *const backend_names[] = {
	[NF_IO_AUTO] = "auto", [NF_IO_AIO] = "aio", [NF_IO_URING] = "uring",
	[NF_IO_SYNC] = "sync", [NF_IO_FAULT] = "fault",
};

const char *nf_io_backend_name(enum nf_io_backend b)
{
	return (unsigned)b < sizeof(backend_names) / sizeof(backend_names[0]) ? backend_names[b]
									      : "unknown";
}

int nf_io_backend_parse(const char *name)
{
	for (unsigned i = 0; i < sizeof(backend_names) / sizeof(backend_names[0]); i++)
		if (!strcmp(name, backend_names[i]))
			return (int)i;
	return -1;
}

void nf_io_opts_default(struct nf_io_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->backend = NF_IO_AUTO;
	o->qd = 32;
	o->max_coalesce = 1u << 20;
	o->max_requests = 1024;
	o->max_segments = 16384;
	o->fault.inner = NF_IO_AUTO;
}

void *nf_io_buf_alloc(size_t len, size_t align)
{
	void *p = NULL;
	if (align < sizeof(void *) || (align & (align - 1)))
		return NULL;
	len = (len + align - 1) / align * align;
	if (posix_memalign(&p, align, len ? len : align) != 0)
		return NULL;
	return p;
}

void nf_io_buf_free(void *p)
{
	free(p);
}

static const struct nf_io_be_ops *ops_for(enum nf_io_backend b)
{
	switch (b) {
	case NF_IO_AIO: return &nf_io_be_aio;
	case NF_IO_URING: return &nf_io_be_uring;
	case NF_IO_SYNC: return &nf_io_be_sync;
	case NF_IO_FAULT: return &nf_io_be_fault;
	default: return NULL;
	}
}

/* Alignment for O_DIRECT from statx(STATX_DIOALIGN), else 4096. A
 * descriptor without O_DIRECT (the sync backend) reads through the page
 * cache, which needs none: there the store's block size does, at most 4096
 * (an emulator such as qemu-user reports no DIOALIGN, and a store of
 * 512-byte blocks must still be readable). */
static void query_align(struct nf_io_ctx *io, bool direct)
{
	struct statx stx;
	io->mem_align = io->off_align = 4096;
	if (!direct && io->block_size && io->block_size < 4096)
		io->mem_align = io->off_align = io->block_size;
	memset(&stx, 0, sizeof(stx));
	if (direct && io->sys.statx(io->fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
	    (stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_mem_align && stx.stx_dio_offset_align) {
		io->mem_align = stx.stx_dio_mem_align;
		io->off_align = stx.stx_dio_offset_align;
	}
	if (io->mem_align < sizeof(void *))
		io->mem_align = sizeof(void *);
	io->align = io->mem_align > io->off_align ? io->mem_align : io->off_align;
}

static void set_align(struct nf_io_ctx *io, bool direct)
{
	struct nf_io_opts *op = &io->opts;
	query_align(io, direct);
	if (op->max_coalesce < io->align)
		op->max_coalesce = io->align;
	op->max_coalesce -= op->max_coalesce % io->align;
}

static void warn(struct nf_io_ctx *io, const char *fmt, const char *path)
{
	snprintf(io->warning, sizeof(io->warning), fmt, path);
	if (!io->opts.quiet)
		fprintf(stderr, "nflash: warning: %s\n", io->warning);
}

/* Open the descriptor, falling back to sync where O_DIRECT does not work.
 * *which is the backend doing the reads (for fault: the inner one). */
static int open_fd(struct nf_io_ctx *io, enum nf_io_backend *which, struct nf_diag *d)
{
	const char *path = nf_store_path(io->store);
	if (*which == NF_IO_AUTO)
		*which = NF_IO_AIO;
	if (*which != NF_IO_SYNC) {
		io->fd = io->sys.open(path, O_RDONLY | O_DIRECT, 0);
		if (io->fd < 0 && errno != EINVAL)
			return nf_diag_fail(d, -errno, "%s: cannot open with O_DIRECT: %s", path,
					    nf_strerror(-errno));
		if (io->fd < 0) {
			warn(io, "%s: the file system refuses O_DIRECT; using the sync (pread) backend", path);
			*which = NF_IO_SYNC;
		} else {
			struct statfs sf;
			if (io->sys.fstatfs(io->fd, &sf) < 0) {
				int rc = -errno;
				io->sys.close(io->fd);
				io->fd = -1;
				return nf_diag_fail(d, rc, "%s: fstatfs: %s", path, nf_strerror(rc));
			}
			if (sf.f_type == TMPFS_MAGIC) {
				warn(io, "%s: tmpfs accepts O_DIRECT without honouring it; using the sync (pread) backend", path);
				io->sys.close(io->fd);
				io->fd = -1;
				*which = NF_IO_SYNC;
			}
		}
	}
	if (io->fd < 0) {
		io->fd = io->sys.open(path, O_RDONLY, 0);
		if (io->fd < 0)
			return nf_diag_fail(d, -errno, "%s: cannot open: %s", path, nf_strerror(-errno));
	}
	return 0;
}

int nf_io_ctx_open(struct nf_store *s, const struct nf_io_opts *o, struct nf_io_ctx **out,
		   struct nf_diag *d)
{
	int rc;
	*out = NULL;
	struct nf_io_ctx *io = calloc(1, sizeof(*io));
	if (!io)
		return -ENOMEM;
	io->fd = -1;
	io->store = s;
	if (o)
		io->opts = *o;
	else
		nf_io_opts_default(&io->opts);
	struct nf_io_opts *op = &io->opts;
	io->sys = op->sys ? *op->sys : *nf_store_sys(s);
	op->sys = NULL;
	if (op->qd == 0 || op->qd > 4096 || op->max_requests == 0 || op->max_segments == 0 ||
	    op->fault.n_rules > NF_IO_FAULT_MAX_RULES) {
		rc = nf_diag_fail(d, NF_EUSAGE, "bad I/O options: qd %u (1..4096), max_requests %u, max_segments %u",
				  op->qd, op->max_requests, op->max_segments);
		goto fail;
	}
	io->block_size = nf_store_info(s)->block_size;

	enum nf_io_backend outer = op->backend == NF_IO_AUTO ? NF_IO_AIO : op->backend;
	enum nf_io_backend inner = outer == NF_IO_FAULT ? op->fault.inner : outer;
	if (outer > NF_IO_FAULT || inner == NF_IO_FAULT || inner > NF_IO_FAULT) {
		rc = nf_diag_fail(d, NF_EUSAGE, "bad backend %d (inner %d)", (int)outer, (int)inner);
		goto fail;
	}
	rc = open_fd(io, &inner, d);
	if (rc < 0)
		goto fail;
	if (outer != NF_IO_FAULT)
		outer = inner;
	io->backend = outer;
	set_align(io, inner != NF_IO_SYNC);

	io->reqs = calloc(op->max_requests, sizeof(*io->reqs));
	io->segs = calloc(op->max_segments, sizeof(*io->segs));
	io->batch = calloc(op->qd, sizeof(*io->batch));
	if (!io->reqs || !io->segs || !io->batch) {
		rc = nf_diag_fail(d, -ENOMEM, "no memory for %u requests and %u segments",
				  op->max_requests, op->max_segments);
		goto fail;
	}
	for (unsigned i = 0; i < op->max_requests; i++) {
		io->reqs[i].next = io->free_reqs;
		io->free_reqs = &io->reqs[i];
	}
	for (unsigned i = 0; i < op->max_segments; i++) {
		io->segs[i].next = io->free_segs;
		io->free_segs = &io->segs[i];
	}
	io->n_free_segs = op->max_segments;

	io->be.ops = ops_for(outer);
	io->be.sys = &io->sys;
	io->be.fd = io->fd;
	io->be.qd = op->qd;
	io->be.fault = &op->fault;
	io->be.inner_ops = ops_for(inner);
	rc = io->be.ops->init(&io->be);
	if (rc == -ENOSYS && (inner == NF_IO_AIO || inner == NF_IO_URING)) {
		/* A kernel (or emulator: qemu-user, seccomp sandboxes) without the
		 * asynchronous interface: same descriptor, pread instead. */
		warn(io, inner == NF_IO_AIO
				 ? "%s: the kernel has no libaio (io_setup: ENOSYS); using the sync (pread) backend"
				 : "%s: the kernel has no io_uring (io_uring_setup: ENOSYS); using the sync (pread) backend",
		     nf_store_path(io->store));
		inner = NF_IO_SYNC;
		if (outer != NF_IO_FAULT)
			outer = NF_IO_SYNC;
		io->backend = outer;
		io->sys.close(io->fd);
		io->fd = io->sys.open(nf_store_path(io->store), O_RDONLY, 0);
		if (io->fd < 0) {
			rc = nf_diag_fail(d, -errno, "%s: cannot open: %s", nf_store_path(io->store),
					  nf_strerror(-errno));
			io->be.ops = NULL;
			goto fail;
		}
		set_align(io, false);
		io->be.fd = io->fd;
		io->be.ops = ops_for(outer);
		io->be.inner_ops = ops_for(inner);
		rc = io->be.ops->init(&io->be);
	}
	if (rc < 0) {
		nf_diag_fail(d, rc, "%s backend: setup failed: %s", io->be.ops->name, nf_strerror(rc));
		io->be.ops = NULL;
		goto fail;
	}
	if (op->completion == NF_IO_COMPLETION_THREAD && (outer == NF_IO_AIO || outer == NF_IO_URING)) {
		pthread_mutexattr_t ma;
		pthread_mutexattr_init(&ma);
		pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
		pthread_mutex_init(&io->mu, &ma);
		pthread_mutexattr_destroy(&ma);
		pthread_condattr_t ca;
		pthread_condattr_init(&ca);
		pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
		pthread_cond_init(&io->done_cv, &ca);
		pthread_condattr_destroy(&ca);
		pthread_cond_init(&io->work_cv, NULL);
		io->threaded = true;
		rc = -pthread_create(&io->thr, NULL, completion_main, io);
		if (rc < 0) {
			nf_diag_fail(d, rc, "cannot start the completion thread: %s", nf_strerror(rc));
			goto fail;
		}
		io->thr_started = true;
	}
	/* docs/FORMAT.md item 22: a store from before bundle checksums is
	 * read, but said loudly: single-bundle reads cannot be verified. */
	for (uint32_t i = 0; !io->opts.no_verify && !io->opts.quiet && i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind == NF_STORE_KIND_FFN && !ob->bundle_crc) {
			fprintf(stderr, "nflash: warning: %s has no bundle checksums (written by an older "
				"nflash): single-bundle reads are NOT verified; `nflash store relayout` or "
				"a new import adds them\n", nf_store_path(s));
			break;
		}
	}
	*out = io;
	return 0;
fail:
	nf_io_ctx_close(io);
	return rc;
}

void nf_io_ctx_close(struct nf_io_ctx *io)
{
	if (!io)
		return;
	if (io->thr_started) {
		pthread_mutex_lock(&io->mu);
		io->thr_stop = true;
		pthread_cond_signal(&io->work_cv);
		pthread_mutex_unlock(&io->mu);
		pthread_join(io->thr, NULL);
	}
	if (io->threaded) {
		pthread_cond_destroy(&io->done_cv);
		pthread_cond_destroy(&io->work_cv);
		pthread_mutex_destroy(&io->mu);
	}
	if (io->be.ops) {
		/* Reads in flight still target caller buffers: let them land. */
		struct nf_io_seg *done[64];
		while (be_inflight(io) > 0) {
			int n = io->be.ops->reap(&io->be, 1, 64, -1, done);
			if (n < 0 && n != -EINTR)
				break;
		}
		io->be.ops->fini(&io->be);
	}
	if (io->fd >= 0)
		io->sys.close(io->fd);
	free(io->batch);
	free(io->segs);
	free(io->reqs);
	free(io);
}

enum nf_io_backend nf_io_ctx_backend(const struct nf_io_ctx *io)
{
	return io->backend;
}

uint32_t nf_io_ctx_align(const struct nf_io_ctx *io)
{
	return io->align;
}

const char *nf_io_ctx_warning(const struct nf_io_ctx *io)
{
	return io->warning;
}

const char *nf_io_ctx_error_detail(const struct nf_io_ctx *io)
{
	return io->detail;
}

int nf_io_ctx_error(const struct nf_io_ctx *io)
{
	lock((struct nf_io_ctx *)io);
	int e = io->err;
	unlock((struct nf_io_ctx *)io);
	return e;
}

unsigned int nf_io_ctx_pending(const struct nf_io_ctx *io)
{
	lock((struct nf_io_ctx *)io);
	unsigned int n = io->pending_reqs;
	unlock((struct nf_io_ctx *)io);
	return n;
}

void nf_io_ctx_stats(const struct nf_io_ctx *io, struct nf_io_stats *out)
{
	lock((struct nf_io_ctx *)io);
	*out = io->stats;
	unlock((struct nf_io_ctx *)io);
}

/* ---- request construction ------------------------------------------- */

static int check_aligned(const struct nf_io_ctx *io, const void *buf, uint64_t off, uint64_t len)
{
	if ((uintptr_t)buf % io->mem_align || off % io->off_align || len % io->off_align || len == 0)
		return NF_EALIGN;
	return 0;
}

static struct nf_io_req *req_get(struct nf_io_ctx *io, unsigned int nseg, int *rc)
{
	if (io->err) {
		*rc = io->err;
		return NULL;
	}
	if (!io->free_reqs || io->n_free_segs < nseg) {
		*rc = -EAGAIN;
		return NULL;
	}
	struct nf_io_req *r = io->free_reqs;
	io->free_reqs = r->next;
	memset(r, 0, sizeof(*r));
	return r;
}

static void seg_add(struct nf_io_ctx *io, struct nf_io_req *r, uint64_t off, uint32_t len,
		    uint8_t *buf)
{
	struct nf_io_seg *s = io->free_segs;
	io->free_segs = s->next;
	io->n_free_segs--;
	s->req = r;
	s->offset = off;
	s->len = len;
	s->buf = buf;
	s->res = 0;
	s->fault = 0;
	s->next = NULL;
	if (io->q_tail)
		io->q_tail->next = s;
	else
		io->q_head = s;
	io->q_tail = s;
	r->pending++;
}

static void seg_put(struct nf_io_ctx *io, struct nf_io_seg *s)
{
	s->next = io->free_segs;
	io->free_segs = s;
	io->n_free_segs++;
}

/* Submit queued segments up to the queue depth, in batches. */
static int kick(struct nf_io_ctx *io)
{
	while (!io->err && io->q_head && be_inflight(io) < io->opts.qd) {
		unsigned int room = io->opts.qd - be_inflight(io), n = 0;
		uint64_t now = nf_io_now_ns();
		struct nf_io_seg *s = io->q_head;
		for (; s && n < room; s = s->next) {
			s->t_submit = now;
			io->batch[n++] = s;
		}
		/* Backends reuse seg->next once they own a segment. */
		struct nf_io_seg *rest = s;
		int r = io->be.ops->submit(&io->be, io->batch, n);
		if (r < 0) {
			io->err = r;
			return r;
		}
		io->stats.submits++;
		io->q_head = (unsigned)r < n ? io->batch[r] : rest;
		if (!io->q_head)
			io->q_tail = NULL;
		if (io->threaded && r > 0)
			pthread_cond_signal(&io->work_cv);
		if ((unsigned)r < n)
			break;   /* kernel full: retry after completions */
	}
	return io->err;
}

/* Queue [off, off + len) into buf as segments of at most max_coalesce bytes,
 * cut at multiples of cut (extent size) where possible. */
static unsigned int count_split(uint64_t len, uint64_t maxc)
{
	return (unsigned int)((len + maxc - 1) / maxc);
}

static void queue_range(struct nf_io_ctx *io, struct nf_io_req *r, uint64_t off, uint64_t len,
			uint8_t *buf, uint64_t maxc)
{
	while (len) {
		uint64_t k = len < maxc ? len : maxc;
		seg_add(io, r, off, (uint32_t)k, buf);
		off += k;
		buf += k;
		len -= k;
	}
}

/* Largest segment for an FFN: whole extents when an extent fits. */
static uint64_t ffn_seg_max(const struct nf_io_ctx *io, const struct nf_store_object *obj)
{
	uint64_t ext = (uint64_t)obj->extent_bundles * obj->stride;
	uint64_t maxc = io->opts.max_coalesce;
	if (ext <= maxc)
		return maxc / ext * ext;
	return maxc;
}

static int start(struct nf_io_ctx *io, struct nf_io_req *r, enum req_kind kind,
		 const struct nf_store_object *obj, void *buf, nf_io_done_fn cb, void *cookie)
{
	r->kind = kind;
	r->obj = obj;
	r->buf = buf;
	r->cb = cb;
	r->cookie = cookie;
	io->pending_reqs++;
	/* Submit now, also from inside a callback: batching the reads queued
	 * by a whole batch of completions into one io_submit let the block
	 * layer merge adjacent extents into 1 MiB+ requests, which served the
	 * same bytes at a lower device queue depth (docs/STORAGE.md). A submit
	 * failure is reported through the callbacks (the request is queued);
	 * only pre-queue failures are returned. */
	kick(io);
	return 0;
}

/* One contiguous range as segments of at most maxc bytes. */
static int read_range(struct nf_io_ctx *io, enum req_kind kind, const struct nf_store_object *obj,
		      uint64_t off, uint64_t len, uint64_t maxc, void *buf, uint32_t first,
		      uint32_t count, nf_io_done_fn cb, void *cookie)
{
	int rc = check_aligned(io, buf, off, len);
	if (rc < 0)
		return rc;
	struct nf_io_req *r = req_get(io, count_split(len, maxc), &rc);
	if (!r)
		return rc;
	r->first = first;
	r->count = count;
	queue_range(io, r, off, len, buf, maxc);
	return start(io, r, kind, obj, buf, cb, cookie);
}

static int do_read_raw(struct nf_io_ctx *io, uint64_t offset, uint64_t len, void *buf,
		       nf_io_done_fn cb, void *cookie)
{
	return read_range(io, REQ_RAW, NULL, offset, len, io->opts.max_coalesce, buf, 0, 0, cb,
			  cookie);
}

static int do_read_extents(struct nf_io_ctx *io, const struct nf_store_object *obj,
			   uint32_t first, uint32_t count, void *buf, nf_io_done_fn cb, void *cookie)
{
	if (obj->kind != NF_STORE_KIND_FFN || count == 0 || first >= obj->n_extents ||
	    count > obj->n_extents - first)
		return NF_EUSAGE;
	uint64_t off, len, o2, l2;
	nf_store_extent_span(obj, first, &off, &len);
	nf_store_extent_span(obj, first + count - 1, &o2, &l2);
	if (check_aligned(io, buf, obj->stride, obj->stride) < 0)
		return NF_EALIGN;
	return read_range(io, REQ_EXTENTS, obj, off, o2 + l2 - off, ffn_seg_max(io, obj), buf, first,
			  count, cb, cookie);
}

static int do_read_object(struct nf_io_ctx *io, const struct nf_store_object *obj, void *buf,
			  nf_io_done_fn cb, void *cookie)
{
	if (obj->kind == NF_STORE_KIND_FFN)
		return do_read_extents(io, obj, 0, obj->n_extents, buf, cb, cookie);
	return read_range(io, REQ_OBJECT, obj, obj->offset,
			  nf_store_object_buf_size(obj, io->block_size), io->opts.max_coalesce, buf,
			  0, 0, cb, cookie);
}

static int do_read_bundles(struct nf_io_ctx *io, const struct nf_store_object *obj,
			   const uint32_t *slots, uint32_t n, void *buf, nf_io_done_fn cb,
			   void *cookie)
{
	if (obj->kind != NF_STORE_KIND_FFN || n == 0)
		return NF_EUSAGE;
	int rc = check_aligned(io, buf, obj->offset, obj->stride);
	if (rc < 0)
		return rc;
	uint64_t maxc = io->opts.max_coalesce;
	if (maxc < obj->stride)
		maxc = obj->stride;
	/* Pass 1: validate and count runs. */
	unsigned int nseg = 0;
	uint64_t run = 0;
	for (uint32_t k = 0; k < n; k++) {
		if (slots[k] >= obj->n_bundles)
			return NF_EUSAGE;
		if (k > 0 && slots[k] == slots[k - 1] + 1 && run + obj->stride <= maxc) {
			run += obj->stride;
		} else {
			nseg++;
			run = obj->stride;
		}
	}
	struct nf_io_req *r = req_get(io, nseg, &rc);
	if (!r)
		return rc;
	/* Pass 2: queue one segment per run. */
	uint8_t *b = buf;
	for (uint32_t k = 0; k < n;) {
		uint32_t j = k + 1;
		uint64_t len = obj->stride;
		while (j < n && slots[j] == slots[j - 1] + 1 && len + obj->stride <= maxc) {
			len += obj->stride;
			j++;
		}
		seg_add(io, r, nf_store_bundle_offset(obj, slots[k]), (uint32_t)len,
			b + (uint64_t)k * obj->stride);
		k = j;
	}
	return start(io, r, REQ_BUNDLES, obj, buf, cb, cookie);
}

/* ---- public entry points (locked in thread mode) -------------------- */

int nf_io_ctx_read_raw(struct nf_io_ctx *io, uint64_t offset, uint64_t len, void *buf,
		       nf_io_done_fn cb, void *cookie)
{
	lock(io);
	int rc = do_read_raw(io, offset, len, buf, cb, cookie);
	unlock(io);
	return rc;
}

int nf_io_ctx_read_extents(struct nf_io_ctx *io, const struct nf_store_object *obj,
			   uint32_t first, uint32_t count, void *buf, nf_io_done_fn cb, void *cookie)
{
	lock(io);
	int rc = do_read_extents(io, obj, first, count, buf, cb, cookie);
	unlock(io);
	return rc;
}

int nf_io_ctx_read_object(struct nf_io_ctx *io, const struct nf_store_object *obj, void *buf,
			  nf_io_done_fn cb, void *cookie)
{
	lock(io);
	int rc = do_read_object(io, obj, buf, cb, cookie);
	unlock(io);
	return rc;
}

int nf_io_ctx_read_bundles(struct nf_io_ctx *io, const struct nf_store_object *obj,
			   const uint32_t *slots, uint32_t n, void *buf, nf_io_done_fn cb,
			   void *cookie)
{
	lock(io);
	int rc = do_read_bundles(io, obj, slots, n, buf, cb, cookie);
	unlock(io);
	return rc;
}

/* ---- completion ------------------------------------------------------ */

/* Name the first failure: object, unit and file offset. */
static void detail(struct nf_io_ctx *io, const struct nf_store_object *obj, const char *unit,
		   uint32_t k, uint64_t off, int err)
{
	if (io->detail[0])
		return;
	if (obj && unit)
		snprintf(io->detail, sizeof(io->detail), "%s: %s %u at offset %llu: %s", obj->name, unit,
			 k, (unsigned long long)off, err == NF_ECHECKSUM ? "crc32c mismatch" : nf_strerror(err));
	else
		snprintf(io->detail, sizeof(io->detail), "%s%sread at offset %llu: %s", obj ? obj->name : "",
			 obj ? ": " : "", (unsigned long long)off, nf_strerror(err));
}

/*
 * A segment of a bundle read: the whole extents inside it are checked by
 * their crc32c, every other bundle by its own (docs/FORMAT.md item 22), so
 * every byte handed to compute was verified. Runs in the completion path
 * (the completion thread, in that mode), not in the compute threads.
 */
static int verify_seg_bundles(struct nf_io_ctx *io, const struct nf_io_seg *s)
{
	const struct nf_store_object *obj = s->req->obj;
	uint64_t rel = s->offset - obj->offset;
	uint32_t first = (uint32_t)(rel / obj->stride), n = s->len / obj->stride;
	int rc = 0;
	for (uint32_t b = first; b < first + n;) {
		uint32_t e = b / obj->extent_bundles, ef, ec;
		nf_store_extent_bundles(obj, e, &ef, &ec);
		if (ef == b && ef + ec <= first + n) {       /* a whole extent */
			io->stats.verified += (uint64_t)ec * obj->stride;
			if (nf_store_extent_check(obj, e, s->buf + (uint64_t)(b - first) * obj->stride) < 0) {
				rc = NF_ECHECKSUM;
				detail(io, obj, "extent", e, nf_store_bundle_offset(obj, b), rc);
			}
			b += ec;
			continue;
		}
		int v = nf_store_bundle_check(obj, b, s->buf + (uint64_t)(b - first) * obj->stride);
		if (v < 0) {
			rc = v;
			detail(io, obj, "bundle", b, nf_store_bundle_offset(obj, b), rc);
		} else if (v == 0) {
			io->stats.verified += obj->bundle_bytes;
		}
		b++;
	}
	return rc;
}

static int verify_req(struct nf_io_ctx *io, const struct nf_io_req *r)
{
	const struct nf_store_object *obj = r->obj;
	int rc = 0;
	if (r->kind == REQ_OBJECT) {
		io->stats.verified += obj->length;
		rc = nf_store_object_check(obj, r->buf);
		if (rc < 0)
			detail(io, obj, "object", obj->index, obj->offset, rc);
		return rc;
	}
	uint64_t base, len;
	nf_store_extent_span(obj, r->first, &base, &len);
	for (uint32_t e = r->first; e < r->first + r->count; e++) {
		uint64_t eo;
		nf_store_extent_span(obj, e, &eo, &len);
		io->stats.verified += len;
		if (nf_store_extent_check(obj, e, r->buf + (eo - base)) < 0) {
			rc = NF_ECHECKSUM;
			detail(io, obj, "extent", e, eo, rc);
		}
	}
	return rc;
}

/* Returns 1 when this completed the request (its callback ran). */
static int complete_seg(struct nf_io_ctx *io, struct nf_io_seg *s)
{
	struct nf_io_req *r = s->req;
	uint64_t lat = nf_io_now_ns() - s->t_submit;
	int err = 0;
	if (s->res < 0)
		err = (int)s->res;
	else if ((uint64_t)s->res != s->len)
		err = NF_ESHORT;
	if (io->opts.on_read && s->t_submit)
		io->opts.on_read(io->opts.on_read_user, s->offset, s->len, s->res, lat);
	if (err) {
		if (err != -ECANCELED && err != io->err)
			detail(io, r->obj, NULL, 0, s->offset, err);
		if (!io->err && err != -ECANCELED)
			io->err = err;
		if (!r->result)
			r->result = err;
	} else {
		io->stats.reads++;
		io->stats.bytes += s->len;
		if (r->kind == REQ_BUNDLES && !io->opts.no_verify) {
			uint64_t t0 = nf_io_now_ns();
			int v = verify_seg_bundles(io, s);
			io->stats.verify_ns += nf_io_now_ns() - t0;
			if (v < 0 && !r->result)
				r->result = v;
		}
	}
	seg_put(io, s);
	if (--r->pending)
		return 0;
	int result = r->result;
	if (!result && !io->opts.no_verify && (r->kind == REQ_EXTENTS || r->kind == REQ_OBJECT)) {
		uint64_t t0 = nf_io_now_ns();
		result = verify_req(io, r);
		io->stats.verify_ns += nf_io_now_ns() - t0;
	}
	nf_io_done_fn cb = r->cb;
	void *cookie = r->cookie;
	r->next = io->free_reqs;
	io->free_reqs = r;
	io->pending_reqs--;
	io->stats.requests++;
	io->completed++;
	if (cb)
		cb(cookie, result);
	return 1;
}

/* After a sticky error, queued segments never reach the kernel. */
static int cancel_queued(struct nf_io_ctx *io)
{
	int done = 0;
	while (io->q_head) {
		struct nf_io_seg *s = io->q_head;
		io->q_head = s->next;
		if (!io->q_head)
			io->q_tail = NULL;
		s->res = io->err;
		s->t_submit = 0;
		done += complete_seg(io, s);
	}
	return done;
}

static int wait_threaded(struct nf_io_ctx *io, unsigned int min_requests, int timeout_ms)
{
	struct timespec dl;
	clock_gettime(CLOCK_MONOTONIC, &dl);
	if (timeout_ms >= 0) {
		dl.tv_sec += timeout_ms / 1000;
		dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
		if (dl.tv_nsec >= 1000000000L) {
			dl.tv_sec++;
			dl.tv_nsec -= 1000000000L;
		}
	}
	pthread_mutex_lock(&io->mu);
	uint64_t start = io->completed;
	int rc = 0;
	for (;;) {
		if (io->err)
			cancel_queued(io);
		uint64_t done = io->completed - start;
		if (min_requests ? done >= min_requests : io->pending_reqs == 0)
			break;
		if (be_inflight(io) == 0 && !io->q_head && io->pending_reqs == 0)
			break;
		int w = timeout_ms < 0 ? pthread_cond_wait(&io->done_cv, &io->mu)
				       : pthread_cond_timedwait(&io->done_cv, &io->mu, &dl);
		if (w == ETIMEDOUT) {
			rc = -ETIMEDOUT;
			break;
		}
	}
	if (rc == 0)
		rc = io->err ? io->err : (int)(io->completed - start);
	pthread_mutex_unlock(&io->mu);
	return rc;
}

/* The completion thread: reap without the lock, complete with it. */
static void *completion_main(void *arg)
{
	struct nf_io_ctx *io = arg;
	struct nf_io_seg *done[256];
	pthread_mutex_lock(&io->mu);
	while (!io->thr_stop) {
		if (be_inflight(io) == 0) {
			pthread_cond_wait(&io->work_cv, &io->mu);
			continue;
		}
		pthread_mutex_unlock(&io->mu);
		int n = io->be.ops->reap(&io->be, 1, sizeof(done) / sizeof(done[0]), 50000000, done);
		pthread_mutex_lock(&io->mu);
		if (n < 0 && n != -EINTR && !io->err)
			io->err = n;
		for (int i = 0; i < n; i++)
			complete_seg(io, done[i]);
		kick(io);
		if (io->err)
			cancel_queued(io);
		pthread_cond_broadcast(&io->done_cv);
	}
	pthread_mutex_unlock(&io->mu);
	return NULL;
}

int nf_io_ctx_poll(struct nf_io_ctx *io)
{
	if (io->threaded)
		return 0;
	int completed = 0;
	struct nf_io_seg *done[256];
	const unsigned int max = sizeof(done) / sizeof(done[0]);
	while (!io->err && be_inflight(io)) {
		int n = io->be.ops->reap(&io->be, 0, max, 0, done);
		if (n == -EINTR)
			continue;
		if (n < 0) {
			io->err = n;
			return n;
		}
		for (int i = 0; i < n; i++)
			completed += complete_seg(io, done[i]);
		kick(io);
		if ((unsigned)n < max)
			break;
	}
	if (io->err)
		completed += cancel_queued(io);
	return io->err ? io->err : completed;
}

int nf_io_ctx_wait(struct nf_io_ctx *io, unsigned int min_requests, int timeout_ms)
{
	if (io->threaded)
		return wait_threaded(io, min_requests, timeout_ms);
	uint64_t deadline = timeout_ms < 0 ? UINT64_MAX
					   : nf_io_now_ns() + (uint64_t)timeout_ms * 1000000ull;
	int completed = 0;
	struct nf_io_seg *done[256];
	for (;;) {
		kick(io);
		if (io->err)
			completed += cancel_queued(io);
		if (min_requests ? (unsigned)completed >= min_requests : io->pending_reqs == 0)
			break;
		if (be_inflight(io) == 0)
			break;   /* nothing can complete any more */
		uint64_t now = nf_io_now_ns();
		if (now >= deadline)
			return -ETIMEDOUT;
		int64_t left = deadline == UINT64_MAX ? -1 : (int64_t)(deadline - now);
		unsigned int max = sizeof(done) / sizeof(done[0]);
		int n = io->be.ops->reap(&io->be, 1, max, left, done);
		if (n == -EINTR)
			continue;
		if (n < 0) {
			if (!io->err)
				io->err = n;
			return n;
		}
		for (int i = 0; i < n; i++)
			completed += complete_seg(io, done[i]);
	}
	return io->err ? io->err : completed;
}
